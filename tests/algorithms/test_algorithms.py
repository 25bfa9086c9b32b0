"""Regression tests for fastrlhf.algorithms.

Expected numbers are worked out by hand from the formulas (see the comments), never taken
from the code under test.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastrlhf.algorithms import (
    AGG_MODES,
    KL_KINDS,
    aggregate_loss,
    aggregation_count,
    aggregation_weights,
    compute_gae,
    compute_grpo_advantages,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    shape_rewards,
    value_loss,
)
from fastrlhf.algorithms.advantages import compute_rloo_advantages, gae_by_recursion

t = torch.tensor
INF = float("inf")


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=tol)


# ---------------------------------------------------------------- masked statistics
X = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = t([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])  # keeps 1, 2, 5


def test_masked_sum_and_mean():
    close(masked_sum(X, M), 8.0)
    close(masked_mean(X, M), 8.0 / 3)
    close(masked_sum(X, M, dim=-1), [3.0, 5.0])
    close(masked_mean(X, M, dim=-1), [1.5, 5.0])
    close(masked_mean(X, M, dim=0), [1.0, 3.5, 0.0])  # an empty column means 0, not NaN


def test_masked_var():
    # deviations from 8/3: -5/3, -2/3, 7/3; squares sum to 78/9
    close(masked_var(X, M, unbiased=False), 78 / 9 / 3)
    close(masked_var(X, M), 78 / 9 / 2)


def test_masked_var_needs_enough_elements():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, t([[1.0, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="at least 1"):
        masked_var(X, torch.zeros_like(X), unbiased=False)


def test_masked_whiten():
    mean, std = 8 / 3, math.sqrt(13 / 3)
    expected = t([[(1 - mean) / std, (2 - mean) / std, 0.0], [0.0, (5 - mean) / std, 0.0]])
    close(masked_whiten(X, M, eps=0.0), expected)
    unshifted = expected + mean * M
    close(masked_whiten(X, M, shift_mean=False, eps=0.0), unshifted)


# ---------------------------------------------------------------- logprobs and entropy
def test_logprobs_from_logits():
    logits = t([[0.0, math.log(2), math.log(3)]])  # softmax = 1/6, 2/6, 3/6
    close(logprobs_from_logits(logits, t([2])), [math.log(0.5)])
    close(logprobs_from_logits(logits, t([0])), [math.log(1 / 6)])
    # at T=2 the probabilities are proportional to 1, sqrt 2, sqrt 3
    close(logprobs_from_logits(logits, t([0]), temperature=2.0), [-math.log(1 + math.sqrt(2) + math.sqrt(3))])


def test_logprobs_are_fp32_for_bf16_input():
    out = logprobs_from_logits(torch.zeros(2, 4, dtype=torch.bfloat16), t([1, 3]))
    assert out.dtype == torch.float32
    close(out, [math.log(0.25)] * 2)


def test_entropy_from_logits():
    close(entropy_from_logits(torch.zeros(1, 4)), [math.log(4)])
    h = -(1 / 6 * math.log(1 / 6) + 1 / 3 * math.log(1 / 3) + 1 / 2 * math.log(1 / 2))
    close(entropy_from_logits(t([[0.0, math.log(2), math.log(3)]])), [h])
    # temperature: logits (0, 2 ln 2) at T=2 are (0, ln 2), probabilities 1/3, 2/3
    h2 = -(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3))
    close(entropy_from_logits(t([[0.0, 2 * math.log(2)]]), temperature=2.0), [h2])


def test_entropy_with_neg_inf_logits_is_finite_with_finite_gradient():
    logits = t([[0.0, -INF, 0.0, 0.0], [-INF, 3.0, -INF, -INF]], requires_grad=True)
    h = entropy_from_logits(logits)
    close(h.detach(), [math.log(3), 0.0])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    close(logits.grad, torch.zeros(2, 4))  # uniform over the finite logits: a stationary point


def test_logprob_shape_and_temperature_errors():
    with pytest.raises(ValueError, match=r"\(2, 5\).*\(3,\)"):
        logprobs_from_logits(torch.zeros(2, 5), t([0, 1, 2]))
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(torch.zeros(2, 5), temperature=0.0)


# ---------------------------------------------------------------- KL and rewards
def test_kl_penalty_kinds():
    lp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    close(kl_penalty(lp, ref, "k1"), [0.5, -1.0])
    close(kl_penalty(lp, ref, "abs"), [0.5, 1.0])
    close(kl_penalty(lp, ref, "k2"), [0.125, 0.5])
    # k3 with d = ref - lp = (-0.5, 1.0): exp(d) - d - 1
    close(kl_penalty(lp, ref, "k3"), [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0])
    # the clamps: d clamped to +-20, then the estimate to at most 10
    close(kl_penalty(t([0.0, 30.0]), t([30.0, 0.0]), "k3"), [10.0, 10.0])
    close(kl_penalty(lp, ref, "low_var_kl"), kl_penalty(lp, ref, "k3"))  # verl's name


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_penalty_with_mask_keeps_padding_out_of_the_gradient(kind):
    lp = t([[-1.0, -2.0, -0.5], [-0.3, -1.0, -1.0]]).requires_grad_()
    ref = t([[-1.5, -1.0, float("-inf")], [-0.2, float("-inf"), float("nan")]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    kl = kl_penalty(lp, ref, kind, mask)
    aggregate_loss(kl, mask, "token-mean").backward()
    assert torch.isfinite(kl).all() and (kl[mask == 0] == 0).all()
    assert torch.isfinite(lp.grad).all() and (lp.grad[mask == 0] == 0).all()
    kept = mask > 0
    close(kl[kept], kl_penalty(lp.detach()[kept], ref[kept], kind))
    if kind == "k2":  # why the mask is an argument: masking the result afterwards leaves a NaN gradient
        lp2 = lp.detach().clone().requires_grad_()
        aggregate_loss(kl_penalty(lp2, ref, kind), mask, "token-mean").backward()
        assert torch.isnan(lp2.grad).any()


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


def test_shape_rewards():
    lp = torch.full((2, 3), -1.0)
    ref = t([[-1.5, -1.0, -1.0], [-2.0, -1.0, -1.0]])  # k1 = lp - ref = 0.5 and 1.0 at t=0
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards = shape_rewards(t([1.0, 2.0]), lp, ref, mask, kl_coef=0.1)
    close(rewards, [[-0.05, 1.0, 0.0], [-0.1 + 2.0, 0.0, 0.0]])


def test_shape_rewards_row_without_tokens_gets_no_score():
    rewards = shape_rewards(t([5.0]), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), kl_coef=0.1)
    close(rewards, [[0.0, 0.0]])


# ---------------------------------------------------------------- advantages
def test_gae_monte_carlo_when_gamma_lambda_one():
    adv, ret = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.5, 0.5]]), torch.ones(1, 3), 1.0, 1.0)
    close(adv, [[0.5, 0.5, 0.5]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_discounted():
    # delta2 = 0.5, A2 = 0.5; delta1 = 0.9*0.5-0.5 = -0.05, A1 = -0.05+0.45*0.5 = 0.175;
    # delta0 = -0.05, A0 = -0.05 + 0.45*0.175 = 0.02875
    adv, ret = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.5, 0.5]]), torch.ones(1, 3), 0.9, 0.5)
    close(adv, [[0.02875, 0.175, 0.5]])
    close(ret, [[0.52875, 0.675, 1.0]])


def test_gae_carries_across_masked_positions():
    # position 1 is masked: its reward (7) and value (9) are ignored and the chain skips it
    adv, ret = compute_gae(t([[0.0, 7.0, 1.0]]), t([[0.5, 9.0, 0.5]]), t([[1.0, 0.0, 1.0]]), 0.9, 0.5)
    close(adv, [[0.175, 0.0, 0.5]])
    close(ret, [[0.675, 9.0, 1.0]])


def test_grpo_advantages():
    scores, groups = t([1.0, 0.0, 1.0, 5.0]), [0, 0, 0, 1]
    # group 0: mean 2/3, unbiased std sqrt(1/3); group 1 has one member -> 0
    std = math.sqrt(1 / 3)
    close(compute_grpo_advantages(scores, groups, eps=0.0), [1 / 3 / std, -2 / 3 / std, 1 / 3 / std, 0.0])
    close(compute_grpo_advantages(scores, groups, scale_by_std=False), [1 / 3, -2 / 3, 1 / 3, 0.0])
    # identical scores: zero advantage, not NaN
    close(compute_grpo_advantages(t([2.0, 2.0]), [7, 7]), [0.0, 0.0])

    # batch: centred by the group, divided by the std of all four scores (unbiased: mean 7/4, variance 59/12)
    batch_std = math.sqrt(59 / 12)
    close(compute_grpo_advantages(scores, groups, eps=0.0, scale_by_std="batch"),
          [1 / 3 / batch_std, -2 / 3 / batch_std, 1 / 3 / batch_std, 0.0])
    # a group whose scores differ by noise keeps advantages of that size, where its own std scales them to ~1
    noisy = t([0.9994, 0.9995, 0.0, 1.0])
    assert compute_grpo_advantages(noisy, [0, 0, 1, 1], scale_by_std="batch")[:2].abs().max() < 1e-3
    assert compute_grpo_advantages(noisy, [0, 0, 1, 1])[:2].abs().min() > 0.5


@pytest.mark.parametrize("value,n", [(0.7, 16), (1.2, 8), (1.1, 16), (100.7, 16)])
def test_a_group_of_equal_scores_has_exactly_zero_advantage(value, n):
    """Scores whose fp32 sum is not exact (16 x 0.7): summed in fp32 the group's mean was an ulp off, and the ulp
    over a std made of ulps gave every member the same advantage of up to 0.86; beside a group that differs."""
    scores = torch.tensor([value] * n + [1.0, 0.0] * 4, dtype=torch.float32)
    groups = [0] * n + [1] * 8
    for scale in (True, False, "batch"):
        adv = compute_grpo_advantages(scores, groups, scale_by_std=scale)
        assert torch.equal(adv[:n], torch.zeros(n)), (scale, adv[:n])
        assert (adv[n:] != 0).all()
    assert torch.equal(compute_rloo_advantages(scores, groups)[:n], torch.zeros(n))


# ---------------------------------------------------------------- losses
LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
LOSS_MASK = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the third row is fully masked


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 3),                 # (1 + 2 + 4) / 3
    ("seq-mean-token-mean", 2.75),         # mean(1.5, 4); the empty row is left out
    ("seq-mean-token-sum", 3.5),           # mean(3, 4)
    ("seq-mean-token-sum-norm", 3.5 / 3),  # divided by T = 3
])
def test_aggregate_loss(mode, expected):
    close(aggregate_loss(LOSS, LOSS_MASK, mode), expected)
    close((aggregation_weights(LOSS_MASK, mode) * LOSS).sum(), expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_weights_over_every_ranks_count_average_to_the_whole_batchs_aggregate(mode):
    """A batch split over two ranks, each rank's weights dividing by both ranks' count together (aggregation_count
    summed, over 2): the mean of the ranks' weighted sums (what averaging their gradients takes) is the whole
    batch's aggregate. Each rank's own count gave the short rank's tokens more weight than the long rank's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 10, generator=g)
    mask = torch.zeros(4, 10)
    mask[0, :2] = mask[1, :2] = 1.0  # rank 0: two short completions
    mask[2, :10] = 1.0  # rank 1: a long one, and a row with nothing trained (a cut completion)
    whole = (aggregation_weights(mask, mode, length=16) * x).sum()
    ranks = [slice(0, 2), slice(2, 4)]
    count = sum(aggregation_count(mask[r], mode) for r in ranks) / 2
    averaged = sum((aggregation_weights(mask[r], mode, count, length=16) * x[r]).sum() for r in ranks) / 2
    close(averaged, whole)
    own = sum((aggregation_weights(mask[r], mode, length=16) * x[r]).sum() for r in ranks) / 2
    assert abs(float(own) - float(whole)) > 1e-3  # each rank's own count


