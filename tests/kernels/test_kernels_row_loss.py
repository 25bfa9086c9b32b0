"""The one-launch chunk step (kernels/policy_loss_triton.py's ``rows`` kernel, run by TRITON_INTERPRET=1): a
chunk's softmax statistics, its tokens' policy loss and metric sums, and its dlogits, against the three launches
it replaces (the stats and gradient primitives of logprob_entropy.py around policy_loss_from_token_stats, the
reference of the loss math). fp32 and bf16 logits, vocabularies across several blocks, -inf logits, masked rows
holding NaN, every loss option the kernel covers, temperature, and the launch's host code on meta tensors.
test_kernels_fused_linear.py runs it inside fused_linear_policy_loss against the float64 reference, with the
switch (fused_linear_paths) both ways."""

import importlib
import itertools
import types

import pytest
import torch
from fastrlhf.kernels import fused_linear_chunks as chunks
from fastrlhf.kernels import policy_loss_triton
from fastrlhf.kernels.fused_linear_chunks import PATHS, fused_linear_paths
from fastrlhf.kernels.logprob_entropy import logprob_entropy_grad, logprob_entropy_stats
from fastrlhf.kernels.policy_loss import METRIC_SUM_KEYS, policy_loss_from_token_stats
from fastrlhf.kernels.policy_loss_triton import triton_row_loss_and_grad


def chunk_inputs(n, v, dtype=torch.float32, seed=0, on_policy=False, with_ref=True):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    logits[1, 3: v // 2] = float("-inf")  # a row with half its vocabulary impossible
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1] = v - 1  # a possible token of that row
    weights = torch.rand(n, generator=g) + 0.1
    weights[2] = weights[n - 1] = 0.0  # masked rows, one of them the last
    logits[2] = float("nan")  # a masked row is never read: NaN there reaches nothing
    old = -torch.rand(n, generator=g) * 5
    ref = -torch.rand(n, generator=g) * 5
    old[2] = ref[2] = float("nan")
    return dict(logits=logits, labels=labels, old_logprobs=None if on_policy else old,
                advantages=torch.randn(n, generator=g), weights=weights, ref_logprobs=ref if with_ref else None)


def three_launches(x, temperature, kw):
    """What the kernel replaces: stats, the token loss (its reference), then the gradient, into fp32."""
    lp, ent, lse = logprob_entropy_stats(x["logits"], x["labels"], temperature, "triton")
    loss, g_lp, g_ent, sums = policy_loss_from_token_stats(lp, ent, x["old_logprobs"], x["advantages"], x["weights"],
                                                           x["ref_logprobs"], **kw)
    keep = x["weights"] > 0
    dlogits = logprob_entropy_grad(x["logits"], x["labels"], lse, ent, g_lp, g_ent if kw["entropy_coef"] else None,
                                   temperature, "triton", out=torch.empty(x["logits"].shape))
    dlogits[~keep] = 0.0  # the three launches leave a masked row's (NaN) softmax times a zero gradient
    return loss, sums, dlogits


def assert_same_step(got_loss, got_sums, got_d, want_loss, want_sums, want_d, dtype, what):
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5, msg=f"loss ({what})")
    assert set(got_sums) == set(METRIC_SUM_KEYS)
    for k in METRIC_SUM_KEYS:
        torch.testing.assert_close(got_sums[k], want_sums[k], rtol=1e-5, atol=1e-4, msg=f"{k} ({what})")
    assert got_d.dtype == dtype and torch.isfinite(got_d).all(), what
    # The per-token gradients agree to fp32 rounding (the kernel's derivatives against autograd's); bf16 rounds
    # (the interpreter truncates) the same fp32 values, so one bf16 step at most.
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(got_d.float(), want_d.to(dtype).float(), **tol, msg=f"dlogits ({what})")


OPTIONS = list(itertools.product(
    [False, True],  # on-policy
    [None, "k1", "abs", "k2", "k3"],  # no reference, or its KL kind
    [None, 3.0],  # dual clip
    [0.0, 0.02],  # entropy coefficient
))


@pytest.mark.parametrize("on_policy,kl_kind,dual_clip,entropy_coef", OPTIONS)
def test_row_kernel_equals_the_three_launches_for_every_option(on_policy, kl_kind, dual_clip, entropy_coef):
    x = chunk_inputs(7, 301, on_policy=on_policy, with_ref=kl_kind is not None, seed=1)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, kl_coef=0.1 if kl_kind else 0.0,
              kl_kind=kl_kind or "k3", entropy_coef=entropy_coef)
    out = torch.full(x["logits"].shape, float("nan"))  # every entry written, masked rows included
    loss, sums = triton_row_loss_and_grad(**x, temperature=0.9, out=out, block_v=64, **kw)
    assert_same_step(loss, sums, out, *three_launches(x, 0.9, kw), torch.float32,
                     f"on_policy={on_policy} kl={kl_kind} dual={dual_clip} ent={entropy_coef}")


