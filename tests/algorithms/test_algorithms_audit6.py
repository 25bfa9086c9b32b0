"""fastrlhf.algorithms against its peers' code, on the same random inputs: empty rows, extreme ratios, gradients.

Each ``verl_*`` / ``trl_*`` function below is the peer's formula written out small (their tensors, clamps and
reductions; config plumbing and metrics left out), from:

* verl ``verl/trainer/ppo/core_algos.py`` and ``verl/trainer/ppo/rollout_corr_helper.py`` (commit b178a3c):
  ``agg_loss``, ``compute_policy_loss_vanilla``/``_gspo``/``_sapo``/``_cispo``, ``compute_value_loss``,
  ``kl_penalty_forward``, ``compute_gae_advantage_return``, ``compute_grpo_outcome_advantage``,
  ``compute_rloo_outcome_advantage``, ``compute_reinforce_plus_plus(_baseline)_outcome_advantage``,
  ``compute_rollout_correction_weights``; ``verl/utils/torch_functional.py`` ``masked_whiten``,
  ``entropy_from_logits``;
* TRL ``trl/trainer/grpo_trainer.py`` (commit f2cd577): ``_compute_loss``'s ``dr_grpo`` normaliser and the
  ``vllm_importance_sampling_mode`` ``*_mask`` ratios.

Where fastrlhf differs from a peer by design (a group of one, verl's Dr.GRPO divisor) the test says so.
"""

from types import SimpleNamespace

import pytest
import torch

from fastrlhf.algorithms import (
    ADV_ESTIMATORS,
    AGG_MODES,
    POLICY_LOSSES,
    actor_loss_per_token,
    aggregate_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    rollout_is_weights,
    value_loss,
)

F64 = torch.float64


def close(actual, expected, tol=1e-7):
    """fp64 agreement up to the peers' own epsilons (verl's ``+ 1e-8`` denominators)."""
    torch.testing.assert_close(actual.to(F64), expected.to(F64), rtol=tol, atol=tol)