def test_dr_grpo_divides_by_a_constant_length_not_the_longest_completion():
    short, padded = torch.ones(1, 3), torch.cat([torch.ones(1, 3), torch.zeros(1, 61)], dim=1)
    a = aggregation_weights(short, "seq-mean-token-sum-norm", length=64)
    b = aggregation_weights(padded, "seq-mean-token-sum-norm", length=64)
    close(a, b[:, :3])
    close(a, torch.full((1, 3), 1 / 64))


def test_aggregate_loss_unknown_mode():
    with pytest.raises(ValueError, match="'seq-sum'"):
        aggregate_loss(LOSS, LOSS_MASK, "seq-sum")


def _policy_case(log_ratios, advantages):
    old = torch.full((1, len(log_ratios)), -2.0, dtype=torch.float64)
    lp = old + t([log_ratios], dtype=torch.float64)
    return lp, old, t([advantages], dtype=torch.float64), torch.ones_like(old)


def test_policy_loss_hand_computed():
    # ratios 1.5, 0.5, 1.0, 1.1 with advantages 1, 1, -1, -2:
    # token losses max(-A r, -A clip(r)) = -1.2 (clipped), -0.5, 1.0, 2.2
    lp, old, adv, mask = _policy_case([math.log(1.5), math.log(0.5), 0.0, math.log(1.1)], [1.0, 1.0, -1.0, -2.0])
    loss, metrics = policy_loss(lp, old, adv, mask)
    close(loss, (-1.2 - 0.5 + 1.0 + 2.2) / 4)
    close(metrics["clipfrac"], 0.25)
    close(metrics["approx_kl"], -math.log(1.5 * 0.5 * 1.1) / 4)


