"""logprob_entropy and its internal stats/grad functions against fastrlhf.algorithms, both backends.

The reference is fastrlhf.algorithms in float64 on the same logit values; outputs must lie within the
fp32 error bounds of tests/helpers/fp32_bounds.py, which hold whatever order the kernels sum in (the
CPU's vector width, the Triton block). The Triton backend runs under TRITON_INTERPRET=1
(tests/conftest.py); interpreter cost is per program and loop iteration, so N stays small and the
block covers V unless a test wants the loop.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch
from fastrlhf.kernels.logprob_entropy import (
    default_block_v,
    logprob_entropy,
    logprob_entropy_grad,
    logprob_entropy_stats,
)
from helpers.fp32_bounds import assert_within, softmax_bounds, softmax_grad_bound, softmax_probs_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from fastrlhf.algorithms import entropy_from_logits, logprobs_from_logits

le_module = importlib.import_module("fastrlhf.kernels.logprob_entropy")
le_triton_module = importlib.import_module("fastrlhf.kernels.logprob_entropy_triton")
le_torch_module = importlib.import_module("fastrlhf.kernels.logprob_entropy_torch")

BACKENDS = ["torch", "triton"]


def make_logits(shape, dtype=torch.float32, seed=0, neg_inf_rows=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g) * 3
    flat = logits.view(-1, shape[-1])
    for r in neg_inf_rows:
        flat[r, : shape[-1] // 2] = float("-inf")
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    # A label on a finite logit in the -inf rows (their upper half is finite).
    for r in neg_inf_rows:
        labels.view(-1)[r] = shape[-1] - 1
    return logits.to(dtype), labels


def reference(logits, labels, temperature, g_lp, g_ent):
    """float64 (logprobs, entropy, dlogits) from the reference math with autograd, on the same logit
    values (bf16 / fp16 / fp32 are exact in float64)."""
    x = logits.detach().double().requires_grad_()
    lp = logprobs_from_logits(x, labels, temperature)
    ent = entropy_from_logits(x, temperature)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def blocks(backend, vocab, block_v=None):
    """Vocabulary blocks of the Triton stats kernel's online softmax (each rescales its running sums)."""
    return -(-vocab // (block_v or default_block_v(vocab))) if backend == "triton" else 1


def bounds(logits, labels, temperature, backend, block_v=None):
    return softmax_bounds(logits, labels, temperature, blocks=blocks(backend, logits.shape[-1], block_v))


def grad_bound(stats, g_lp, g_ent, dtype, backend):
    # The Triton interpreter truncates fp32 -> bf16 where a GPU (and torch) rounds to nearest.
    return softmax_grad_bound(stats, g_lp, g_ent, out_dtype=dtype, truncates=backend == "triton")


def assert_grad_within(actual, expected, bound, dtype, what="dlogits"):
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all()
    return assert_within(actual, expected, bound.bound, what)


def assert_stats_within(stats, lp, ent, lse=None, lp_ref=None, ent_ref=None):
    ratios = [assert_within(lp, stats.logprobs if lp_ref is None else lp_ref, stats.logprobs_bound, "logprobs"),
              assert_within(ent, stats.entropy if ent_ref is None else ent_ref, stats.entropy_bound, "entropy")]
    if lse is not None:
        ratios.append(assert_within(lse, stats.lse, stats.lse_bound, "lse"))
    return ratios


def check_against_reference(logits, labels, temperature, backend, seed=1):
    g = torch.Generator().manual_seed(seed)
    g_lp = torch.randn(labels.shape, generator=g)
    g_ent = torch.randn(labels.shape, generator=g)
    lp_ref, ent_ref, grad_ref = reference(logits, labels, temperature, g_lp, g_ent)
    stats = bounds(logits, labels, temperature, backend)
    x = logits.detach().clone().requires_grad_()
    lp, ent = logprob_entropy(x, labels, temperature, backend=backend)
    assert lp.dtype == ent.dtype == torch.float32
    assert lp.shape == ent.shape == labels.shape
    assert torch.isfinite(ent).all()
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    # Values are fp32 math on the same inputs whatever the logits dtype.
    ratios = assert_stats_within(stats, lp, ent, lp_ref=lp_ref, ent_ref=ent_ref)
    ratios.append(assert_grad_within(x.grad, grad_ref, grad_bound(stats, g_lp, g_ent, logits.dtype, backend),
                                     logits.dtype))
    return ratios


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [7, 1000, 4097, 32003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_across_vocab_sizes(backend, vocab, dtype):
    n = 3 if vocab > 5000 else 6
    logits, labels = make_logits((n, vocab), dtype, seed=vocab, neg_inf_rows=(1,))
    check_against_reference(logits, labels, 0.7, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_batched_shape_and_fp16(backend, temperature):
    logits, labels = make_logits((2, 3, 50), torch.float16, seed=3)
    check_against_reference(logits, labels, temperature, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_row(backend):
    logits, labels = make_logits((1, 33), seed=4)
    check_against_reference(logits, labels, 1.0, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    logits = torch.randn(0, 11, requires_grad=True)
    lp, ent = logprob_entropy(logits, torch.zeros(0, dtype=torch.long), backend=backend)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.shape == (0, 11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_logits_keep_entropy_and_gradient_finite(backend):
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")], [float("-inf")] * 3 + [2.0]])
    labels = torch.tensor([2, 3])
    x = logits.clone().requires_grad_()
    lp, ent = logprob_entropy(x, labels, backend=backend)
    (lp.sum() + ent.sum()).backward()
    stats = bounds(logits, labels, 1.0, backend)
    assert_stats_within(stats, lp, ent)
    assert ent[1].item() == 0.0 and lp[1].item() == 0.0  # one finite logit: a point mass
    assert torch.isfinite(x.grad).all()
    assert (x.grad[torch.isneginf(logits)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_multi_block_loop_with_ragged_tail(dtype):
    """V not a multiple of the block: the online max/sum crosses blocks and the tail is masked."""
    logits, labels = make_logits((4, 1000), dtype, seed=5, neg_inf_rows=(2,))
    g_lp, g_ent = torch.randn(4), torch.randn(4)
    _, _, grad_ref = reference(logits, labels, 0.9, g_lp, g_ent)
    stats = bounds(logits, labels, 0.9, "triton", block_v=128)
    lp, ent, lse = logprob_entropy_stats(logits, labels, 0.9, "triton", block_v=128)
    assert_stats_within(stats, lp, ent, lse)
    grad = logprob_entropy_grad(logits, labels, lse, ent, g_lp, g_ent, 0.9, "triton", block_v=128)
    assert_grad_within(grad, grad_ref, grad_bound(stats, g_lp, g_ent, dtype, "triton"), dtype)


def test_public_op_uses_capped_block(monkeypatch):
    monkeypatch.setattr(le_triton_module, "MAX_BLOCK_V_INTERPRETER", 64)
    assert default_block_v(4097, on_gpu=False) == 64
    assert default_block_v(4097, on_gpu=True) == le_triton_module.MAX_BLOCK_V_GPU
    logits, labels = make_logits((3, 301), seed=6)
    check_against_reference(logits, labels, 1.0, "triton")


@pytest.mark.parametrize("chunk_rows", [1, 3])
def test_torch_path_across_chunks(monkeypatch, chunk_rows):
    """Several row chunks, the last one short: buffers are reused and sliced correctly."""
    monkeypatch.setattr(le_torch_module, "TORCH_CHUNK_ELEMENTS", chunk_rows * 40)
    logits, labels = make_logits((7, 40), seed=7, neg_inf_rows=(3,))
    check_against_reference(logits, labels, 0.8, "torch")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["both", "logprobs", "entropy"])
def test_grad_in_place_and_partial_upstream(backend, which):
    logits, labels = make_logits((5, 70), torch.bfloat16, seed=8, neg_inf_rows=(0,))
    g_lp = torch.randn(5) if which in ("both", "logprobs") else None
    g_ent = torch.randn(5) if which in ("both", "entropy") else None
    _, _, grad_ref = reference(logits, labels, 1.1, g_lp if g_lp is not None else 0.0,
                               g_ent if g_ent is not None else 0.0)
    stats = bounds(logits, labels, 1.1, backend)
    _, ent, lse = logprob_entropy_stats(logits, labels, 1.1, backend)
    separate = logprob_entropy_grad(logits, labels, lse, ent, g_lp, g_ent, 1.1, backend)
    fp32_out = torch.empty(5, 70)
    logprob_entropy_grad(logits, labels, lse, ent, g_lp, g_ent, 1.1, backend, out=fp32_out)
    in_place = logits.clone()
    returned = logprob_entropy_grad(in_place, labels, lse, ent, g_lp, g_ent, 1.1, backend, out=in_place)
    assert returned.data_ptr() == in_place.data_ptr()
    assert_grad_within(separate, grad_ref, grad_bound(stats, g_lp, g_ent, torch.bfloat16, backend), torch.bfloat16)
    torch.testing.assert_close(in_place, separate, rtol=0, atol=0)
    # An fp32 out holds the unrounded fp32 gradient of the same (bf16-valued) logits.
    assert_grad_within(fp32_out, grad_ref, grad_bound(stats, g_lp, g_ent, torch.float32, backend), torch.float32)
    # The Triton interpreter truncates fp32 -> bf16 where a GPU rounds to nearest: one ulp apart at most.
    ulp = 0 if backend == "torch" else 2.0**-7
    torch.testing.assert_close(fp32_out.bfloat16(), separate, rtol=ulp, atol=1e-30 if ulp else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_upstream_gradient_gives_zeros(backend):
    logits, labels = make_logits((2, 9), seed=9)
    _, ent, lse = logprob_entropy_stats(logits, labels, 1.0, backend)
    out = torch.full_like(logits, 5.0)
    logprob_entropy_grad(logits, labels, lse, ent, None, None, 1.0, backend, out=out)
    assert (out == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows(backend):
    """A row stride larger than V (a slice of a wider buffer) is read without a copy."""
    wide = torch.randn(4, 64)
    logits = wide[:, :50]
    labels = torch.randint(0, 50, (4,))
    lp, ent, _ = logprob_entropy_stats(logits, labels, 1.0, backend)
    assert_stats_within(bounds(logits, labels, 1.0, backend), lp, ent)


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 5),
    vocab=st.integers(1, 300),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(n, vocab, temperature, backend, seed):
    logits, labels = make_logits((n, vocab), seed=seed)
    check_against_reference(logits, labels, temperature, backend, seed=seed + 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [-1, -100, 10])
def test_labels_out_of_range_raise(backend, bad):
    logits = torch.randn(3, 10)
    labels = torch.tensor([0, bad, 2])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        logprob_entropy(logits, labels, backend=backend)


def test_shape_and_argument_errors():
    with pytest.raises(ValueError, match="shape mismatch"):
        logprob_entropy(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprob_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        logprob_entropy(torch.randn(2, 5), torch.zeros(2))
    with pytest.raises(ValueError, match="backend must be one of"):
        logprob_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), backend="cuda")
    logits, labels = torch.randn(2, 5), torch.zeros(2, dtype=torch.long)
    _, ent, lse = logprob_entropy_stats(logits, labels)
    with pytest.raises(ValueError, match=r"grad_logprobs must have shape \(2,\)"):
        logprob_entropy_grad(logits, labels, lse, ent, torch.ones(3), None)
    with pytest.raises(ValueError, match="out must have logits' shape"):
        logprob_entropy_grad(logits, labels, lse, ent, torch.ones(2), None, out=torch.empty(2, 6))


def test_triton_backend_on_cpu_without_interpreter_raises():
    # Also checks, in a fresh process, that the package export is callable although the
    # submodule of the same name gets imported on the way.
    code = (
        "import torch\n"
        "from fastrlhf.kernels import logprob_entropy\n"
        "try:\n"
        "    logprob_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), backend='triton')\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "RAISED backend='triton' needs CUDA tensors" in proc.stdout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use", ["logprobs", "entropy"])
def test_backward_through_one_output(backend, use):
    logits, labels = make_logits((4, 30), seed=10, neg_inf_rows=(2,))
    x = logits.clone().requires_grad_()
    lp, ent = logprob_entropy(x, labels, 1.2, backend=backend)
    (lp if use == "logprobs" else ent).sum().backward()
    x_ref = logits.double().requires_grad_()
    ref = logprobs_from_logits(x_ref, labels, 1.2) if use == "logprobs" else entropy_from_logits(x_ref, 1.2)
    ref.sum().backward()
    ones = torch.ones(4)
    bound = grad_bound(bounds(logits, labels, 1.2, backend), ones if use == "logprobs" else None,
                       ones if use == "entropy" else None, torch.float32, backend)
    assert_grad_within(x.grad, x_ref.grad, bound, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliced_batch_logits_are_read_in_place(backend):
    """logits[:, :-1] (no [N, V] view exists) is split per sequence instead of copied."""
    full, labels_full = make_logits((3, 6, 40), seed=11)
    logits, labels = full[:, :-1], labels_full[:, 1:]
    blocks = le_module.row_blocks(logits, labels)
    assert len(blocks) == 3
    assert all(b.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() for _, b, _ in blocks)
    assert len(le_module.row_blocks(full, labels_full)) == 1
    check_against_reference(logits, labels, 0.9, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.bfloat16, 0.8)])
def test_shift_and_reused_probabilities(backend, dtype, temperature):
    """shift_out / shift: lse relative to a per-row shift; probs_out / pz_out reused by grad (torch)."""
    logits, labels = make_logits((6, 90), dtype, seed=12, neg_inf_rows=(4,))
    g_lp, g_ent = torch.randn(6), torch.randn(6)
    _, _, grad_ref = reference(logits, labels, temperature, g_lp, g_ent)
    stats = bounds(logits, labels, temperature, backend)
    bound = grad_bound(stats, g_lp, g_ent, dtype, backend)
    lp0, ent0, lse0 = logprob_entropy_stats(logits, labels, temperature, backend)
    shift = torch.full((6,), float("nan"))
    kw = {}
    if backend == "torch":
        kw = dict(probs_out=torch.empty(6, 90), pz_out=torch.empty(6, 90))
    lp, ent, lse_rel = logprob_entropy_stats(logits, labels, temperature, backend, shift_out=shift, **kw)
    torch.testing.assert_close((lp, ent), (lp0, ent0), rtol=0, atol=0)
    torch.testing.assert_close(lse_rel + shift, lse0, rtol=1e-6, atol=1e-6)
    if backend == "torch":
        torch.testing.assert_close(shift, (logits.float() / temperature).amax(-1), rtol=0, atol=0)
        probs_ref, probs_bound = softmax_probs_bound(stats)
        assert_within(kw["probs_out"], probs_ref, probs_bound, "probabilities")
    else:
        assert (shift == 0).all()
    fresh = logprob_entropy_grad(logits, labels, lse_rel, ent, g_lp, g_ent, temperature, backend, shift=shift)
    assert_grad_within(fresh, grad_ref, bound, dtype)
    if backend == "torch":
        reused = logprob_entropy_grad(logits, labels, lse_rel, ent, g_lp, g_ent, temperature, backend, shift=shift,
                                      probs=kw["probs_out"], pz=kw["pz_out"])
        assert_grad_within(reused, grad_ref, bound, dtype, "dlogits from reused probabilities")
    assert_stats_within(stats, lp, ent)


@pytest.mark.parametrize("which", ["both", "logprobs", "entropy"])
def test_reuse_in_place_overwrites_fp32_logits(which):
    """fused_linear's pattern: pz_out is the fp32 logits themselves, and grad writes into them."""
    logits, labels = make_logits((5, 64), seed=13, neg_inf_rows=(1,))
    g_lp = torch.randn(5) if which != "entropy" else None
    g_ent = torch.randn(5) if which != "logprobs" else None
    _, _, grad_ref = reference(logits, labels, 1.0, 0.0 if g_lp is None else g_lp, 0.0 if g_ent is None else g_ent)
    work, probs, shift = logits.clone(), torch.empty(5, 64), torch.empty(5)
    _, ent, lse = logprob_entropy_stats(work, labels, shift_out=shift, probs_out=probs, pz_out=work)
    out = logprob_entropy_grad(work, labels, lse, ent, g_lp, g_ent, out=work, shift=shift, probs=probs, pz=work)
    assert out.data_ptr() == work.data_ptr()
    bound = grad_bound(bounds(logits, labels, 1.0, "torch"), g_lp, g_ent, torch.float32, "torch")
    assert_grad_within(out, grad_ref, bound, torch.float32)


def test_large_vocab_entropy_is_accurate():
    """V = 151,936 (Qwen): the row sums are pairwise, not a BLAS dot (that loses ~1e-4 here).

    Beyond the any-order bound (which a sequential sum meets too), the torch path's values meet the
    deterministic bound of sums whose every term goes through at most PAIRWISE_PATH additions: ATen's
    cascade sum (levels of 16 terms, then the vector lanes) keeps each term's path well below that at
    this V whatever the vector width, where a sequential loop or a BLAS dot makes paths of thousands
    (test_pairwise_path_bound_catches_a_sequential_sum)."""
    logits, labels = make_logits((3, 151936), seed=14)
    lp, ent, lse = logprob_entropy_stats(logits, labels)
    assert_stats_within(bounds(logits, labels, 1.0, "torch"), lp, ent, lse)
    assert_stats_within(softmax_bounds(logits, labels, path=PAIRWISE_PATH), lp, ent, lse)


PAIRWISE_PATH = 256


def test_pairwise_path_bound_catches_a_sequential_sum():
    """The bound of test_large_vocab_entropy_is_accurate rejects a sequential (BLAS-dot-like) entropy."""
    logits, labels = make_logits((3, 151936), seed=14)
    z = logits / 1.0
    d = z - z.amax(-1, keepdim=True)
    p = torch.softmax(d, -1)
    sequential = torch.from_numpy((p * d).numpy().cumsum(-1, dtype="float32")[:, -1].copy())
    lse = -p.gather(1, d.argmax(-1, keepdim=True)).log().squeeze(1)
    stats = softmax_bounds(logits, labels, path=PAIRWISE_PATH)
    assert ((lse - sequential).double() - stats.entropy).abs().max() > stats.entropy_bound.max()


def test_reuse_buffer_argument_errors():
    logits, labels = torch.randn(2, 5), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="probs_out needs pz_out"):
        logprob_entropy_stats(logits, labels, probs_out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="for backend='torch' only"):
        logprob_entropy_stats(logits, labels, backend="triton", probs_out=torch.empty(2, 5), pz_out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="pz_out must be a float32 tensor"):
        logprob_entropy_stats(logits, labels, probs_out=torch.empty(2, 5), pz_out=torch.empty(2, 5).double())
    with pytest.raises(ValueError, match=r"shift_out must have a float32 tensor of shape \(2,\)"):
        logprob_entropy_stats(logits, labels, shift_out=torch.empty(3))
    _, ent, lse = logprob_entropy_stats(logits, labels)
    with pytest.raises(ValueError, match="pz needs probs"):
        logprob_entropy_grad(logits, labels, lse, ent, torch.ones(2), None, pz=torch.empty(2, 5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(6,), (2, 3)], ids=["flat", "batch"])
def test_strided_labels_are_read_where_they_are(backend, shape):
    """Labels that are a strided view (a column of ``[N, 2]`` pairs) give what the same labels copied give, values and
    gradients; a kernel reading them at unit stride took its neighbours' ids (Triton backend, the GPU default)."""
    logits = torch.randn(*shape, 40, generator=torch.Generator().manual_seed(3))
    pairs = torch.randint(0, 40, (*shape, 2), generator=torch.Generator().manual_seed(4))
    labels = pairs[..., 0]
    assert not labels.is_contiguous() and not torch.equal(labels, pairs[..., 1])
    results = []
    for lab in (labels, labels.contiguous()):
        x = logits.clone().requires_grad_()
        lp, ent = logprob_entropy(x, lab, 1.0, backend)
        (lp.sum() + 0.5 * ent.sum()).backward()
        results.append((lp, ent, x.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
