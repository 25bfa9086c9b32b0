"""fused_policy_loss and policy_loss_from_token_stats against the composition of fastrlhf.algorithms.

The reference runs fastrlhf.algorithms in float64 on the same values; the kernel's loss, metrics and
logits gradient must lie within the fp32 error bounds of tests/helpers/fp32_bounds.py (the softmax
sums over the vocabulary in any order, the sums over tokens, the per-token elementwise math).
"""

import importlib
import itertools
import types

import pytest
import torch
from fastrlhf.kernels import fused_policy_loss
from fastrlhf.kernels.logprob_entropy import default_block_v
from fastrlhf.kernels.policy_loss import finalize_metrics, policy_loss_from_token_stats
from helpers.fp32_bounds import (
    U,
    assert_within,
    gamma,
    policy_loss_bounds,
    softmax_bounds,
    softmax_grad_bound,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fastrlhf.algorithms import (
    AGG_MODES,
    aggregate_loss,
    aggregation_weights,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
)

BACKENDS = ["torch", "triton"]
KL_SETTINGS = [(0.0, "k3"), (0.1, "k1"), (0.2, "k2"), (0.1, "abs"), (0.3, "k3")]


def make_batch(shape=(3, 5), vocab=37, dtype=torch.float32, seed=0, masked_row=True):
    """Logits and per-token data; masked positions hold NaN / -inf to prove they cannot leak."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * 2).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    lp = logprobs_from_logits(logits, labels)
    old = lp + 0.4 * torch.randn(shape, generator=g)
    ref = lp + 0.3 * torch.randn(shape, generator=g)
    adv = torch.randn(shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    mask.view(-1)[0] = 1.0
    if masked_row and len(shape) == 2 and shape[0] > 1:
        mask[1] = 0.0
    masked = mask == 0
    old[masked] = float("nan")
    adv[masked] = float("nan")
    ref[masked] = float("-inf")
    return logits, labels, old, adv, mask, ref


def reference_loss(logits, labels, old, adv, mask, ref, clip_low, clip_high, dual_clip, kl_coef, kl_kind,
                   entropy_coef, temperature, agg):
    """float64 loss, metrics and dlogits (for upstream gradient 1) from the reference math with autograd,
    on the same values as the kernel's inputs.

    Masked entries are zeroed first: the reference keeps them out of values, but a -inf there
    still makes a NaN gradient through it (0 * inf in the KL's backward).
    """
    logits, old, adv, mask, ref = (None if t is None else t.double() for t in (logits, old, adv, mask, ref))
    zero = torch.zeros((), dtype=torch.float64)
    old = torch.where(mask > 0, old, zero) if old is not None else None  # None: on-policy
    adv = torch.where(mask > 0, adv, zero)
    ref = torch.where(mask > 0, ref, zero) if ref is not None else None
    x = logits.detach().clone().requires_grad_()
    lp = logprobs_from_logits(x, labels, temperature)
    ent = entropy_from_logits(x, temperature)
    loss, metrics = policy_loss(lp, old, adv, mask, clip_low, clip_high, dual_clip, agg)
    if kl_coef:
        loss = loss + kl_coef * aggregate_loss(kl_penalty(lp, ref, kl_kind), mask, agg)
    if entropy_coef:
        loss = loss - entropy_coef * aggregate_loss(ent, mask, agg)
    loss.backward()
    metrics["entropy"] = masked_mean(ent.detach(), mask)
    metrics["kl"] = masked_mean(kl_penalty(lp.detach(), ref, kl_kind), mask) if ref is not None else None
    return loss.detach(), metrics, x.grad


def loss_bounds(logits, labels, old, adv, mask, ref, clip_low, clip_high, dual_clip, kl_coef, kl_kind, entropy_coef,
                temperature, agg, backend):
    """(PolicyBounds, GradBound of dlogits for upstream gradient 1) of a fused_policy_loss call."""
    v = logits.shape[-1]
    blocks = -(-v // default_block_v(v)) if backend == "triton" else 1
    stats = softmax_bounds(logits, labels, temperature, blocks=blocks)
    policy = policy_loss_bounds(stats, old, adv, aggregation_weights(mask.double(), agg), ref, clip_low=clip_low,
                                clip_high=clip_high, dual_clip=dual_clip, kl_coef=kl_coef, kl_kind=kl_kind,
                                entropy_coef=entropy_coef, num_chunks=labels.numel())
    with_entropy = entropy_coef != 0.0
    dlogits = softmax_grad_bound(stats, policy.grad_logprobs, policy.grad_entropy if with_entropy else None,
                                 grad_logprobs_error=policy.grad_logprobs_error,
                                 grad_entropy_error=policy.grad_entropy_error if with_entropy else None,
                                 out_dtype=logits.dtype, truncates=backend == "triton")
    return policy, dlogits


def check_case(backend, agg, kl_coef, kl_kind, dual_clip, entropy_coef, temperature=0.8, dtype=torch.float32,
               shape=(3, 5), vocab=37, seed=0, grad_scale=2.0, on_policy=False):
    logits, labels, old, adv, mask, ref = make_batch(shape, vocab, dtype, seed)
    if on_policy:
        old = None
    args = (0.2, 0.28, dual_clip, kl_coef, kl_kind, entropy_coef, temperature, agg)
    loss_ref, metrics_ref, grad_ref = reference_loss(logits, labels, old, adv, mask, ref, *args)
    policy, dlogits = loss_bounds(logits, labels, old, adv, mask, ref, *args, backend)
    x = logits.detach().clone().requires_grad_()
    loss, metrics = fused_policy_loss(x, labels, old, adv, mask, ref, *args, backend=backend)
    (grad_scale * loss).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_within(loss, loss_ref, policy.loss_bound, "loss")
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    # grad_scale is a power of two: scaling adds no rounding.
    assert_within(x.grad, grad_scale * grad_ref, abs(grad_scale) * dlogits.bound, "dlogits")
    # Masked tokens get no gradient at all although their data is NaN / -inf.
    assert (x.grad[mask == 0] == 0).all()
    assert set(metrics) == {"clipfrac", "approx_kl", "entropy", "kl"}
    for key in metrics:
        assert not metrics[key].requires_grad
        assert_within(metrics[key], metrics_ref[key], policy.metric_bounds[key], f"metric {key}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize(("kl_coef", "kl_kind"), KL_SETTINGS)
def test_matches_reference_every_agg_and_kl(backend, agg, kl_coef, kl_kind):
    # Dual clip and the entropy bonus alternate across cases so every pairing is exercised.
    index = AGG_MODES.index(agg) + KL_SETTINGS.index((kl_coef, kl_kind))
    dual_clip = 3.0 if index % 2 else None
    entropy_coef = 0.01 if index % 3 else 0.0
    check_case(backend, agg, kl_coef, kl_kind, dual_clip, entropy_coef)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dual_clip", "entropy_coef"), list(itertools.product([None, 2.0], [0.0, 0.05])))
def test_dual_clip_and_entropy_bonus(backend, dual_clip, entropy_coef):
    check_case(backend, "seq-mean-token-mean", 0.1, "k3", dual_clip, entropy_coef, temperature=1.0, seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_policy_without_old_logprobs(backend, dtype):
    # old_logprobs=None means old = lp (detached): every agg path shares this, one is enough here.
    check_case(backend, "seq-mean-token-sum", 0.1, "k3", 2.0, 0.05, dtype=dtype, vocab=1000, on_policy=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [7, 1000, 4097, 32003])
def test_bf16_logits_across_vocab_sizes(backend, vocab):
    shape = (2, 2) if vocab > 5000 else (3, 4)
    check_case(backend, "token-mean", 0.1, "k3", 3.0, 0.01, dtype=torch.bfloat16, shape=shape, vocab=vocab,
               seed=vocab)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(6,), (1,)])
def test_flat_token_shape(backend, shape):
    check_case(backend, "token-mean", 0.2, "k2", None, 0.01, shape=shape, seed=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_batch_gives_zero_loss_and_gradient(backend):
    logits, labels, old, adv, mask, ref = make_batch(seed=5)
    mask.zero_()
    x = logits.clone().requires_grad_()
    loss, metrics = fused_policy_loss(x, labels, old, adv, mask, ref, kl_coef=0.1, entropy_coef=0.1,
                                      backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert (x.grad == 0).all()
    assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_logits(backend):
    logits, labels, old, adv, mask, ref = make_batch(vocab=20, seed=6)
    logits[..., :10] = float("-inf")
    labels.clamp_(min=10)
    args = (0.2, 0.2, None, 0.1, "k1", 0.01, 1.0, "token-mean")
    loss_ref, _, grad_ref = reference_loss(logits, labels, old, adv, mask, ref, *args)
    policy, dlogits = loss_bounds(logits, labels, old, adv, mask, ref, *args, backend)
    x = logits.clone().requires_grad_()
    loss, metrics = fused_policy_loss(x, labels, old, adv, mask, ref, kl_coef=0.1, kl_kind="k1",
                                      entropy_coef=0.01, backend=backend)
    loss.backward()
    assert_within(loss, loss_ref, policy.loss_bound, "loss")
    assert_within(x.grad, grad_ref, dlogits.bound, "dlogits")
    assert torch.isfinite(metrics["entropy"])


def test_logits_without_grad_and_kl_metric_without_ref():
    logits, labels, old, adv, mask, _ = make_batch(seed=7)
    loss, metrics = fused_policy_loss(logits, labels, old, adv, mask, backend="torch")
    assert not loss.requires_grad
    assert metrics["kl"].item() == 0.0
    args = (0.2, 0.2, None, 0.0, "k3", 0.0, 1.0, "token-mean")
    loss_ref, metrics_ref, _ = reference_loss(logits, labels, old, adv, mask, None, *args)
    policy, _ = loss_bounds(logits, labels, old, adv, mask, None, *args, "torch")
    assert_within(loss, loss_ref, policy.loss_bound, "loss")
    assert_within(metrics["clipfrac"], metrics_ref["clipfrac"], policy.metric_bounds["clipfrac"], "clipfrac")


def test_token_stats_chunks_add_up_and_ignore_masked_garbage():
    """Chunked callers: per-chunk losses and metric sums add up to the whole; masked NaNs stay out."""
    logits, labels, old, adv, mask, ref = make_batch(shape=(4, 6), seed=8)
    lp = logprobs_from_logits(logits, labels).reshape(-1)
    ent = entropy_from_logits(logits).reshape(-1)
    weights = aggregation_weights(mask, "seq-mean-token-sum").reshape(-1)
    lp[weights == 0] = float("nan")
    ent[weights == 0] = float("-inf")
    flat = [t.reshape(-1) for t in (old, adv)]
    kwargs = dict(ref_logprobs=ref.reshape(-1), dual_clip=3.0, kl_coef=0.1, kl_kind="k3", entropy_coef=0.02)
    whole = policy_loss_from_token_stats(lp, ent, *flat, weights, **kwargs)
    total_loss, sums = 0.0, None
    grads_lp, grads_ent = [], []
    for sl in (slice(0, 7), slice(7, 24)):
        loss, g_lp, g_ent, part = policy_loss_from_token_stats(
            lp[sl], ent[sl], flat[0][sl], flat[1][sl], weights[sl],
            ref_logprobs=ref.reshape(-1)[sl], dual_clip=3.0, kl_coef=0.1, kl_kind="k3", entropy_coef=0.02,
        )
        total_loss = total_loss + loss
        sums = part if sums is None else {k: sums[k] + part[k] for k in sums}
        grads_lp.append(g_lp)
        grads_ent.append(g_ent)
    # Chunked and whole: both within the fp32 bound of the float64 loss of the same per-token inputs.
    exact = types.SimpleNamespace(logprobs=lp.double(), entropy=ent.double(), logprobs_bound=torch.zeros(24),
                                  entropy_bound=torch.zeros(24))
    bound = policy_loss_bounds(exact, *flat, weights.double(), ref.reshape(-1), clip_low=0.2, clip_high=0.2,
                               dual_clip=3.0, kl_coef=0.1, kl_kind="k3", entropy_coef=0.02, num_chunks=2)
    for loss, what in ((total_loss, "chunked loss"), (whole[0], "loss")):
        assert_within(loss, torch.tensor(bound.loss, dtype=torch.float64), bound.loss_bound, what)
    for grad_lp in (torch.cat(grads_lp), whole[1]):
        assert_within(grad_lp, bound.grad_logprobs, bound.grad_logprobs_error, "grad of logprobs")
    for grad_ent in (torch.cat(grads_ent), whole[2]):
        assert_within(grad_ent, bound.grad_entropy, bound.grad_entropy_error, "grad of entropy")
    masked = weights == 0
    assert masked.any() and (whole[1][masked] == 0).all() and (whole[2][masked] == 0).all()
    assert torch.isfinite(whole[1]).all() and torch.isfinite(whole[2]).all()
    assert torch.isfinite(whole[0])
    # Entropy gradient is -entropy_coef * weight on kept tokens.
    torch.testing.assert_close(whole[2][~masked], -0.02 * weights[~masked])
    final = finalize_metrics(sums)
    # A masked mean of fp32 entropies: a sum over the kept tokens (gamma_n of the sum of magnitudes,
    # whatever the order) and one division.
    kept_ent = ent.nan_to_num(neginf=0.0).double()[~masked]
    mean_bound = gamma(kept_ent.numel()) * kept_ent.abs().mean() + U * kept_ent.abs().mean()
    assert_within(final["entropy"], masked_mean(kept_ent, torch.ones_like(kept_ent)), mean_bound, "entropy mean")
    assert sums["count"].item() == (~masked).sum().item()


def test_token_stats_gradient_matches_autograd():
    g = torch.Generator().manual_seed(9)
    lp, ent, old, adv = (torch.randn(10, generator=g) for _ in range(4))
    ref = lp + 0.2 * torch.randn(10, generator=g)
    weights = torch.rand(10, generator=g)
    lp_r, ent_r = lp.double().requires_grad_(), ent.double().requires_grad_()
    from fastrlhf.algorithms import clipped_surrogate

    loss_mat, _ = clipped_surrogate(lp_r, old.double(), adv.double(), 0.1, 0.3, 2.5)
    loss_r = (weights.double() * (loss_mat + 0.5 * kl_penalty(lp_r, ref.double(), "abs") - 0.1 * ent_r)).sum()
    loss_r.backward()
    loss, g_lp, g_ent, _ = policy_loss_from_token_stats(lp, ent, old, adv, weights, ref, 0.1, 0.3, 2.5, 0.5, "abs",
                                                        0.1)
    # Exact per-token inputs: only the fp32 per-token math and the sum over the 10 tokens round.
    exact = types.SimpleNamespace(logprobs=lp.double(), entropy=ent.double(), logprobs_bound=torch.zeros(10),
                                  entropy_bound=torch.zeros(10))
    bound = policy_loss_bounds(exact, old, adv, weights.double(), ref, clip_low=0.1, clip_high=0.3, dual_clip=2.5,
                               kl_coef=0.5, kl_kind="abs", entropy_coef=0.1)
    assert_within(loss, loss_r, bound.loss_bound, "loss")
    assert_within(g_lp, lp_r.grad, bound.grad_logprobs_error, "grad of logprobs")
    assert_within(g_ent, ent_r.grad, bound.grad_entropy_error, "grad of entropy")


@settings(max_examples=6, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 4),
    vocab=st.integers(2, 200),
    agg=st.sampled_from(AGG_MODES),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(batch, seq, vocab, agg, backend, seed):
    check_case(backend, agg, 0.1, "k3", 3.0, 0.01, temperature=1.2, shape=(batch, seq), vocab=vocab, seed=seed)


def test_errors():
    logits, labels, old, adv, mask, ref = make_batch(seed=10)
    with pytest.raises(ValueError, match="shape mismatch: labels has shape .* but advantages has shape"):
        fused_policy_loss(logits, labels, old, adv[:, :-1], mask)
    with pytest.raises(ValueError, match="shape mismatch: labels has shape .* but ref_logprobs has shape"):
        fused_policy_loss(logits, labels, old, adv, mask, ref[:1])
    with pytest.raises(ValueError, match="shape mismatch: logits has shape"):
        fused_policy_loss(logits[:, :-1], labels, old, adv, mask)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 37\)"):
        fused_policy_loss(logits, labels + 37, old, adv, mask)
    with pytest.raises(ValueError, match="kl_coef is 0.1 but ref_logprobs is None"):
        fused_policy_loss(logits, labels, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        fused_policy_loss(logits, labels, old, adv, mask, agg="sum")
    with pytest.raises(ValueError, match="needs \\[B, T\\] tensors"):
        fused_policy_loss(logits[0], labels[0], old[0], adv[0], mask[0], agg="seq-mean-token-mean")
    with pytest.raises(ValueError, match="unknown KL kind"):
        fused_policy_loss(logits, labels, old, adv, mask, ref, kl_coef=0.1, kl_kind="k4")
    with pytest.raises(ValueError, match="dual_clip must be > 1.0"):
        fused_policy_loss(logits, labels, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="logprobs must be 1-D"):
        policy_loss_from_token_stats(old, old, old, adv, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 4])
def test_torch_path_across_chunks_with_neg_inf_rows(monkeypatch, dtype, chunk_rows):
    """The torch path writes dlogits chunk by chunk in forward, -inf logits included (p = 0 there)."""
    le_torch_module = importlib.import_module("fastrlhf.kernels.logprob_entropy_torch")
    monkeypatch.setattr(le_torch_module, "TORCH_CHUNK_ELEMENTS", chunk_rows * 37)
    logits, labels, old, adv, mask, ref = make_batch(shape=(3, 5), dtype=dtype, seed=11)
    logits[0, 1, :20] = float("-inf")
    logits[2, 4, 3:] = float("-inf")
    labels[0, 1], labels[2, 4] = 30, 2
    args = (0.2, 0.28, 3.0, 0.1, "k3", 0.01, 1.0 if dtype == torch.float32 else 0.9, "seq-mean-token-sum")
    loss_ref, metrics_ref, grad_ref = reference_loss(logits, labels, old, adv, mask, ref, *args)
    policy, dlogits = loss_bounds(logits, labels, old, adv, mask, ref, *args, "torch")
    x = logits.clone().requires_grad_()
    loss, metrics = fused_policy_loss(x, labels, old, adv, mask, ref, *args, backend="torch")
    (0.5 * loss).backward()
    assert_within(loss, loss_ref, policy.loss_bound, "loss")
    assert_within(metrics["entropy"], metrics_ref["entropy"], policy.metric_bounds["entropy"], "metric entropy")
    assert torch.isfinite(x.grad).all()
    assert_within(x.grad, 0.5 * grad_ref, 0.5 * dlogits.bound, "dlogits")  # 0.5: an exact scaling


def test_torch_path_backward_twice_raises_clearly():
    logits, labels, old, adv, mask, _ = make_batch(seed=12)
    x = logits.clone().requires_grad_()
    loss, _ = fused_policy_loss(x, labels, old, adv, mask, backend="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagating through the same loss twice"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens(backend):
    x = torch.randn(0, 4, 9, requires_grad=True)
    labels = torch.zeros(0, 4, dtype=torch.long)
    zeros = torch.zeros(0, 4)
    loss, metrics = fused_policy_loss(x, labels, zeros, zeros, zeros, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == x.shape
    assert metrics["clipfrac"].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliced_batch_logits(backend):
    """A [B, T, V] slice of a longer sequence (as logits[:, :-1]) is read in place, per sequence."""
    logits, labels, old, adv, mask, ref = make_batch(shape=(3, 6), seed=13)
    base = torch.cat([logits, logits[:, :1]], dim=1).requires_grad_()
    assert not base[:, :-1].is_contiguous()
    args = (0.2, 0.2, None, 0.1, "k2", 0.01, 1.0, "seq-mean-token-mean")
    loss_ref, _, grad_ref = reference_loss(logits, labels, old, adv, mask, ref, *args)
    policy, dlogits = loss_bounds(logits, labels, old, adv, mask, ref, *args, backend)
    loss, _ = fused_policy_loss(base[:, :-1], labels, old, adv, mask, ref, *args, backend=backend)
    loss.backward()
    assert_within(loss, loss_ref, policy.loss_bound, "loss")
    assert_within(base.grad[:, :-1], grad_ref, dlogits.bound, "dlogits")
    assert (base.grad[:, -1] == 0).all()


def test_no_grad_mode_skips_the_gradient(monkeypatch):
    """Under torch.no_grad() (evaluation) the torch path writes no dlogits at all."""
    policy_module = importlib.import_module("fastrlhf.kernels.policy_loss")
    calls = []
    real = policy_module._torch_loss_and_grad

    def spy(*args):
        calls.append(args[-1])
        return real(*args)

    monkeypatch.setattr(policy_module, "_torch_loss_and_grad", spy)
    logits, labels, old, adv, mask, _ = make_batch(seed=14)
    x = logits.clone().requires_grad_()
    with torch.no_grad():
        loss, _ = fused_policy_loss(x, labels, old, adv, mask, backend="torch")
    assert calls == [None] and not loss.requires_grad
    loss_grad, _ = fused_policy_loss(x, labels, old, adv, mask, backend="torch")
    assert calls[-1] is not None
    torch.testing.assert_close(loss, loss_grad.detach())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_precomputed_weights_of_a_minibatch_split_into_micro_batches(backend, agg):
    # Rows 0-1 and row 2 of a minibatch as two micro-batches with their share of the minibatch's
    # weights (row 2 flattened to its kept tokens, as a packed micro-batch holds them): their losses
    # and logits gradients are exactly the whole minibatch's, whatever the aggregation mode.
    logits, labels, old, adv, mask, ref = make_batch((3, 5), seed=4, masked_row=False)
    args = (0.2, 0.28, 3.0, 0.1, "k3", 0.01, 0.8)
    loss_ref, _, grad_ref = reference_loss(logits, labels, old, adv, mask, ref, *args, agg)
    policy, dlogits = loss_bounds(logits, labels, old, adv, mask, ref, *args, agg, backend)
    x = logits.detach().clone().requires_grad_()
    whole, _ = fused_policy_loss(x, labels, old, adv, mask, ref, *args, agg, backend=backend)
    whole.backward()
    w = aggregation_weights(mask, agg)
    y = logits.detach().clone().requires_grad_()
    top, _ = fused_policy_loss(y[:2], labels[:2], old[:2], adv[:2], mask[:2], ref[:2], *args, backend=backend,
                               weights=w[:2])
    keep = mask[2] > 0
    bottom, _ = fused_policy_loss(y[2][keep], labels[2][keep], old[2][keep], adv[2][keep], mask[2][keep],
                                  ref[2][keep], *args, backend=backend, weights=w[2][keep])
    (top + bottom).backward()
    # Both within the fp32 bound of the float64 reference: the micro-batches' tokens get the same
    # per-token math, their sums group the same terms differently, and top + bottom is one more addition.
    assert_within(whole, loss_ref, policy.loss_bound, "whole loss")
    assert_within(top + bottom, loss_ref, policy.loss_bound + U * (abs(loss_ref.item()) + policy.loss_bound),
                  "micro-batch losses")
    assert_within(x.grad, grad_ref, dlogits.bound, "whole dlogits")
    assert_within(y.grad, grad_ref, dlogits.bound, "micro-batch dlogits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_with_a_kl_term(backend):
    """No token at all, a KL term on: a zero loss and zero metrics on either backend (the torch one raised)."""
    x = torch.randn(0, 9, requires_grad=True)
    zeros = torch.zeros(0)
    loss, metrics = fused_policy_loss(x, torch.zeros(0, dtype=torch.long), zeros, zeros, zeros, ref_logprobs=zeros,
                                      kl_coef=0.1, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == x.shape
    assert all(v.item() == 0.0 for v in metrics.values()), metrics


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_labels_are_read_where_they_are(backend):
    """Labels as a column of ``[N, 2]`` pairs (a strided view) give the loss and gradient of the same labels copied."""
    logits, labels, old, adv, mask, ref = make_batch(shape=(2, 5), seed=17)
    pairs = torch.stack([labels, labels.flip(-1)], dim=-1)
    strided = pairs[..., 0]
    assert not strided.is_contiguous()
    results = []
    for lab in (strided, strided.contiguous()):
        x = logits.clone().requires_grad_()
        loss, _ = fused_policy_loss(x, lab, old, adv, mask, ref, kl_coef=0.1, backend=backend)
        loss.backward()
        results.append((loss, x.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
