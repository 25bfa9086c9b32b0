"""fused_linear_logprob_entropy / fused_linear_policy_loss against materialised logits + fastrlhf.algorithms.

Both backends: "torch" (the whole-chunk CPU path) and "triton" (the shared Triton primitives run
by TRITON_INTERPRET=1, see tests/conftest.py; interpreter cost grows with tokens, so those cases
stay at a dozen tokens). The reference builds ``logits = hidden @ weight.T + bias`` in float64 from
the same input values and differentiates the reference math with autograd; outputs must lie within
the error bounds of tests/helpers/fp32_bounds.py (the GEMMs in the input dtype with fp32
accumulation, the softmax math in fp32, in any summation order).
"""

import pytest
import torch
from fastrlhf.kernels import policy_loss_triton
from fastrlhf.kernels.fused_linear import (
    DEFAULT_CHUNK_BYTES,
    default_chunk_size,
    fused_linear_logprob_entropy,
    fused_linear_policy_loss,
)
from fastrlhf.kernels.fused_linear_chunks import PATHS, fused_linear_paths
from fastrlhf.kernels.logprob_entropy import default_block_v
from helpers.fp32_bounds import (
    assert_within,
    linear_grad_bounds,
    linear_logits,
    policy_loss_bounds,
    softmax_bounds,
    softmax_grad_bound,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fastrlhf import algorithms as A

BACKENDS = ["torch", "triton"]


def make_inputs(shape, h, v, dtype=torch.float32, bias=True, seed=0, weight_grad=True, hidden_grad=True):
    """hidden ``shape + [h]``, weight ``[v, h]``, bias ``[v]``, labels and per-token data of ``shape``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, h, generator=g).to(dtype).requires_grad_(hidden_grad)
    weight = (torch.randn(v, h, generator=g) * 2 / h**0.5).to(dtype).requires_grad_(weight_grad)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, shape, generator=g)
    data = dict(
        old_logprobs=-torch.rand(*shape, generator=g) * 6,
        ref_logprobs=-torch.rand(*shape, generator=g) * 6,
        advantages=torch.randn(*shape, generator=g),
        mask=(torch.rand(*shape, generator=g) > 0.25).float(),
    )
    return hidden, weight, b, labels, data


def leaves(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]


def leaf_names(hidden, weight, bias):
    return [name for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias))
            if t is not None and t.requires_grad]


def reference_copies(*tensors):
    """float64 copies of the inputs (the same values: bf16 and fp32 are exact in float64) for the reference."""
    return tuple(
        None if t is None else t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t
        for t in tensors
    )


def grads_of(out, inputs):
    """Gradients of the scalar ``out`` for ``inputs`` (then cleared so the next call starts clean)."""
    out.backward()
    result = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return result


def ref_logits(hidden, weight, bias):
    logits = hidden @ weight.t()
    return logits + bias if bias is not None else logits


def ref_lp_ent(hidden, weight, bias, labels, temperature):
    logits = ref_logits(hidden, weight, bias)
    return A.logprobs_from_logits(logits, labels, temperature), A.entropy_from_logits(logits, temperature)


def ref_policy_loss(lp, ent, d, clip_low, clip_high, dual_clip, kl_coef, kl_kind, entropy_coef, agg):
    mask = d["mask"]
    loss, metrics = A.policy_loss(lp, d["old_logprobs"], d["advantages"], mask, clip_low, clip_high, dual_clip, agg)
    kl = A.kl_penalty(lp, d["ref_logprobs"], kl_kind)
    loss = loss + kl_coef * A.aggregate_loss(kl, mask, agg) - entropy_coef * A.aggregate_loss(ent, mask, agg)
    metrics = dict(metrics, entropy=A.masked_mean(ent, mask).detach(), kl=A.masked_mean(kl, mask).detach())
    return loss, metrics


def head_bounds(hidden, weight, bias, labels, temperature, backend):
    """The softmax bounds of the head's logits as the kernel computes them (a GEMM in the input dtype)."""
    logits, logit_error = linear_logits(hidden, weight, bias)
    v = weight.shape[0]
    blocks = -(-v // default_block_v(v)) if backend == "triton" else 1
    return softmax_bounds(logits, labels, temperature, logit_error=logit_error, blocks=blocks)


def dlogits_bound(stats, g_lp, g_ent, dtype, backend, **errors):
    # dlogits overwrite the chunk's logits (the input dtype); the Triton interpreter truncates to bf16.
    return softmax_grad_bound(stats, g_lp, g_ent, out_dtype=dtype, truncates=backend == "triton", **errors)


def assert_grads_within(got, want, names, hidden, weight, dlogits, num_chunks, scale=1.0):
    """The head's gradients (kernel, in the input dtype) against the float64 reference ones."""
    reference = dict(zip(names, want, strict=True))
    bounds = linear_grad_bounds(hidden, weight, dlogits, reference, num_chunks=num_chunks,
                                with_bias="bias" in names, scale=scale)
    for name, a in zip(names, got, strict=True):
        assert a.dtype == hidden.dtype and torch.isfinite(a).all(), f"grad of {name}"
        assert_within(a, scale * reference[name], bounds[name], f"grad of {name}")


def check_logprob_entropy(shape, h, v, backend, dtype=torch.float32, bias=True, temperature=1.0, chunk_size=4,
                          weight_grad=True, hidden_grad=True, seed=0, fp32_logits=False):
    hidden, weight, b, labels, _ = make_inputs(shape, h, v, dtype, bias, seed, weight_grad, hidden_grad)
    g = torch.Generator().manual_seed(seed + 1)
    g_lp, g_ent = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    inputs = leaves(hidden, weight, b)

    lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, bias=b, temperature=temperature,
                                           chunk_size=chunk_size, backend=backend, fp32_logits=fp32_logits)
    assert lp.shape == ent.shape == labels.shape and lp.dtype == ent.dtype == torch.float32
    got = grads_of((lp * g_lp).sum() + (ent * g_ent).sum(), inputs)

    rh, rw, rb, rg_lp, rg_ent = reference_copies(hidden, weight, b, g_lp, g_ent)
    lp_ref, ent_ref = ref_lp_ent(rh, rw, rb, labels, temperature)
    want = grads_of((lp_ref * rg_lp).sum() + (ent_ref * rg_ent).sum(), leaves(rh, rw, rb))
    stats = head_bounds(hidden, weight, b, labels, temperature, backend)
    assert_within(lp, lp_ref, stats.logprobs_bound, "logprobs")
    assert_within(ent, ent_ref, stats.entropy_bound, "entropy")
    n = labels.numel()
    assert_grads_within(got, want, leaf_names(hidden, weight, b), hidden, weight,
                        dlogits_bound(stats, g_lp, g_ent, dtype, backend), -(-n // min(chunk_size or n, n)))


# ----------------------------------------------------------------------------------------------
# fused_linear_logprob_entropy
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape,v,bias,temperature,chunk_size",
    [
        ((13,), 7, True, 1.0, 4),  # N not a multiple of the chunk, tiny vocabulary
        ((2, 5), 1000, False, 0.7, 3),  # [B, T], temperature
        ((1,), 4097, True, 1.3, None),  # N = 1, V one past a power of two, default chunk size
        ((11,), 1000, True, 1.0, 16),  # one chunk larger than N
    ],
)
def test_logprob_entropy_matches_reference_fp32(backend, shape, v, bias, temperature, chunk_size):
    check_logprob_entropy(shape, 24, v, backend, bias=bias, temperature=temperature, chunk_size=chunk_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprob_entropy_matches_reference_bf16(backend):
    check_logprob_entropy((2, 6), 32, 1000, backend, dtype=torch.bfloat16, temperature=0.8, chunk_size=5)


@pytest.mark.parametrize("weight_grad,hidden_grad", [(False, True), (True, False)])
def test_logprob_entropy_frozen_head_or_hidden(weight_grad, hidden_grad):
    check_logprob_entropy((9,), 16, 100, "torch", weight_grad=weight_grad, hidden_grad=hidden_grad)


def test_logprob_entropy_one_output_used_and_noncontiguous_inputs():
    hidden_t, weight_t, _, labels, _ = make_inputs((16,), 10, 50, bias=False)
    # hidden as a strided view [N, H] of a [H, N] tensor, weight as the transpose of a [H, V] tensor.
    hidden = hidden_t.detach().t().contiguous().t().requires_grad_()
    weight = weight_t.detach().t().contiguous().t().requires_grad_()
    assert not hidden.is_contiguous() and not weight.is_contiguous()
    _, ent = fused_linear_logprob_entropy(hidden, weight, labels, chunk_size=5, backend="torch")
    got = grads_of(ent.sum(), [hidden, weight])
    rh, rw = reference_copies(hidden, weight)
    want = grads_of(A.entropy_from_logits(rh @ rw.t()).sum(), [rh, rw])
    stats = head_bounds(hidden, weight, None, labels, 1.0, "torch")
    assert_grads_within(got, want, ["hidden", "weight"], hidden, weight,
                        dlogits_bound(stats, None, torch.ones(16), torch.float32, "torch"), 4)


def test_logprob_entropy_minus_inf_bias_entry_stays_finite():
    """A -inf logit (a banned token via the bias): p = 0, entropy and gradients finite, on the fast path."""
    hidden, weight, b, labels, _ = make_inputs((7,), 8, 20)
    with torch.no_grad():
        b[3] = float("-inf")
    labels[labels == 3] = 4
    lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, bias=b, chunk_size=3, backend="torch")
    got = grads_of((lp + ent).sum(), [hidden, weight])
    rh, rw, rb = reference_copies(hidden, weight, b)
    lp_ref, ent_ref = ref_lp_ent(rh, rw, rb, labels, 1.0)
    want = grads_of((lp_ref + ent_ref).sum(), [rh, rw])
    stats = head_bounds(hidden, weight, b, labels, 1.0, "torch")
    assert_within(lp, lp_ref, stats.logprobs_bound, "logprobs")
    assert_within(ent, ent_ref, stats.entropy_bound, "entropy")
    ones = torch.ones(7)
    assert_grads_within(got, want, ["hidden", "weight"], hidden, weight,
                        dlogits_bound(stats, ones, ones, torch.float32, "torch"), 3)


# ----------------------------------------------------------------------------------------------
# fused_linear_policy_loss
# ----------------------------------------------------------------------------------------------

LOSS_DEFAULTS = dict(clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=0.0, kl_kind="k3", entropy_coef=0.0,
                     agg="token-mean")


def check_policy_loss(backend, shape=(3, 7), h=16, v=300, dtype=torch.float32, bias=True, temperature=1.0,
                      chunk_size=4, seed=0, grad_scale=1.0, mask_edit=None, weight_grad=True, on_policy=False,
                      fp32_logits=False, **loss_kw):
    kw = dict(LOSS_DEFAULTS, **loss_kw)
    hidden, weight, b, labels, d = make_inputs(shape, h, v, dtype, bias, seed, weight_grad)
    if mask_edit is not None:
        mask_edit(d["mask"])
    inputs = leaves(hidden, weight, b)

    loss, metrics = fused_linear_policy_loss(
        hidden, weight, labels, None if on_policy else d["old_logprobs"], d["advantages"], d["mask"],
        ref_logprobs=d["ref_logprobs"],
        temperature=temperature, bias=b, chunk_size=chunk_size, backend=backend, fp32_logits=fp32_logits, **kw,
    )
    assert loss.shape == () and loss.dtype == torch.float32
    got = grads_of(loss * grad_scale, inputs)

    rh, rw, rb = reference_copies(hidden, weight, b)
    rd = dict(zip(d, reference_copies(*d.values()), strict=True))
    if on_policy:
        rd["old_logprobs"] = None  # the reference's own convention: old = its logprobs, detached
    lp, ent = ref_lp_ent(rh, rw, rb, labels, temperature)
    loss_ref, metrics_ref = ref_policy_loss(lp, ent, rd, **kw)
    want = grads_of(loss_ref, leaves(rh, rw, rb))

    stats = head_bounds(hidden, weight, b, labels, temperature, backend)
    n = labels.numel()
    num_chunks = -(-n // min(chunk_size, n))
    pb = policy_loss_bounds(stats, rd["old_logprobs"], rd["advantages"], A.aggregation_weights(rd["mask"], kw["agg"]),
                            rd["ref_logprobs"], clip_low=kw["clip_low"], clip_high=kw["clip_high"],
                            dual_clip=kw["dual_clip"], kl_coef=kw["kl_coef"], kl_kind=kw["kl_kind"],
                            entropy_coef=kw["entropy_coef"], num_chunks=num_chunks)
    assert_within(loss, loss_ref, pb.loss_bound, "loss")
    assert set(metrics) == {"clipfrac", "approx_kl", "entropy", "kl"}
    for k in metrics:
        assert_within(metrics[k], metrics_ref[k], pb.metric_bounds[k], f"metric {k}")
    with_entropy = kw["entropy_coef"] != 0.0
    dlogits = dlogits_bound(stats, pb.grad_logprobs, pb.grad_entropy if with_entropy else None, dtype, backend,
                            grad_logprobs_error=pb.grad_logprobs_error,
                            grad_entropy_error=pb.grad_entropy_error if with_entropy else None)
    assert_grads_within(got, want, leaf_names(hidden, weight, b), hidden, weight, dlogits, num_chunks,
                        scale=grad_scale)
    return loss, metrics


@pytest.mark.parametrize("agg", A.AGG_MODES)
def test_policy_loss_every_aggregation(agg):
    check_policy_loss("torch", agg=agg, kl_coef=0.1, entropy_coef=0.01)


@pytest.mark.parametrize(
    "dual_clip,kl_coef,kl_kind,entropy_coef",
    [(None, 0.0, "k3", 0.0), (3.0, 0.0, "k3", 0.0), (None, 0.2, "k1", 0.0), (3.0, 0.1, "k3", 0.05),
     (None, 0.0, "k2", 0.03)],
)
def test_policy_loss_terms(dual_clip, kl_coef, kl_kind, entropy_coef):
    check_policy_loss("torch", dual_clip=dual_clip, kl_coef=kl_coef, kl_kind=kl_kind, entropy_coef=entropy_coef,
                      temperature=0.9, agg="seq-mean-token-sum")


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_both_backends_with_masked_row_and_chunk(backend):
    # Row 1 (tokens 7..13) fully masked: with chunk_size 7 one whole chunk is skipped.
    def edit(mask):
        mask[1] = 0.0

    check_policy_loss(backend, shape=(2, 7), v=257, chunk_size=7, mask_edit=edit, dual_clip=2.5, kl_coef=0.1,
                      entropy_coef=0.02, temperature=1.2, agg="seq-mean-token-mean")


def test_policy_loss_bf16_no_bias_flat_tokens():
    check_policy_loss("torch", shape=(21,), dtype=torch.bfloat16, bias=False, chunk_size=8, kl_coef=0.1,
                      entropy_coef=0.01, h=32, v=4097)


def test_policy_loss_frozen_weight_and_grad_scale():
    check_policy_loss("torch", weight_grad=False, grad_scale=-2.5, entropy_coef=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_loss_on_policy_without_old_logprobs(backend, dtype):
    # old_logprobs=None: ratio 1, so nothing is clipped, approx_kl is 0 and the policy gradient
    # is -A * grad(logprob) (weighted); a masked row and a skipped chunk included.
    def edit(mask):
        mask[1] = 0.0

    loss, metrics = check_policy_loss(backend, shape=(3, 7), v=301, chunk_size=7, mask_edit=edit, dtype=dtype,
                                      on_policy=True, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01,
                                      temperature=0.9, agg="seq-mean-token-mean")
    assert metrics["clipfrac"].item() == 0.0 and metrics["approx_kl"].item() == 0.0


def test_policy_loss_all_masked_is_zero_with_zero_grads():
    hidden, weight, b, labels, d = make_inputs((2, 5), 8, 40)
    loss, metrics = fused_linear_policy_loss(hidden, weight, labels, d["old_logprobs"], d["advantages"],
                                             torch.zeros(2, 5), bias=b, chunk_size=3, backend="torch")
    loss.backward()
    assert loss.item() == 0.0 and all(m.item() == 0.0 for m in metrics.values())
    for t in (hidden, weight, b):
        assert t.grad is not None and not t.grad.any()


def test_policy_loss_backward_twice_raises_and_no_grad_forward_matches():
    hidden, weight, b, labels, d = make_inputs((12,), 8, 40)
    args = (hidden, weight, labels, d["old_logprobs"], d["advantages"], d["mask"])
    loss, _ = fused_linear_policy_loss(*args, bias=b, chunk_size=5, backend="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    with torch.no_grad():
        loss_ng, _ = fused_linear_policy_loss(*args, bias=b, chunk_size=5, backend="torch")
    assert not loss_ng.requires_grad
    torch.testing.assert_close(loss_ng, loss.detach())


# ----------------------------------------------------------------------------------------------
# Arguments, chunk size, property test
# ----------------------------------------------------------------------------------------------


def test_default_chunk_size_follows_the_memory_budget():
    assert default_chunk_size(4096, 32768) == DEFAULT_CHUNK_BYTES // (4 * 32768)
    assert default_chunk_size(4096, 151936) * 151936 * 4 <= DEFAULT_CHUNK_BYTES
    assert default_chunk_size(4096, 151936) % 8 == 0
    assert default_chunk_size(10, 7) == 10  # never more than N
    assert default_chunk_size(4096, 10**9) == 16  # never below the GEMM-efficiency floor


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(labels=torch.tensor([0, 1, 40])), r"labels must lie in \[0, 40\)"),
        (dict(labels=torch.tensor([0, 1])), "shape mismatch"),
        (dict(weight=torch.randn(40, 5)), "weight must be"),
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(bias=torch.randn(39)), "bias must be"),
        (dict(backend="cuda"), "backend must be one of"),
    ],
)
def test_logprob_entropy_argument_errors(change, match):
    args = dict(hidden=torch.randn(3, 8), weight=torch.randn(40, 8), labels=torch.tensor([0, 1, 2]))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fused_linear_logprob_entropy(**args)


def test_policy_loss_argument_errors():
    hidden, weight, _, labels, d = make_inputs((2, 3), 8, 40)
    args = (hidden, weight, labels, d["old_logprobs"], d["advantages"])
    with pytest.raises(ValueError, match="ref_logprobs is None"):
        fused_linear_policy_loss(*args, d["mask"], kl_coef=0.1)
    with pytest.raises(ValueError, match="mask must have the labels' shape"):
        fused_linear_policy_loss(*args, d["mask"].view(-1))
    with pytest.raises(ValueError, match="needs \\[B, T\\]"):
        fused_linear_policy_loss(hidden.view(6, 8), weight, labels.view(6), d["old_logprobs"].view(6),
                                 d["advantages"].view(6), d["mask"].view(6), agg="seq-mean-token-sum")


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 20), h=st.integers(1, 12), v=st.integers(2, 70), chunk=st.integers(1, 9),
    bias=st.booleans(), temperature=st.sampled_from([0.5, 1.0, 2.0]), seed=st.integers(0, 1000),
)
def test_property_random_shapes(n, h, v, chunk, bias, temperature, seed):
    check_logprob_entropy((n,), h, v, "torch", bias=bias, temperature=temperature, chunk_size=chunk, seed=seed)
    check_policy_loss("torch", shape=(n,), h=h, v=v, bias=bias, temperature=temperature, chunk_size=chunk,
                      seed=seed, kl_coef=0.1, entropy_coef=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", A.AGG_MODES)
def test_policy_loss_precomputed_weights_split_and_flattened(backend, agg):
    # A minibatch's aggregation weights carried by its micro-batches (rows split 2 + 1, the second
    # one as flat packed tokens: only its kept tokens, [n] and [n, H]) give micro losses, metrics
    # sums and gradients that add up to the whole minibatch's, in every aggregation mode.
    kw = dict(LOSS_DEFAULTS, agg=agg, kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0)
    hidden, weight, b, labels, d = make_inputs((3, 5), 8, 40, seed=3)
    d["mask"][2, 3:] = 0.0
    whole, whole_metrics = fused_linear_policy_loss(hidden, weight, labels, d["old_logprobs"], d["advantages"],
                                                    d["mask"], ref_logprobs=d["ref_logprobs"], bias=b, chunk_size=3,
                                                    backend=backend, **kw)
    want = grads_of(whole, leaves(hidden, weight, b))
    w = A.aggregation_weights(d["mask"], agg)
    kw.pop("agg")
    top = fused_linear_policy_loss(hidden[:2], weight, labels[:2], d["old_logprobs"][:2], d["advantages"][:2],
                                   d["mask"][:2], ref_logprobs=d["ref_logprobs"][:2], bias=b, chunk_size=3,
                                   backend=backend, weights=w[:2], agg="token-mean", **kw)
    keep = d["mask"][2] > 0
    flat = {k: v[2][keep] for k, v in d.items()}
    bottom = fused_linear_policy_loss(hidden[2][keep], weight, labels[2][keep], flat["old_logprobs"],
                                      flat["advantages"], flat["mask"], ref_logprobs=flat["ref_logprobs"], bias=b,
                                      chunk_size=2, backend=backend, weights=w[2][keep], **kw)
    got = grads_of(top[0] + bottom[0], leaves(hidden, weight, b))
    torch.testing.assert_close(top[0] + bottom[0], whole, rtol=1e-5, atol=1e-6)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    counts = (d["mask"][:2] > 0).sum(), keep.sum()
    for k in whole_metrics:  # masked means over all the minibatch's tokens
        mixed = (top[1][k] * counts[0] + bottom[1][k] * counts[1]) / (counts[0] + counts[1])
        torch.testing.assert_close(mixed, whole_metrics[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_linear_policy_loss(hidden, weight, labels, d["old_logprobs"], d["advantages"], d["mask"],
                                 weights=w[:2], backend=backend)


def test_logprob_entropy_without_tokens_stays_in_the_graph():
    # A packed micro-batch of empty completions has no token: a loss on its (empty) outputs still
    # backpropagates, with zero gradients, like any other micro-batch's.
    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    lp, ent = fused_linear_logprob_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    with torch.no_grad():
        assert not fused_linear_logprob_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))[0].requires_grad


# ----------------------------------------------------------------------------------------------
# grad_weight summed in fp32 by the GEMM itself (CUDA's path), run here on the CPU stand-in
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fp32_gemm(monkeypatch):
    """Every bf16/fp16 head takes the one-GEMM fp32 accumulation, on the CPU through its stand-in GEMMs."""
    from fastrlhf.kernels import fused_linear_chunks as chunks

    monkeypatch.setattr(chunks, "accumulates_in_gemm", lambda weight: True)
    assert not chunks.fp32_out_gemm(torch.device("cpu"), torch.bfloat16)  # so mm_fp32_out takes the stand-in
    original = chunks._HeadGrads.__init__

    def poisoned(self, *args):
        # The accumulator is allocated uninitialised (no zeros pass); NaN makes any read before a write show.
        original(self, *args)
        if self._fp32_gemm and self.grad_weight is not None:
            self.grad_weight.fill_(float("nan"))

    monkeypatch.setattr(chunks._HeadGrads, "__init__", poisoned)


def test_fp32_out_gemm_probe_and_stand_in():
    from fastrlhf.kernels.fused_linear_chunks import fp32_out_gemm, mm_fp32_out

    assert not fp32_out_gemm(torch.device("cpu"), torch.bfloat16)  # no such CPU kernel in torch
    assert fp32_out_gemm(torch.device("meta"), torch.bfloat16)  # the meta-device tests run CUDA's calls
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(*s, generator=g).bfloat16() for s in ((5, 7), (7, 3), (7, 3)))
    out = torch.full((5, 3), float("nan"))
    mm_fp32_out(a, b, out, accumulate=False)  # overwrites whatever was there
    mm_fp32_out(a, c, out, accumulate=True)
    want = a.double() @ b.double() + a.double() @ c.double()
    assert out.dtype == torch.float32 and torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [None, 11, 4])  # 1, 2 and 6 chunks of 21 tokens
