"""The registries of fastrlhf.algorithms: policy losses and advantage estimators by name, the
formulas that moved there (TIS weights, the actor-loss composition, SFT and RM losses), and the two
ways a registered loss is trained (fused into the token-chunked kernel, or on fused logprobs)."""

import math

import pytest
import torch
from fastrlhf.kernels import fused_linear_policy_loss, fused_policy_loss

from fastrlhf.algorithms import (
    ADV_ESTIMATOR_OF,
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    actor_loss_per_token,
    aggregate_loss,
    bradley_terry_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    nll_loss,
    policy_loss,
    register_policy_loss,
    rollout_is_weights,
)

t = torch.tensor


def test_registries_name_every_algorithm_and_loss():
    assert {"vanilla", "cispo", "gspo", "sapo"} <= set(POLICY_LOSSES)
    assert POLICY_LOSSES["vanilla"].token_level and POLICY_LOSSES["cispo"].token_level
    assert not POLICY_LOSSES["gspo"].token_level
    assert ADV_ESTIMATOR_OF == {"ppo": "gae", "grpo": "grpo"} and set(ADV_ESTIMATOR_OF.values()) <= set(ADV_ESTIMATORS)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)
    registered = "cispo, clip_cov, gpg, gspo, kl_cov, sapo, vanilla"
    with pytest.raises(ValueError, match=f"unknown policy loss 'nope'; registered: {registered}"):
        actor_loss_per_token(t([0.0]), t([0.0]), t([0.0]), t([1.0]), t([1.0]), policy_loss="nope")