def test_policy_loss_clip_higher_and_dual_clip():
    lp, old, adv, mask = _policy_case([math.log(1.5)], [1.0])
    close(policy_loss(lp, old, adv, mask, clip_high=0.28)[0], -1.28)
    close(policy_loss(lp, old, adv, mask, clip_high=0.28, dual_clip=3.0)[0], -1.28)  # A > 0: no dual clip
    # A = -1, ratio 5: the clipped max is 5; dual clip c=3 caps it at -A*c = 3
    lp, old, adv, mask = _policy_case([math.log(5.0)], [-1.0])
    close(policy_loss(lp, old, adv, mask)[0], 5.0)
    close(policy_loss(lp, old, adv, mask, dual_clip=3.0)[0], 3.0)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, old, adv, mask, dual_clip=0.5)


def test_value_loss_hand_computed():
    # token 0: (1-2)^2 = 1 vs clipped (0.5+0.2-2)^2 = 1.69 -> 1.69; token 1: both 1
    loss, metrics = value_loss(t([[1.0, 2.0]]), t([[0.5, 2.0]]), t([[2.0, 1.0]]), torch.ones(1, 2))
    close(loss, 0.5 * (1.69 + 1.0) / 2)
    close(metrics["vf_clipfrac"], 0.5)


def test_vf_clipfrac_counts_active_clipping_only():
    # old + (v - old) is v give or take an ulp; an unclipped token must not count as clipped because
    # of that rounding (it would make the metric depend on how a batch was split into micro-batches).
    v, old = t([[-0.24, -0.12, -0.1, -0.12]]), t([[-0.1, -0.29, 0.05, 0.06]])  # |v - old| <= 0.2 in fp32
    ret = t([[-0.25, -0.11, -0.09, -0.13]])
    rounded = old + (v - old)
    assert (rounded != v).all() and ((rounded - ret).square() > (v - ret).square()).all()  # the case holds
    _, metrics = value_loss(v, old, ret, torch.ones(1, 4), clip=0.2)
    assert float(metrics["vf_clipfrac"]) == 0.0
    _, metrics = value_loss(v, old - 1.0, t([[5.0, -5.0, -5.0, 5.0]]), torch.ones(1, 4), clip=0.2)
    assert float(metrics["vf_clipfrac"]) > 0.0