@pytest.mark.parametrize("loss,options", [("cispo", None), ("sapo", {"tau_pos": 0.6, "tau_neg": 1.7})])
@pytest.mark.parametrize("on_policy,kl_kind", [(False, "k3"), (True, None), (False, "k2")])
def test_row_kernel_equals_the_three_launches_for_cispo_and_sapo(loss, options, on_policy, kl_kind):
    x = chunk_inputs(7, 301, on_policy=on_policy, with_ref=kl_kind is not None, seed=6)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=0.1 if kl_kind else 0.0, kl_kind=kl_kind or "k3",
              entropy_coef=0.02, policy_loss=loss, policy_loss_args=options)
    out = torch.full(x["logits"].shape, float("nan"))
    got_loss, got_sums = triton_row_loss_and_grad(**x, temperature=0.9, out=out, block_v=64, **kw)
    assert_same_step(got_loss, got_sums, out, *three_launches(x, 0.9, kw), torch.float32,
                     f"{loss} on_policy={on_policy} kl={kl_kind}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v,block_v", [(301, 64), (4097, 1024), (50, None)])
def test_row_kernel_in_place_across_blocks(dtype, v, block_v):
    x = chunk_inputs(5, v, dtype=dtype, seed=2)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=0.05, kl_kind="k3", entropy_coef=0.01)
    want = three_launches(x, 1.1, kw)
    logits = x["logits"].clone()
    loss, sums = triton_row_loss_and_grad(**dict(x, logits=logits), temperature=1.1, out=logits, block_v=block_v,
                                          **kw)
    assert_same_step(loss, sums, logits, *want, dtype, f"{dtype} V={v} block={block_v}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_programs_than_rows_give_the_same_bits(dtype):
    """A program per SM (``programs``), each looping over rows, computes every row as a program per row does: the
    same bits, masked rows (the first and last) included, with rows left over after the last full round."""
    x = chunk_inputs(9, 301, dtype=dtype, seed=5)
    x["weights"][0] = 0.0
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=0.05, kl_kind="k3", entropy_coef=0.01)
    want_out = torch.full(x["logits"].shape, float("nan"), dtype=dtype)
    want_loss, want_sums = triton_row_loss_and_grad(**x, temperature=0.8, out=want_out, block_v=64, **kw)
    for programs in (1, 2, 4, 9, 64):
        out = torch.full(x["logits"].shape, float("nan"), dtype=dtype)
        loss, sums = triton_row_loss_and_grad(**x, temperature=0.8, out=out, block_v=64, programs=programs, **kw)
        assert torch.equal(out, want_out) and torch.equal(loss, want_loss), programs
        assert all(torch.equal(sums[k], want_sums[k]) for k in METRIC_SUM_KEYS), programs
    with pytest.raises(ValueError, match="programs must be a positive int"):
        triton_row_loss_and_grad(**x, temperature=0.8, out=out, programs=0, **kw)


def test_row_programs_are_the_sms_times_the_paths_count_on_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    cuda = torch.device("cuda", 0)
    assert chunks.row_programs(cuda) is None and PATHS.row_programs_per_sm == 0  # the default: a program per row
    with fused_linear_paths(row_programs_per_sm=1):
        assert chunks.row_programs(cuda) == 132
        assert chunks.row_programs(torch.device("cpu")) is None and chunks.row_programs(torch.device("meta")) is None
    with fused_linear_paths(row_programs_per_sm=2):
        assert chunks.row_programs(cuda) == 264


def test_the_looping_row_kernel_takes_wider_blocks_on_a_gpu_only():
    assert policy_loss_triton.row_block_v(152_064, 132, on_gpu=True) == policy_loss_triton.LOOPING_BLOCK_V == 16384
    assert policy_loss_triton.row_block_v(300, 132, on_gpu=True) == 512  # no wider than the vocabulary
    assert policy_loss_triton.row_block_v(152_064, None, on_gpu=True) == 4096  # a program per row: as before
    assert policy_loss_triton.row_block_v(301, 3, on_gpu=False) == policy_loss_triton.row_block_v(301, None, False)


def test_row_kernel_without_its_gradient_pass_writes_nothing():
    x = chunk_inputs(6, 301, seed=3)
    kw = dict(clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.1, kl_kind="k2", entropy_coef=0.0)
    before = x["logits"].clone()
    loss, sums = triton_row_loss_and_grad(**x, temperature=1.0, out=None, block_v=128, **kw)
    want_loss, want_sums, _ = three_launches(x, 1.0, kw)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for k in METRIC_SUM_KEYS:
        torch.testing.assert_close(sums[k], want_sums[k], rtol=1e-5, atol=1e-4)
    assert torch.equal(x["logits"].nan_to_num(), before.nan_to_num())