def _batch(seed=0, B=3, T=5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 2
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return lp, old, adv, mask


def test_composition_equals_the_sum_of_aggregated_terms():
    # aggregate(policy + c*KL - e*H) == aggregate(policy) + c*aggregate(KL) - e*aggregate(H): every mode is linear.
    lp, old, adv, mask = _batch()
    ref, ent = lp - 0.2, torch.rand(lp.shape)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss_mat, _, kl = actor_loss_per_token(lp, ent, old, adv, mask, ref, clip_low=0.2, clip_high=0.28,
                                               dual_clip=3.0, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01)
        expected = (policy_loss(lp, old, adv, mask, 0.2, 0.28, 3.0, agg)[0]
                    + 0.1 * aggregate_loss(kl_penalty(lp, ref, "k3"), mask, agg)
                    - 0.01 * aggregate_loss(ent, mask, agg))
        torch.testing.assert_close(aggregate_loss(loss_mat, mask, agg), expected)
        torch.testing.assert_close(kl, kl_penalty(lp, ref, "k3", mask))


@pytest.mark.parametrize("name", ["cispo", "gspo", "sapo"])
def test_on_policy_gradient_equals_vanilla(name):
    # At ratio 1 every policy loss reduces to the policy gradient -A * grad(logprob).
    lp, _, adv, mask = _batch(1)
    grads = {}
    for loss_name in ("vanilla", name):
        x = lp.clone().requires_grad_()
        loss_mat, is_clipped, _ = actor_loss_per_token(x, torch.zeros_like(x), x.detach(), adv, mask,
                                                       policy_loss=loss_name)
        aggregate_loss(loss_mat, mask, "seq-mean-token-mean").backward()
        grads[loss_name] = x.grad
        assert not is_clipped[mask > 0].any()
    torch.testing.assert_close(grads[name], grads["vanilla"])


def test_cispo_clips_the_detached_weight_not_the_gradient():
    lp, old, adv, mask = t([[-1.0, -1.0]]), t([[-2.0, -1.0]]), t([[1.0, -2.0]]), torch.ones(1, 2)
    x = lp.clone().requires_grad_()
    loss_mat, is_clipped, _ = actor_loss_per_token(x, torch.zeros_like(x), old, adv, mask, policy_loss="cispo",
                                                   clip_low=0.2, clip_high=0.28)
    loss_mat.sum().backward()
    # token 0: r = e^1 clipped to 1.28, the token still gets gradient -A * 1.28; token 1: r = 1.
    assert is_clipped.tolist() == [[True, False]]
    torch.testing.assert_close(x.grad, t([[-1.28, 2.0]]))
    torch.testing.assert_close(loss_mat.detach(), t([[1.28, -2.0]]))


def test_sapo_gates_the_ratio_softly_with_a_temperature_per_advantage_sign():
    lp, old, adv = t([[-1.0, -1.0, -0.5]]), t([[-1.5, -0.8, -0.5]]), t([[1.0, -2.0, 0.5]])
    x = lp.clone().requires_grad_()
    loss_mat, is_clipped, _ = actor_loss_per_token(x, torch.zeros_like(x), old, adv, torch.ones(1, 3),
                                                   policy_loss="sapo", policy_loss_args=dict(tau_pos=0.5, tau_neg=2.0))
    loss_mat.sum().backward()
    assert not is_clipped.any()
    for i in range(3):  # by hand: f = 4/tau sigmoid(tau (r - 1)), df/dlp = 4 sigmoid'(tau (r - 1)) r
        a = float(adv[0, i])
        tau, r = (0.5 if a > 0 else 2.0), math.exp(float(lp[0, i] - old[0, i]))
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        assert math.isclose(float(loss_mat.detach()[0, i]), -a * 4 / tau * sig, rel_tol=1e-6)
        assert math.isclose(float(x.grad[0, i]), -a * 4 * sig * (1 - sig) * r, rel_tol=1e-5)
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0, got 1.0 and 0.0"):
        actor_loss_per_token(lp, lp, old, adv, torch.ones(1, 3), policy_loss="sapo", policy_loss_args={"tau_neg": 0.0})


def test_policy_loss_options_are_the_keyword_arguments_after_the_clips():
    from fastrlhf.algorithms import policy_loss_options

    assert policy_loss_options("sapo") == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert policy_loss_options("vanilla") == {} and policy_loss_options("gspo") == {}


def test_gspo_uses_each_sequences_mean_ratio():
    lp, old, adv, mask = _batch(2)
    x = lp.clone().requires_grad_()
    loss_mat, is_clipped, _ = actor_loss_per_token(x, torch.zeros_like(x), old, adv, mask, policy_loss="gspo",
                                                   clip_low=0.1, clip_high=0.1)
    aggregate_loss(loss_mat, mask, "seq-mean-token-mean").backward()
    n_seqs = 3
    for b in range(3):
        keep = mask[b] > 0
        s = math.exp(float((lp[b, keep] - old[b, keep]).mean()))  # by hand, row by row
        clipped = min(max(s, 0.9), 1.1)
        for i in torch.nonzero(keep).flatten().tolist():
            a = float(adv[b, i])
            assert math.isclose(float(loss_mat.detach()[b, i]), max(-a * s, -a * clipped), rel_tol=1e-5)
            grad = -a * s if -a * s >= -a * clipped else 0.0  # the clipped branch is constant in lp
            assert math.isclose(float(x.grad[b, i]), grad / int(keep.sum()) / n_seqs, rel_tol=1e-5, abs_tol=1e-7)
            assert bool(is_clipped[b, i]) == (-a * clipped > -a * s)
    with pytest.raises(ValueError, match=r"gspo needs \[B, T\]"):
        actor_loss_per_token(lp.flatten(), lp.flatten(), old.flatten(), adv.flatten(), mask.flatten(),
                             policy_loss="gspo")


@pytest.mark.parametrize("name, options", [("cispo", None), ("sapo", {"tau_pos": 0.8, "tau_neg": 1.3})])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_kernels_train_a_registered_token_level_loss(backend, name, options):
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 3, 5, 8, 41
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (B, T), generator=g)
    lp0, old, adv, mask = _batch(3)
    ref = old - 0.1
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_kind="k2", entropy_coef=0.01, agg="seq-mean-token-mean")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = fused_linear_policy_loss(h, w, labels, old, adv, mask, ref, policy_loss=name, backend=backend,
                                       policy_loss_args=options, **kw)
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h2 @ w2.T
    lp, ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
    loss_mat, _, _ = actor_loss_per_token(lp, ent, old, adv, mask, ref, policy_loss=name, policy_loss_args=options,
                                          **{k: v for k, v in kw.items() if k != "agg"})
    expected = aggregate_loss(loss_mat, mask, kw["agg"])
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="'gspo' needs whole sequences"):
        fused_policy_loss(logits.detach(), labels, old, adv, mask, policy_loss="gspo", backend=backend)


def test_rollout_is_weights_truncate_token_level():
    old, engine = t([[0.0, -1.0, 50.0, 3.0]]), t([[0.0, -2.0, 0.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0]])
    # exp(0) = 1; exp(1) = 2.718 capped at 2; exp(50) capped at 2 without overflowing; masked -> 0.
    weights, outside = rollout_is_weights(old, engine, mask, 2.0)
    torch.testing.assert_close(weights, t([[1.0, 2.0, 2.0, 0.0]]))
    assert outside.tolist() == [[False, True, True, False]]