def test_shape_mismatch_names_both_shapes():
    a, b = torch.zeros(2, 3), torch.zeros(2, 4)
    for call in (lambda: policy_loss(a, a, a, b), lambda: value_loss(a, a, b, a), lambda: masked_mean(a, b),
                 lambda: compute_gae(a, b, a, 1.0, 1.0), lambda: aggregate_loss(a, b, "token-mean")):
        with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)|\(2, 4\).*\(2, 3\)"):
            call()


# ---------------------------------------------------------------- gradients (float64 gradcheck)
def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_gradcheck_policy_loss():
    old = _rand(3, 5, seed=1)
    adv = _rand(3, 5, seed=2)
    mask = (torch.rand(3, 5, generator=torch.Generator().manual_seed(3)) > 0.3).double()
    for agg in AGG_MODES:
        for dual in (None, 3.0):
            # ratios in (0.85, 1.15) away from the clip boundaries, and far outside, so no kink is crossed
            lp = (old + t([[0.05, -0.1, 0.6, -0.7, 0.0]] * 3, dtype=torch.float64)).requires_grad_()
            def loss(x, dual=dual, agg=agg):
                return policy_loss(x, old, adv, mask, dual_clip=dual, agg=agg)[0]

            assert torch.autograd.gradcheck(loss, (lp,))