def test_every_row_masked_is_zero_everywhere():
    x = chunk_inputs(4, 97, seed=4)
    x["weights"] = torch.zeros(4)
    out = torch.full(x["logits"].shape, float("nan"))
    loss, sums = triton_row_loss_and_grad(**x, temperature=1.0, out=out, kl_coef=0.1)
    assert float(loss) == 0.0 and all(float(t) == 0.0 for t in sums.values())
    assert not out.any()
    empty = {k: (v[:0] if isinstance(v, torch.Tensor) else v) for k, v in x.items()}  # no row: no launch, zeros
    loss, sums = triton_row_loss_and_grad(**empty, temperature=1.0, out=empty["logits"], kl_coef=0.1)
    assert float(loss) == 0.0 and all(float(t) == 0.0 for t in sums.values())


def test_row_kernel_argument_errors():
    x = chunk_inputs(3, 40)
    with pytest.raises(ValueError, match="vanilla"):
        triton_row_loss_and_grad(**x, temperature=1.0, policy_loss="gspo")
    with pytest.raises(ValueError, match="dual_clip"):
        triton_row_loss_and_grad(**x, temperature=1.0, dual_clip=0.5)
    with pytest.raises(ValueError, match="KL kind"):
        triton_row_loss_and_grad(**x, temperature=1.0, kl_kind="k9")
    with pytest.raises(ValueError, match="ref_logprobs"):
        triton_row_loss_and_grad(**dict(x, ref_logprobs=None), temperature=1.0, kl_coef=0.1)


def test_the_paths_switch_rejects_an_unknown_path_and_restores_on_error():
    with pytest.raises(ValueError, match="one_pass_rows"):
        with fused_linear_paths(gemm_fp32_sum=False, one_pass=False):  # nothing changed, not even the known one
            pass
    assert PATHS.gemm_fp32_sum
    with pytest.raises(RuntimeError), fused_linear_paths(one_pass_rows=False, gemm_fp32_sum=False):
        assert not PATHS.one_pass_rows and not chunks.accumulates_in_gemm(torch.empty(2, 2, device="meta",
                                                                                       dtype=torch.bfloat16))
        raise RuntimeError
    assert PATHS.one_pass_rows and PATHS.gemm_fp32_sum
    assert chunks.accumulates_in_gemm(torch.empty(2, 2, device="meta", dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# No host read in the launch: its host code run on meta tensors, the kernel stood in for
# ----------------------------------------------------------------------------------------------


def test_the_row_launch_reads_no_value_on_the_host(monkeypatch):
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                launches.append((grid, args, constexprs))

            return launch

    monkeypatch.setattr(policy_loss_triton, "token_loss_kernels", lambda: types.SimpleNamespace(rows=Recorder()))
    meta = torch.device("meta")
    n, v = 12, 152_064
    logits = torch.empty(n, v, dtype=torch.bfloat16, device=meta)
    vec = [torch.empty(n, device=meta) for _ in range(4)]
    loss, sums = triton_row_loss_and_grad(logits, torch.empty(n, dtype=torch.long, device=meta), *vec, 0.9,
                                          out=logits, kl_coef=0.1, dual_clip=3.0)
    assert loss.device == meta and set(sums) == set(METRIC_SUM_KEYS)
    (grid, args, constexprs), = launches
    assert grid == (n,) and args[7] is logits  # in place
    assert all(constexprs[k] for k in ("NEED_GRAD", "HAS_DUAL", "HAS_OLD", "HAS_REF"))
    assert args[10:12] == (n, n)  # the rows, and a program for each
    triton_row_loss_and_grad(logits, torch.empty(n, dtype=torch.long, device=meta), *vec, 0.9, out=logits,
                             kl_coef=0.1, programs=5)
    assert launches[1][0] == (5,) and launches[1][1][10:12] == (n, 5)


def test_the_chunk_loop_through_the_row_kernel_reads_no_value_on_the_host(monkeypatch):
    """fused_linear_policy_loss's loop around the row kernel (the launch stood in for by a meta-safe function of
    its results' shapes), forward and backward on meta tensors: five chunks, each through the row kernel."""
    fl_module = importlib.import_module("fastrlhf.kernels.fused_linear")
    calls = []

    def stand_in(logits, labels, *args, out=None, **kwargs):
        calls.append(out is logits)
        zero = torch.zeros((), device=logits.device)
        return zero, {k: zero for k in METRIC_SUM_KEYS}

    monkeypatch.setattr(fl_module, "_row_loss_function", lambda backend, policy_loss: stand_in)
    meta = torch.device("meta")
    hidden = torch.empty(4, 10, 16, dtype=torch.bfloat16, device=meta, requires_grad=True)
    weight = torch.empty(300, 16, dtype=torch.bfloat16, device=meta, requires_grad=True)
    per_token = [torch.empty(4, 10, device=meta) for _ in range(4)]
    loss, _ = fl_module.fused_linear_policy_loss(hidden, weight, torch.empty(4, 10, dtype=torch.long, device=meta),
                                                 *per_token[:3], ref_logprobs=per_token[3], kl_coef=0.1,
                                                 chunk_size=8, backend="torch")
    loss.backward()
    assert calls == [True] * 5
    assert hidden.grad.device == meta and weight.grad.shape == weight.shape