def batch(seed, B=6, T=9, spread=0.3, dtype=F64):
    """Right-padded rows (row 1 fully masked), logprobs with log-ratios of about ``spread`` and two extreme ones."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 0, 4, 1, 7, 9])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    lp = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    old = lp + spread * torch.randn(B, T, generator=g, dtype=dtype)
    old[0, 0], old[0, 1] = lp[0, 0] - 30.0, lp[0, 1] + 30.0  # exp(+-30): the +-20 clamps of both sides
    ref = lp + spread * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, T, generator=g, dtype=dtype) * mask
    return lp, old, ref, adv, mask


# ---------------------------------------------------------------- verl, written out
def verl_masked_mean(x, mask, dim=None):
    return (x * mask).sum() / (mask.sum() + 1e-8) if dim is None else (x * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def verl_masked_whiten(x, mask):
    mean = verl_masked_mean(x, mask)
    var = verl_masked_mean((x - mean) ** 2, mask) * (mask.sum() / (mask.sum() - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)


def verl_agg_loss(loss_mat, mask, mode):
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_tokens = mask.sum(-1)
    seq_mask = (seq_tokens > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-sum":
        return ((loss_mat * mask).sum(-1) * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(-1) / (seq_tokens + 1e-8) * seq_mask).sum() / seq_mask.sum()
    return (loss_mat * mask).sum() / mask.shape[-1]  # seq-mean-token-sum-norm: no division by the sequences


def verl_vanilla(lp, old, adv, clip_low, clip_high, clip_ratio_c):
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(l1, l2)
    return torch.where(adv < 0, torch.min(-adv * clip_ratio_c, clip1), clip1)


def verl_gspo(lp, old, adv, mask, clip_low, clip_high):
    seq = ((lp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_ratio = torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))


def verl_sapo(lp, old, adv, tau_pos, tau_neg):
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    tau = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    return -(torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)) * adv


def verl_cispo(lp, old, adv, clip_low, clip_high):
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    return -torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach() * adv * lp


def verl_kl(lp, ref, kind):
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref).square()
    kl = torch.clamp(ref - lp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_value_loss(vpreds, returns, values, mask, clip, mode):
    clipped = torch.max(torch.min(vpreds, values + clip), values - clip)
    return 0.5 * verl_agg_loss(torch.max((vpreds - returns) ** 2, (clipped - returns) ** 2), mask, mode)


def verl_gae(rewards, values, mask, gamma, lam):
    nextvalues, lastgaelam, out = 0, 0, []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return verl_masked_whiten(adv, mask), adv + values


def verl_group_scores(scores, index, how, eps=1e-6):
    out = scores.clone()
    for g in set(index):
        rows = [i for i, x in enumerate(index) if x == g]
        group = scores[rows]
        n = len(rows)
        mean = group.mean() if n > 1 else torch.tensor(0.0, dtype=scores.dtype)
        std = group.std() if n > 1 else torch.tensor(1.0, dtype=scores.dtype)
        for i in rows:
            if how == "grpo":
                out[i] = (scores[i] - mean) / (std + eps)
            elif how == "grpo-no-std":
                out[i] = scores[i] - mean
            elif how == "rloo" and n > 1:
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
            elif how == "baseline":
                out[i] = scores[i] - mean
    return out


def verl_reinforce_pp(rewards, mask, gamma):
    returns, running = torch.zeros_like(rewards), 0
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask


def verl_is_weights(log_ratio, mask, level, threshold):
    if level == "token":
        weights = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    else:
        weights = torch.exp(torch.clamp((log_ratio * mask).sum(-1, keepdim=True), -20.0, 20.0)).expand_as(log_ratio)
    return weights.clamp(max=threshold) * mask


def trl_mask_is_weights(log_ratio, mask, sequence, clip_min, clip_max):
    diff = log_ratio * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence else diff)
    return ratio.masked_fill((ratio < clip_min) | (ratio > clip_max), 0.0)


# ---------------------------------------------------------------- aggregation
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_aggregation_mode_against_verl_and_trl(mode, seed):
    loss_mat, *_, mask = batch(seed)  # row 1 is fully masked
    loss_mat = torch.where(mask > 0, loss_mat, torch.full_like(loss_mat, float("nan")))
    ours = aggregate_loss(loss_mat, mask, mode)
    clean = torch.where(mask > 0, loss_mat, 0.0)
    if mode != "seq-mean-token-sum-norm":
        close(ours, verl_agg_loss(clean, mask, mode))
        return
    # Dr.GRPO: TRL's dr_grpo divides the token sum by rows x max_completion_length (rows with a token: fastrlhf
    # leaves fully masked rows out, as its other seq-mean modes and verl's do); verl's divides by the width only.
    rows_with_tokens = (mask.sum(-1) > 0).sum()
    close(ours, clean.sum() / (rows_with_tokens * mask.shape[-1]))
    close(ours * rows_with_tokens, verl_agg_loss(clean, mask, mode))


# ---------------------------------------------------------------- policy losses: values and gradients
def ours_and_verl(name, lp, old, adv, mask):
    """``(ours, verl's)`` per-token loss of policy loss ``name`` with its usual settings."""
    if name == "vanilla":
        args = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
        return (get_policy_loss(name).fn(lp, old, adv, mask, **args)[0], verl_vanilla(lp, old, adv, 0.2, 0.28, 3.0))
    if name == "cispo":
        return (
            get_policy_loss(name).fn(lp, old, adv, mask, clip_low=0.9, clip_high=4.0)[0],
            verl_cispo(lp, old, adv, 0.9, 4.0),
        )
    if name == "sapo":
        return (
            get_policy_loss(name).fn(lp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)[0],
            verl_sapo(lp, old, adv, 1.0, 1.05),
        )
    return (
        get_policy_loss(name).fn(lp, old, adv, mask, clip_low=3e-4, clip_high=4e-4)[0],
        verl_gspo(lp, old, adv, mask, 3e-4, 4e-4),
    )


# verl's gpg, clip_cov and kl_cov: tests/algorithms/test_verl_estimators_and_losses.py
@pytest.mark.parametrize("name", ["cispo", "gspo", "sapo", "vanilla"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_policy_loss_against_verl_value_and_gradient(name, seed):
    lp, old, _, adv, mask = batch(seed, spread=3e-4 if name == "gspo" else 0.3)
    if name == "gspo":  # one sequence-level advantage per row, as GRPO gives; row 4's ratio clipped
        adv = adv[:, :1] * mask
        old[4] -= 1e-3
    grads = []
    for side in (0, 1):
        x = lp.clone().requires_grad_()
        loss = aggregate_loss(ours_and_verl(name, x, old, adv, mask)[side], mask, "seq-mean-token-mean")
        loss.backward()
        grads.append((loss.detach(), x.grad))
    close(grads[0][0], grads[1][0])
    close(grads[0][1], grads[1][1])


def test_vanilla_dual_clip_binds_only_negative_advantages_with_large_ratios():
    lp, old = torch.tensor([[2.0, 2.0, 0.0, -30.0]]), torch.zeros(1, 4)
    adv, mask = torch.tensor([[-1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4)
    ours, verl = ours_and_verl("vanilla", lp, old, adv, mask)
    close(ours, verl)
    close(ours, torch.tensor([[3.0, -1.28, 1.0, 0.8]]))  # min(e^2, 3); clipped at 1.28; on policy; max(e^-20, 0.8)


def test_value_loss_against_verl():
    values, old, returns, _, mask = batch(3, spread=0.5)
    for mode in AGG_MODES[:3]:
        for clip in (0.2, 10.0):
            close(
                value_loss(values, old, returns, mask, clip, mode)[0],
                verl_value_loss(values, returns, old, mask, clip, mode),
            )


# ---------------------------------------------------------------- KL estimators and entropy
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "kl", "mse", "low_var_kl"])
def test_kl_estimators_against_verl_with_their_clamps(kind):
    lp = torch.linspace(-4, 0, 41, dtype=F64)
    ref = lp + torch.linspace(-40, 40, 41, dtype=F64)  # k3's exponent clamp (+-20) and result clamp (10)
    x1, x2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    ours, theirs = kl_penalty(x1, ref, kind), verl_kl(x2, ref, kind)
    close(ours, theirs)
    ours.sum().backward()
    theirs.sum().backward()
    close(x1.grad, x2.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spread", [1e-2, 1e-3, 1e-4])
def test_k3_is_never_negative_and_accurate_for_a_policy_near_its_reference(dtype, spread):
    """k3 = exp(d) - 1 - d is about d^2 / 2: exp(d) - 1 cancelled to rounding noise for a policy near its
    reference (early in a run), and the logged KL came out negative (fp32 at 1e-4, bf16 at 1e-2)."""
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(64, 512, generator=g, dtype=F64) * 3).to(dtype)
    ref = (lp.to(F64) + spread * torch.randn(64, 512, generator=g, dtype=F64)).to(dtype)
    k3 = kl_penalty(lp, ref, "k3")
    d = ref.to(F64) - lp.to(F64)  # what the estimator is given
    exact = torch.expm1(d) - d
    assert k3.dtype == torch.promote_types(dtype, torch.float32)
    assert (k3 >= 0).all()
    assert abs(k3.to(F64).mean() / exact.mean() - 1) < 1e-3


def test_entropy_against_verl_for_bf16_logits():
    logits = (torch.randn(4, 7, 50, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    x = logits.float()
    verl = torch.logsumexp(x, dim=-1) - (torch.softmax(x, dim=-1) * x).sum(-1)
    ours = entropy_from_logits(logits)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, verl, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- masked junk and bf16, through the actor's loss
@pytest.mark.parametrize("where", ["logprobs", "old", "advantages", "ref"])
@pytest.mark.parametrize("junk", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_junk_never_reaches_the_actor_losss_gradient(name, junk, where):
    """The unfused path (GSPO always; ``trainer.fused_loss: false``) as the fused kernels: padding holding NaN or
    inf (an estimator's 0/0 there) must not turn the logprobs' gradient into NaN."""
    lp, old, ref, adv, mask = batch(4)

    def grad(dirty):
        t = dict(logprobs=lp, old=old, advantages=adv, ref=ref)
        if dirty:
            t[where] = torch.where(mask > 0, t[where], torch.full_like(lp, junk))
        x = t["logprobs"].clone().requires_grad_()
        loss_mat, _, _ = actor_loss_per_token(
            x,
            torch.zeros_like(lp),
            t["old"],
            t["advantages"],
            mask,
            t["ref"],
            policy_loss=name,
            kl_coef=0.1,
            kl_kind="k2",
        )
        aggregate_loss(loss_mat, mask, "token-mean").backward()
        return x.grad

    close(grad(True), grad(False))


@pytest.mark.parametrize("where", ["values", "old", "returns"])
def test_masked_junk_never_reaches_the_value_losss_gradient(where):
    values, old, returns, _, mask = batch(6, spread=0.5)
    grads = []
    for junk in (None, float("nan"), float("inf")):
        t = dict(values=values, old=old, returns=returns)
        if junk is not None:
            t[where] = torch.where(mask > 0, t[where], torch.full_like(values, junk))
        x = t["values"].clone().requires_grad_()
        value_loss(x, t["old"], t["returns"], mask, 0.2, "token-mean")[0].backward()
        grads.append(x.grad)
    close(grads[1], grads[0])
    close(grads[2], grads[0])


def test_gspo_clips_bf16_inputs_as_fp32_ones():
    """GSPO's clip range (1 - 3e-4, 1 + 4e-4) is finer than bf16's step at 1 (1/128): its ratio is taken in fp32."""
    lp, old, _, adv, mask = batch(5, spread=3e-3)
    lp, old = lp.bfloat16().to(F64), old.bfloat16().to(F64)  # bf16 inputs; the reference is exact on them
    adv = adv[:, :1] * mask
    grads = []
    for dtype in (F64, torch.bfloat16):
        x = lp.to(dtype).detach().requires_grad_()
        loss_mat, _ = get_policy_loss("gspo").fn(
            x, old.to(dtype), adv.to(dtype), mask.to(dtype), clip_low=3e-4, clip_high=4e-4
        )
        aggregate_loss(loss_mat, mask.to(dtype), "seq-mean-token-mean").backward()
        grads.append(x.grad.to(F64))
    assert (grads[1] - grads[0]).norm() < 0.02 * grads[0].norm()


# ---------------------------------------------------------------- advantage estimators
def estimator(name, scores, groups, mask, **cfg):
    exp = SimpleNamespace(
        scores=scores,
        group_ids=torch.tensor(groups),
        response_mask=mask,
        values=cfg.pop("values", None),
        old_logprobs=None,
        ref_logprobs=None,
    )
    base = dict(
        kl_in_reward=False, kl_coef=0.0, kl_kind="k1", gamma=1.0, lam=1.0, whiten_advantages=True, scale_by_std=True
    )
    return ADV_ESTIMATORS[name](exp, SimpleNamespace(**{**base, **cfg}))


GROUPS = [0, 0, 0, 1, 1, 1, 1, 2]


@pytest.mark.parametrize(
    "name, how, cfg", [("grpo", "grpo", {}), ("grpo", "grpo-no-std", {"scale_by_std": False}), ("rloo", "rloo", {})]
)
def test_group_estimators_against_verl(name, how, cfg):
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(8, generator=g, dtype=F64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 5, 0, 2, 4, 5])[:, None]).to(F64)
    ours, _ = estimator(name, scores, GROUPS, mask, **cfg)
    theirs = verl_group_scores(scores, GROUPS, how)[:, None] * mask
    # Group 2 has one completion: verl gives it its raw score (no baseline), fastrlhf 0 (nothing to compare with).
    close(ours[:7], theirs[:7])
    assert (ours[7] == 0).all() and (theirs[7] != 0).all()


def test_reinforce_pp_and_its_baseline_against_verl():
    g = torch.Generator().manual_seed(8)
    scores = torch.randn(8, generator=g, dtype=F64)
    mask = (torch.arange(6)[None] < torch.tensor([6, 3, 1, 6, 2, 2, 4, 5])[:, None]).to(F64)
    rewards = torch.zeros(8, 6, dtype=F64).scatter_(1, mask.sum(-1, keepdim=True).long() - 1, scores[:, None])
    ours, _ = estimator("reinforce_plus_plus", scores, GROUPS, mask, gamma=0.9)
    close(ours, verl_reinforce_pp(rewards, mask, 0.9))
    # verl's baseline variant puts the centred score on every token (no discount): fastrlhf's with gamma 1.
    ours, _ = estimator("reinforce_plus_plus_baseline", scores, GROUPS[:7] + [1], mask)
    centred = verl_group_scores(scores, GROUPS[:7] + [1], "baseline")[:, None] * mask
    close(ours, verl_masked_whiten(centred, mask) * mask)


def test_gae_against_verl():
    g = torch.Generator().manual_seed(9)
    mask = (torch.arange(7)[None] < torch.tensor([7, 4, 1, 6])[:, None]).to(F64)
    values = torch.randn(4, 7, generator=g, dtype=F64) * mask
    scores = torch.randn(4, generator=g, dtype=F64)
    rewards = torch.zeros(4, 7, dtype=F64).scatter_(1, mask.sum(-1, keepdim=True).long() - 1, scores[:, None])
    ours_adv, ours_returns = estimator("gae", scores, [0, 1, 2, 3], mask, values=values, gamma=0.99, lam=0.95)
    adv, returns = verl_gae(rewards, values, mask, 0.99, 0.95)
    close(ours_adv, adv * mask)
    # The returns (the critic's targets) in the scores' own precision: fp64 scores were rounded to fp32 on the way.
    close(ours_returns * mask, returns * mask, tol=1e-12)


# ---------------------------------------------------------------- importance weights against the rollout engine
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_is_weights_against_verl(level):
    g = torch.Generator().manual_seed(10)
    mask = (torch.arange(8)[None] < torch.tensor([8, 0, 3, 8])[:, None]).float()
    engine = -torch.rand(4, 8, generator=g) * 3
    old = engine + 0.3 * torch.randn(4, 8, generator=g)
    old[3] += 5.0  # a summed log-ratio of 40: verl's +-20 clamp before exp
    ours, _ = rollout_is_weights(old, engine, mask, 2.0, level=level)
    close(ours, verl_is_weights(old - engine, mask, level, 2.0), tol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_is_weights_against_trl(level):
    g = torch.Generator().manual_seed(11)
    mask = (torch.arange(8)[None] < torch.tensor([8, 2, 3, 8])[:, None]).float()
    engine = -torch.rand(4, 8, generator=g) * 3
    old = engine + 0.4 * torch.randn(4, 8, generator=g)
    ours, _ = rollout_is_weights(old, engine, mask, 2.0, level=level, mode="mask", floor=0.5)
    theirs = trl_mask_is_weights(old - engine, mask, level == "sequence", 0.5, 2.0).expand_as(mask) * mask
    close(ours, theirs, tol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_kernels_k3_is_accurate_for_a_policy_near_its_reference(backend):
    """The token-loss kernel's k3 (the fused loss's KL term and ``kl`` metric on a GPU) computed exp(x) - 1 - x,
    which cancels to noise near x = 0: negative KL sums for log-ratios ~1e-4 in fp32. Now its series there, as the
    reference's expm1(x) - x; its gradient is unchanged (1 - exp(x))."""
    from fastrlhf.kernels.policy_loss import token_loss_function

    g = torch.Generator().manual_seed(0)
    n = 4096
    lp = -torch.rand(n, generator=g) * 3
    for spread in (1e-4, 1e-3, 3e-2, 0.3):
        ref = lp + spread * torch.randn(n, generator=g)
        x = (ref.double() - lp.double())  # k3's argument: log(ref / policy)
        truth = (torch.expm1(x) - x).sum()
        fn = token_loss_function(backend, "vanilla")
        _, g_lp, _, sums = fn(lp, torch.zeros(n), None, torch.zeros(n), torch.ones(n), ref, kl_coef=1.0, kl_kind="k3")
        assert sums["kl"] > 0 and abs(float(sums["kl"]) - float(truth)) <= 1e-3 * float(truth), (spread, sums["kl"])
        torch.testing.assert_close(g_lp.double(), -torch.expm1(x), atol=1e-6, rtol=1e-5)