def test_gradcheck_value_loss():
    old, ret = _rand(2, 4, seed=4), _rand(2, 4, seed=5)
    v = (old + t([[0.05, 0.5, -0.5, -0.1]] * 2, dtype=torch.float64)).requires_grad_()
    for agg in AGG_MODES:
        def loss(x, agg=agg):
            return value_loss(x, old, ret, torch.ones_like(x), agg=agg)[0]

        assert torch.autograd.gradcheck(loss, (v,))


def test_gradcheck_logprobs_entropy_kl():
    logits = _rand(3, 7, seed=6).requires_grad_()
    labels = t([0, 3, 6])
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels, temperature=0.7), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, temperature=0.7), (logits,))
    ref = _rand(4, seed=7)
    lp = _rand(4, seed=8).requires_grad_()
    for kind in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda x, kind=kind: kl_penalty(x, ref, kind), (lp,))


def test_gradcheck_gae_and_whiten():
    rewards, values = _rand(2, 4, seed=9).requires_grad_(), _rand(2, 4, seed=10).requires_grad_()
    mask = t([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda r, v: compute_gae(r, v, mask, 0.99, 0.95), (rewards, values))
    assert torch.autograd.gradcheck(lambda x: masked_whiten(x, mask), (values,))


# ---------------------------------------------------------------- properties (hypothesis)
shapes = st.tuples(st.integers(1, 5), st.integers(2, 8))


def _data(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(*shape, generator=g) > 0.4).double()
    mask[0, 0] = mask[0, 1] = 1.0  # at least two kept tokens
    return x, mask, g


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_whitened_has_mean_zero_and_unit_variance(shape, seed):
    x, mask, _ = _data(shape, seed)
    x = x * 3.0 + 1.0
    w = masked_whiten(x, mask, eps=0.0)
    close(masked_mean(w, mask), 0.0, tol=1e-9)
    close(masked_var(w, mask), 1.0, tol=1e-9)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 2**16),
       scale=st.booleans())
def test_grpo_advantages_sum_to_zero_per_group(sizes, seed, scale):
    groups = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    scores = torch.randn(len(groups), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv = compute_grpo_advantages(scores, groups, scale_by_std=scale)
    for g in range(len(sizes)):
        close(adv[groups == g].sum(), 0.0, tol=1e-9)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), clip=st.floats(0.05, 0.5), agg=st.sampled_from(AGG_MODES))
def test_clipping_never_increases_the_objective(shape, seed, clip, agg):
    x, mask, g = _data(shape, seed)
    old = torch.randn(*shape, generator=g, dtype=torch.float64)
    lp = old + 0.5 * x
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    loss, _ = policy_loss(lp, old, adv, mask, clip_low=clip, clip_high=clip, agg=agg)
    unclipped = aggregate_loss(-adv * torch.exp(lp - old), mask, agg)
    assert loss >= unclipped - 1e-12  # the loss is the negated objective


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), agg=st.sampled_from(AGG_MODES),
       junk=st.sampled_from([float("nan"), INF, -INF, 1e30]))
def test_masked_positions_never_change_a_result(shape, seed, agg, junk):
    x, mask, g = _data(shape, seed)
    tensors = [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(4)]
    scores = torch.randn(shape[0], generator=g, dtype=torch.float64)

    def results(a, b, c, d):
        return [
            policy_loss(a, b, c, mask, dual_clip=3.0, agg=agg)[0],
            *policy_loss(a, b, c, mask)[1].values(),
            value_loss(a, b, c, mask, agg=agg)[0],
            aggregate_loss(d, mask, agg),
            masked_whiten(d, mask),
            *compute_gae(c, d, mask, 0.9, 0.8)[0:1],
            shape_rewards(scores, a, b, mask, 0.1, "k3"),
            masked_var(d, mask),
        ]

    clean = results(*tensors)
    dirty = results(*[torch.where(mask > 0, x_, torch.full_like(x_, junk)) for x_ in tensors])
    for a, b in zip(clean, dirty, strict=True):
        torch.testing.assert_close(a, b)


@settings(max_examples=30, deadline=None)
@given(ids=st.lists(st.integers(-3, 40), min_size=1, max_size=12), seed=st.integers(0, 2**16),
       scale=st.booleans())