def test_policy_loss_bf16_with_fp32_gemm_accumulation(fp32_gemm, chunk_size):
    check_policy_loss("torch", shape=(21,), dtype=torch.bfloat16, bias=False, chunk_size=chunk_size or 21,
                      kl_coef=0.1, entropy_coef=0.01, h=32, v=4097, grad_scale=-1.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_bf16_fp32_gemm_with_masked_rows_and_skipped_chunks(fp32_gemm, backend):
    def edit(mask):  # rows 0 and 2 fully masked: the first chunk (the one that writes the buffer) is skipped
        mask[0] = 0.0
        mask[2] = 0.0

    check_policy_loss(backend, shape=(4, 7), v=301, chunk_size=7, mask_edit=edit, dtype=torch.bfloat16,
                      kl_coef=0.1, entropy_coef=0.01, temperature=0.9, agg="seq-mean-token-mean")


def test_policy_loss_bf16_fp32_gemm_all_masked_is_zero(fp32_gemm):
    # Every chunk skipped: no GEMM ever wrote the (uninitialised) accumulator, which must come back zero.
    hidden, weight, b, labels, d = make_inputs((2, 5), 8, 40, dtype=torch.bfloat16)
    loss, _ = fused_linear_policy_loss(hidden, weight, labels, d["old_logprobs"], d["advantages"], torch.zeros(2, 5),
                                       bias=b, chunk_size=3, backend="torch")
    loss.backward()
    for t in (hidden, weight, b):
        assert t.grad.dtype == torch.bfloat16 and not t.grad.any()


@pytest.mark.parametrize("chunk_size", [3, 16])
def test_logprob_entropy_bf16_with_fp32_gemm_accumulation(fp32_gemm, chunk_size):
    check_logprob_entropy((2, 5), 32, 1000, "torch", dtype=torch.bfloat16, bias=True, temperature=0.8,
                          chunk_size=chunk_size)


def test_fp32_gemm_accumulation_is_at_least_as_close_as_the_scratch(monkeypatch):
    """The one-GEMM path rounds only once, at the end; the scratch rounds each chunk's GEMM to bf16 first."""
    from fastrlhf.kernels import fused_linear_chunks as chunks

    def weight_grad_error(in_gemm: bool) -> float:
        monkeypatch.setattr(chunks, "accumulates_in_gemm", lambda weight: in_gemm)
        hidden, weight, b, labels, d = make_inputs((64,), 32, 500, dtype=torch.bfloat16, bias=False, seed=3)
        loss, _ = fused_linear_policy_loss(hidden, weight, labels, d["old_logprobs"], d["advantages"], d["mask"],
                                           chunk_size=8, backend="torch")
        (got,) = grads_of(loss, [weight])
        rh, rw = reference_copies(hidden, weight)
        rd = dict(zip(d, reference_copies(*d.values()), strict=True))
        lp, ent = ref_lp_ent(rh, rw, None, labels, 1.0)
        (want,) = grads_of(ref_policy_loss(lp, ent, rd, **LOSS_DEFAULTS)[0], [rw])
        return float((got.double() - want).abs().sum())

    assert weight_grad_error(True) <= weight_grad_error(False)


# ----------------------------------------------------------------------------------------------
# The Triton row kernel (one launch per chunk) and the three launches it replaces, against the reference
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def counted_rows(monkeypatch):
    """The row kernel's launches, counted (so that a test of either path knows which one ran)."""
    calls = []
    original = policy_loss_triton.triton_row_loss_and_grad

    def counted(*args, **kwargs):
        calls.append(kwargs.get("out") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(policy_loss_triton, "triton_row_loss_and_grad", counted)
    return calls


# 15 tokens in 1, 2 and 3 chunks: tokens 5..9 (row 1) are fully masked, a whole chunk at chunk_size 5.
@pytest.mark.parametrize("chunk_size,launches", [(15, 1), (8, 2), (5, 2)], ids=["1-chunk", "2-chunks", "3-chunks"])
@pytest.mark.parametrize("one_pass_rows", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_policy_loss_both_paths_against_the_reference(counted_rows, one_pass_rows, dtype, chunk_size,
                                                                   launches):
    def edit(mask):  # row 1 fully masked, and single masked tokens elsewhere
        mask[1] = 0.0

    with fused_linear_paths(one_pass_rows=one_pass_rows):
        check_policy_loss("triton", shape=(3, 5), v=257, chunk_size=chunk_size, mask_edit=edit, dtype=dtype,
                          dual_clip=2.5, kl_coef=0.1, entropy_coef=0.02, temperature=1.2, agg="seq-mean-token-mean")
    assert PATHS.one_pass_rows  # the switch restored
    # Off the CPU every chunk would run; here a fully masked chunk is skipped (at 3 chunks: 2 run).
    assert counted_rows == ([True] * launches if one_pass_rows else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_policy_loss_with_fewer_row_programs_than_rows_against_the_reference(monkeypatch, dtype):
    """CUDA's grid for the row kernel (``fused_linear_chunks.row_programs``: a program per SM, each looping over
    rows) stood in on this CPU by 3 programs for chunks of 8 rows; asked for only where dlogits are written."""
    from fastrlhf.kernels import fused_linear as fl_module

    asked, grids = [], []
    monkeypatch.setattr(fl_module, "row_programs", lambda device: asked.append(device.type) or 3)
    original = policy_loss_triton.triton_row_loss_and_grad

    def recorded(*args, **kwargs):
        grids.append(kwargs.get("programs"))
        return original(*args, **kwargs)

    monkeypatch.setattr(policy_loss_triton, "triton_row_loss_and_grad", recorded)

    def edit(mask):
        mask[1, :3] = 0.0

    check_policy_loss("triton", shape=(3, 5), v=257, chunk_size=8, mask_edit=edit, dtype=dtype, dual_clip=2.5,
                      kl_coef=0.1, entropy_coef=0.02, temperature=1.2, agg="seq-mean-token-mean")
    assert grids == [3, 3] and asked == ["cpu", "cpu"]


def test_fused_linear_policy_loss_row_kernel_without_grad(counted_rows):
    # No gradient to compare: the loss and metrics alone, against the three launches.
    with torch.no_grad():
        hidden, weight, b, labels, d = make_inputs((2, 6), 16, 300)
        kw = dict(ref_logprobs=d["ref_logprobs"], bias=b, chunk_size=4, backend="triton", kl_coef=0.1)
        loss, metrics = fused_linear_policy_loss(hidden, weight, labels, d["old_logprobs"], d["advantages"],
                                                 d["mask"], **kw)
        with fused_linear_paths(one_pass_rows=False):
            want, want_metrics = fused_linear_policy_loss(hidden, weight, labels, d["old_logprobs"], d["advantages"],
                                                          d["mask"], **kw)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for k in metrics:
        torch.testing.assert_close(metrics[k], want_metrics[k], rtol=1e-6, atol=1e-6)
    assert counted_rows and not any(counted_rows)  # the row kernel ran, without its gradient pass


@pytest.mark.parametrize("name,options", [("cispo", None), ("sapo", {"tau_pos": 0.7, "tau_neg": 1.4})])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cispo_and_sapo_through_the_head_match_the_float64_reference(backend, name, options):
    """The other token-level losses from hidden states (on Triton the row kernel computes them, LOSS_KIND): loss,
    metrics and the head's three gradients against autograd in float64 through materialised logits
    (``fastrlhf.algorithms.actor_loss_per_token``), a masked row skipping a chunk, KL and entropy terms."""
    hidden, weight, b, labels, d = make_inputs((2, 7), 16, 257, seed=3)
    d["mask"][1] = 0.0
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_kind="k3", entropy_coef=0.02, policy_loss=name,
              policy_loss_args=options)
    loss, metrics = fused_linear_policy_loss(hidden, weight, labels, d["old_logprobs"], d["advantages"], d["mask"],
                                             ref_logprobs=d["ref_logprobs"], temperature=1.2, bias=b, chunk_size=7,
                                             backend=backend, agg="seq-mean-token-mean", **kw)
    got = grads_of(loss, leaves(hidden, weight, b))

    rh, rw, rb = reference_copies(hidden, weight, b)
    rd = dict(zip(d, reference_copies(*d.values()), strict=True))
    lp, ent = ref_lp_ent(rh, rw, rb, labels, 1.2)
    loss_mat, is_clipped, kl = A.actor_loss_per_token(lp, ent, rd["old_logprobs"], rd["advantages"], rd["mask"],
                                                      rd["ref_logprobs"], **kw)
    loss_ref = A.aggregate_loss(loss_mat, rd["mask"], "seq-mean-token-mean")
    want = grads_of(loss_ref, leaves(rh, rw, rb))
    torch.testing.assert_close(loss.double(), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["clipfrac"].double(), A.masked_mean(is_clipped.double(), rd["mask"]))
    torch.testing.assert_close(metrics["kl"].double(), A.masked_mean(kl, rd["mask"]).detach(), rtol=1e-5, atol=1e-6)
    for g, w, what in zip(got, want, leaf_names(hidden, weight, b), strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-6, msg=what)


@pytest.mark.parametrize("cast_kernel", [True, False])
def test_policy_loss_triton_backend_scales_and_casts_the_fp32_sums_with_its_kernel(monkeypatch, cast_kernel):
    """The backward's last pass on the Triton backend (kernels/grad_cast_triton.py), where grad_output is not a
    1 the CPU can read for free: grad_weight's and grad_bias's fp32 sums of a bf16 head, and grad_hidden's bf16
    scaled in place. The gradients stay within the fp64 reference's bounds either way; ``cast_kernel=False`` is
    torch's, the path it replaced."""
    from fastrlhf.kernels import grad_cast_triton

    calls = []
    original = grad_cast_triton.scale_cast
    monkeypatch.setattr(grad_cast_triton, "scale_cast",
                        lambda g, s, d, out=None: calls.append(tuple(g.shape)) or original(g, s, d, out=out))
    with fused_linear_paths(cast_kernel=cast_kernel):
        check_policy_loss("triton", shape=(3, 7), v=301, chunk_size=8, dtype=torch.bfloat16, grad_scale=-1.5,
                          kl_coef=0.1)
    assert sorted(calls) == ([(21, 16), (301,), (301, 16)] if cast_kernel else []), calls


# ----------------------------------------------------------------------------------------------
# fp32 logits of a bf16 head (model.fp32_logits: the trainer's side of vLLM's head_dtype float32)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size", [12, 5, 3])  # 1, 3 and 4 chunks of 12 tokens
def test_fp32_logits_of_a_bf16_head_within_the_reference_bounds(backend, chunk_size):
    """Both ops with fp32 logits of bf16 inputs, forward and backward, against the float64 reference (the bounds of
    bf16 logits hold a fortiori), masked rows and a fully masked chunk included."""
    check_logprob_entropy((2, 6), 16, 257, backend, dtype=torch.bfloat16, temperature=0.9, chunk_size=chunk_size,
                          fp32_logits=True)

    def edit(mask):
        mask[0, :3] = 0.0

    check_policy_loss(backend, shape=(2, 6), v=257, dtype=torch.bfloat16, chunk_size=chunk_size, mask_edit=edit,
                      kl_coef=0.1, entropy_coef=0.01, fp32_logits=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_logits_are_the_gemms_fp32_sums_not_their_bf16_rounding(backend):
    """The logprobs equal those of fp32 logits of the same bf16 values (products exact, fp32 sums) to fp32
    rounding, while bf16 logits differ from them by bf16 rounding: an option that changed nothing would fail."""
    hidden, weight, b, labels, _ = make_inputs((24,), 32, 301, dtype=torch.bfloat16, seed=5)
    hidden = (hidden * 4).detach()  # logits of a few units: bf16 rounds them by ~1e-2
    with torch.no_grad():
        fp32_ref = A.logprobs_from_logits(hidden.float() @ weight.float().t() + b.float(), labels)
        got = {fp32: fused_linear_logprob_entropy(hidden, weight, labels, bias=b, chunk_size=7, backend=backend,
                                                  fp32_logits=fp32)[0] for fp32 in (False, True)}
    fp32_error, bf16_error = ((got[f] - fp32_ref).abs().max().item() for f in (True, False))
    assert fp32_error < 1e-4 < bf16_error, (fp32_error, bf16_error)


def test_fp32_logits_keep_a_minus_inf_bias_entry_and_fp32_heads_unchanged():
    hidden, weight, b, labels, _ = make_inputs((7,), 8, 20, dtype=torch.bfloat16)
    with torch.no_grad():
        b[3] = float("-inf")
    labels[labels == 3] = 4
    lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, bias=b, chunk_size=3, backend="torch",
                                           fp32_logits=True)
    got = grads_of((lp + ent).sum(), [hidden, weight, b])
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and all(torch.isfinite(g).all() for g in got[:2])
    assert got[2][3] == 0  # the banned token's bias gets no gradient
    # An fp32 head's logits are fp32 already: the option changes nothing there.
    hidden, weight, b, labels, _ = make_inputs((7,), 8, 20)
    with torch.no_grad():
        plain, flagged = (fused_linear_logprob_entropy(hidden, weight, labels, bias=b, chunk_size=3, backend="torch",
                                                       fp32_logits=f)[0] for f in (False, True))
    assert torch.equal(plain, flagged)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["logprob_entropy", "policy_loss"])
def test_strided_labels_are_read_where_they_are(backend, op):
    """Labels as a column of ``[B, T, 2]`` pairs (a strided view) give what the same labels copied give, values and
    gradients: the Triton kernels read labels at unit stride, so their launchers take a contiguous copy."""
    hidden, weight, bias, labels, data = make_inputs((2, 5), 8, 24, seed=21)
    strided = torch.stack([labels, labels.flip(-1)], dim=-1)[..., 0]
    assert not strided.is_contiguous()

    def run(lab):
        h, w, b = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
        if op == "policy_loss":
            out = fused_linear_policy_loss(h, w, lab, bias=b, kl_coef=0.1, chunk_size=4, backend=backend, **data)[0]
        else:
            lp, ent = fused_linear_logprob_entropy(h, w, lab, bias=b, chunk_size=4, backend=backend)
            out = lp.sum() + 0.5 * ent.sum()
        out.backward()
        return out, h.grad, w.grad, b.grad

    for got, want in zip(run(strided), run(strided.contiguous()), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, 1 / 3), (torch.float16, 65536.0)], ids=["bf16", "fp16"])