# Log-ratios (old - engine) of three rows: [0, 1, -1 | pad], [0.5, 0.5 | pad, pad], and a fully masked row whose
# engine logprobs are -inf (padding): none of it may leak into a weight.
IS_LOG_RATIO = [[0.0, 1.0, -1.0, 7.0], [0.5, 0.5, 9.0, 9.0], [0.0, 0.0, 0.0, 0.0]]
IS_MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
E, E5 = math.e, math.exp(0.5)


@pytest.mark.parametrize("level, mode, floor, weights, outside", [
    ("token", "mask", 0.5, [[1, 0, 0, 0], [E5, E5, 0, 0]], [[0, 1, 1, 0], [0, 0, 0, 0]]),
    ("token", "mask", None, [[1, 0, 1 / E, 0], [E5, E5, 0, 0]], [[0, 1, 0, 0], [0, 0, 0, 0]]),
    # a floor under truncation clamps from below (TRL's *_truncate with vllm_importance_sampling_clip_min)
    ("token", "truncate", 0.5, [[1, 2, 0.5, 0], [E5, E5, 0, 0]], [[0, 1, 1, 0], [0, 0, 0, 0]]),
    # a completion's ratio: exp of its summed log-ratio (0 and 1), on each of its tokens
    ("sequence", "truncate", None, [[1, 1, 1, 0], [2, 2, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),
    ("sequence", "mask", None, [[1, 1, 1, 0], [0, 0, 0, 0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),
    # the per-token geometric mean: exp of the mean log-ratio (0 and 0.5)
    ("geometric", "truncate", None, [[1, 1, 1, 0], [E5, E5, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]]),
    ("geometric", "mask", 1.1, [[0, 0, 0, 0], [E5, E5, 0, 0]], [[1, 1, 1, 0], [0, 0, 0, 0]]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_is_weights_levels_and_modes(level, mode, floor, weights, outside, dtype):
    engine = torch.tensor([[-1.0, -2.0, -0.5, float("-inf")], [-0.75, -1.5, float("-inf"), float("-inf")],
                           [float("-inf")] * 4], dtype=dtype)
    old = engine.float().nan_to_num(neginf=0.0) + t(IS_LOG_RATIO)  # finite where masked: the mask alone hides it
    got, got_outside = rollout_is_weights(old.to(dtype), engine, t(IS_MASK), 2.0, level=level, mode=mode, floor=floor)
    assert got.dtype == torch.float32  # the ratio is taken in fp32 whatever the logprobs' dtype
    torch.testing.assert_close(got, t(weights + [[0, 0, 0, 0]], dtype=torch.float32), rtol=1e-6, atol=1e-6)
    assert got_outside.int().tolist() == outside + [[0, 0, 0, 0]]


def test_rollout_is_weights_of_long_completions_stay_finite():
    mask = torch.ones(2, 300)
    old, engine = torch.zeros(2, 300), torch.full((2, 300), -2.0)  # a summed log-ratio of 600: exp overflows
    engine[1] = 2.0  # and of -600: exp underflows to 0
    for mode in ("truncate", "mask"):
        weights, _ = rollout_is_weights(old, engine, mask, 3.0, level="sequence", mode=mode)
        assert torch.isfinite(weights).all()
        assert weights[0, 0].item() == pytest.approx(3.0 if mode == "truncate" else 0.0)
        assert weights[1, 0].item() < 1e-8
    geometric, _ = rollout_is_weights(old, engine, mask, 10.0, level="geometric")
    torch.testing.assert_close(geometric[:, 0], torch.tensor([math.exp(2.0), math.exp(-2.0)]))


def test_rollout_is_weights_refuses_what_it_cannot_mean():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="level must be one of"):
        rollout_is_weights(x, x, x, 2.0, level="sentence")


def test_supervised_losses():
    logprobs, mask = t([[-1.0, -3.0, float("-inf")]]), t([[1.0, 1.0, 0.0]])
    assert float(nll_loss(logprobs, mask)) == 2.0  # the masked -inf never enters the mean
    assert float(nll_loss(logprobs, torch.zeros_like(mask))) == 0.0
    chosen, rejected = t([2.0, 0.0]), t([0.0, 0.0])
    expected = (math.log1p(math.exp(-2.0)) + math.log(2.0)) / 2
    assert math.isclose(float(bradley_terry_loss(chosen, rejected)), expected, rel_tol=1e-6)