def test_grpo_and_rloo_take_group_ids_in_any_order_and_numbering(ids, seed, scale):
    """Groups are found by a sort on the device: any ids, unsorted, with gaps or negative, group as their values do
    (a plain per-group loop as the reference)."""
    scores = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    groups = torch.tensor(ids)
    expected_grpo, expected_rloo = torch.zeros_like(scores), torch.zeros_like(scores)
    for g in set(ids):
        rows = groups == g
        n = int(rows.sum())
        if n > 1:
            centered = scores[rows] - scores[rows].mean()
            expected_grpo[rows] = centered / (scores[rows].std() + 1e-6) if scale else centered
            expected_rloo[rows] = centered * n / (n - 1)
    close(compute_grpo_advantages(scores, groups, scale_by_std=scale), expected_grpo, tol=1e-9)
    close(compute_rloo_advantages(scores, groups), expected_rloo, tol=1e-9)


def test_group_advantages_token_rewards_and_gae_read_no_device_value():
    """``device="meta"`` has no values: an op that sizes its output from them (``torch.unique``, ``nonzero``) or a
    host read raises there, as each would wait for the queued kernels on a GPU."""
    scores = torch.empty(6, device="meta")
    groups = torch.empty(6, dtype=torch.long, device="meta")
    for adv in (compute_grpo_advantages(scores, groups), compute_grpo_advantages(scores, groups, scale_by_std=False),
                compute_rloo_advantages(scores, groups)):
        assert adv.shape == (6,) and adv.device.type == "meta"
    logprobs, mask = torch.empty(6, 4, device="meta"), torch.empty(6, 4, device="meta")
    assert shape_rewards(scores, logprobs, logprobs, mask, 0.1, "k3").shape == (6, 4)
    assert all(x.shape == (6, 4) for x in compute_gae(logprobs, logprobs, mask, 0.99, 0.95))
    with pytest.raises((NotImplementedError, RuntimeError)):  # the check can fail: what the old code did
        torch.unique(groups, return_inverse=True)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), length=st.integers(1, 150), seed=st.integers(0, 2**16),
       gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]), lam=st.sampled_from([0.0, 0.95, 1.0]),
       kept=st.floats(0.0, 1.0), dtype=st.sampled_from([torch.float32, torch.float64]),
       block_elements=st.sampled_from([None, 1]))
def test_gae_in_blocks_equals_the_recursion(rows, length, seed, gamma, lam, kept, dtype, block_elements):
    """Across block boundaries (32 positions), with rows fully masked or fully kept, gaps of any length, gamma and
    lambda at their ends, and the weights made one block at a time (``block_elements``)."""
    import fastrlhf.algorithms.advantages as A

    g = torch.Generator().manual_seed(seed)
    rewards, values = (torch.randn(rows, length, generator=g, dtype=torch.float64) for _ in range(2))
    mask = (torch.rand(rows, length, generator=g) < kept).double()
    rewards, values, mask = rewards.to(dtype), values.to(dtype), mask.to(dtype)
    saved = A.GAE_BLOCK_ELEMENTS
    A.GAE_BLOCK_ELEMENTS = block_elements or saved
    try:
        adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    finally:
        A.GAE_BLOCK_ELEMENTS = saved
    ref_adv, ref_ret = gae_by_recursion(rewards.double(), values.double(), mask, gamma, lam)
    tol = 1e-9 if dtype == torch.float64 else 2e-5 * max(1.0, float(ref_adv.abs().max()))
    close(adv.double(), ref_adv, tol=tol)
    close(ret.double(), ref_ret, tol=tol)
    assert adv.dtype == dtype and bool((adv[mask == 0] == 0).all())


def test_gae_launches_a_few_ops_per_block_not_per_token():
    """The point of the blocks: 4,096 tokens take a few ops per 32-token block, where the recursion took about 15
    per token (counted with a dispatch mode: views included, most of them a launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    rewards, values, mask = torch.randn(4, 4096), torch.randn(4, 4096), torch.ones(4, 4096)
    with Count():
        compute_gae(rewards, values, mask, 0.99, 0.95)
    blocked, Count.ops = Count.ops, 0
    with Count():
        gae_by_recursion(rewards, values, mask, 0.99, 0.95)
    assert blocked < 4096 // 32 * 4 + 100 < Count.ops / 20, (blocked, Count.ops)