def test_grad_output_scales_every_gradient_in_fp32(backend, dtype, scale):
    """``(loss * s).backward()`` gives ``s`` times the gradients of ``loss.backward()``, each product rounded once
    to the inputs' dtype: ``grad_hidden`` (kept in that dtype) as the fp32 sums of ``grad_weight``. Scaled by ``s``
    rounded to bf16 first, 1/3 was 2^-9 off; in fp16, 65,536 (a loss scaler's first scale) was inf."""
    hidden, weight, bias, labels, data = make_inputs((3, 4), 8, 24, dtype=dtype, seed=22)
    data = {k: v.to(dtype) if k != "mask" else v for k, v in data.items()}

    shrink = 1 / 16 if dtype == torch.float16 else 1.0  # most of the fp16 products then stay under 65,504

    def grads(s):
        h, w, b = ((t.detach() * shrink).requires_grad_() for t in (hidden, weight, bias))
        loss = fused_linear_policy_loss(h, w, labels, bias=b, kl_coef=0.1, chunk_size=5, backend=backend, **data)[0]
        (loss * s if s != 1 else loss).backward()
        return h.grad, w.grad, b.grad

    (hidden_got, *head_got), (hidden_unscaled, *head_unscaled) = grads(scale), grads(1)
    product = hidden_unscaled.float() * scale  # grad_hidden is kept in the inputs' dtype: s times it, rounded once
    truncated = (product.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)  # the interpreter's bf16
    assert product.to(dtype).isfinite().float().mean() > 0.9  # a scale that made everything inf would prove nothing
    assert ((hidden_got == product.to(dtype)) | (hidden_got == truncated)).all(), \
        (hidden_got.float() - product).abs().max()
    # The head's are fp32 sums, rounded once with the scale; loss.backward()'s rounded them once without it.
    for got, unscaled in zip(head_got, head_unscaled, strict=True):
        want = (unscaled.float() * scale).to(dtype).float()
        finite = want.isfinite()
        ulp = want[finite].abs() * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
        assert torch.equal(got.float()[~finite], want[~finite])
        assert ((got.float()[finite] - want[finite]).abs() <= ulp).all(), (got.float() - want).abs().max()
