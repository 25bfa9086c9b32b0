"""verl's estimators (grpo_passk, opo, gpg) and policy losses (gpg, clip_cov, kl_cov) under verl's names, against
verl's own code copied below (verl/trainer/ppo/core_algos.py, volcengine/verl at b178a3cd, each function cited):
values and gradients on random inputs with masked tokens, groups of different sizes and ties; the fused path;
the config checks; one RL step each."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from fastrlhf.kernels import fused_linear_policy_loss, fused_policy_loss
from helpers.model_folders import fake_train_raw
from helpers.rl_case import GRPO, PAD, PROMPTS, SCORES, FixedScorer, changed, fixed_completions, make_config, tiny_actor

from fastrlhf.algorithms import (
    ADV_ESTIMATOR_TRAITS,
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    actor_loss_per_token,
    aggregate_loss,
    aggregation_weights,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    policy_loss_options,
)
from fastrlhf.config import ConfigError, parse_config

# ---------------------------------------------------------------------------------------------------------------
# verl's code, copied from verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py; only the config
# lookups became arguments, and the loss functions return their loss matrix (before verl's agg_loss, which
# fastrlhf's aggregate_loss matches) besides the aggregated loss.
# ---------------------------------------------------------------------------------------------------------------


def verl_masked_mean(values, mask, axis=None):  # verl/utils/torch_functional.py: masked_mean (with masked_sum)
    s = (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def verl_grpo_passk(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """core_algos.py: compute_grpo_passk_outcome_advantage."""
    scores = token_level_rewards.sum(dim=-1)  # (bs,)
    advantages = torch.zeros_like(scores)
    id2scores = defaultdict(list)
    id2indices = defaultdict(list)
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            idx = index[i]
            id2scores[idx].append(scores[i])
            id2indices[idx].append(i)
        for idx in id2scores:
            rewards = torch.stack(id2scores[idx])  # (k,)
            if rewards.numel() < 2:
                raise ValueError(
                    f"Pass@k requires at least 2 samples per group. Got {rewards.numel()} for group {idx}."
                )
            topk, topk_idx = torch.topk(rewards, 2)
            r_max, r_second_max = topk[0], topk[1]
            i_max = id2indices[idx][topk_idx[0].item()]
            advantage = r_max - r_second_max
            if norm_adv_by_std_in_grpo:
                std = torch.std(rewards)
                advantage = advantage / (std + epsilon)
            advantages[i_max] = advantage
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def verl_opo(token_level_rewards, response_mask, index, epsilon=1e-6):
    """core_algos.py: compute_opo_outcome_advantage."""
    response_length = response_mask.sum(dim=-1)
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2len = defaultdict(list)
    id2bsl = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
            id2len[index[i]].append(response_length[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2bsl[idx] = torch.tensor(0.0)
            elif len(id2score[idx]) > 1:
                score_tensor = torch.stack(id2score[idx])
                len_tensor = torch.stack(id2len[idx])
                id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            scores[i] = scores[i] - id2bsl[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_gpg(token_level_rewards, response_mask, index, epsilon=1e-6, f_norm=1.0, alpha=1.0):
    """core_algos.py: compute_gpg_outcome_advantage."""
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        m = torch.count_nonzero(scores)
        alpha = bsz / m.clamp(min=1)
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            scores[i] = alpha * (scores[i] - id2mean[index[i]]) / (f_norm)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_gpg_loss(old_log_prob, log_prob, advantages, response_mask):
    """core_algos.py: compute_policy_loss_gpg (loss matrix)."""
    pg_losses = -log_prob * advantages
    return pg_losses


def verl_clip_cov_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange_low,
    cliprange_high,
    clip_cov_ratio=0.0002,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
):
    """core_algos.py: compute_policy_loss_clip_cov (loss matrix, and corr: 0 at the tokens it cut)."""
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - verl_masked_mean(advantages, response_mask)) * (
        log_prob - verl_masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return pg_losses, corr, clip_num


def verl_kl_cov_loss(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio=0.0002, ppo_kl_coef=1.0):
    """core_algos.py: compute_policy_loss_kl_cov (loss matrix)."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            pg_losses[large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]] = pg_losses_kl[
                large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            ]
    return pg_losses


# ---------------------------------------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------------------------------------

# Groups of 2, 3, 5 and 4 completions, interleaved as a batch may hold them (and a group of one for opo and gpg).
GROUPS = [0, 1, 0, 2, 1, 2, 2, 3, 1, 2, 3, 2, 3, 3]


def _rollout(seed, groups=GROUPS, T=6):
    g = torch.Generator().manual_seed(seed)
    B = len(groups)
    scores = torch.randn(B, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = 0  # a completion with no kept token
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    mask[3, 0] = 0.0  # a masked token inside a completion (a tool's reply)
    return scores, torch.tensor(groups), mask


def _exp(scores, groups, mask, scale_by_std=True):
    exp = SimpleNamespace(scores=scores, group_ids=groups, response_mask=mask)
    return exp, SimpleNamespace(scale_by_std=scale_by_std)


def _token_rewards(scores, mask):
    """verl's token_level_rewards of outcome scores: the score at the last token (what the estimators sum)."""
    rewards = torch.zeros(mask.shape)
    rewards[:, 0] = scores
    return rewards


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_passk_is_verls_with_ties(seed, scale):
    scores, groups, mask = _rollout(seed)
    scores = (scores * 2).round() / 2  # few distinct values: ties for the best and the second best
    scores[[7, 10]] = scores[[7, 10]].max() + 1  # group 3's best is a tie: its advantage is 0 whoever holds it
    adv, returns = ADV_ESTIMATORS["grpo_passk"](*_exp(scores, groups, mask, scale))
    expected, _ = verl_grpo_passk(_token_rewards(scores, mask), mask, groups.tolist(), norm_adv_by_std_in_grpo=scale)
    torch.testing.assert_close(adv, expected)
    assert returns is None and adv[[7, 10, 12, 13]].abs().sum() == 0
    per_row = adv.abs().sum(-1)
    for gid in range(4):  # at most one completion of a group learns
        assert int((per_row[groups == gid] > 0).sum()) <= 1


def test_grpo_passk_without_ties_credits_the_best_and_batch_scaling():
    scores = torch.tensor([0.2, 0.9, 0.5, 3.0, 1.0, -1.0, 2.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(7, 2)
    adv, _ = ADV_ESTIMATORS["grpo_passk"](*_exp(scores, groups, mask, False))
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 0.4, 0.0, 0.5, 0.0, 0.0, 0.0]))
    batch, _ = ADV_ESTIMATORS["grpo_passk"](*_exp(scores, groups, mask, "batch"))
    torch.testing.assert_close(batch, adv / (scores.double().std().float() + 1e-6))
    # A group of one (verl refuses it): 0, not the gap to nothing.
    lone, _ = ADV_ESTIMATORS["grpo_passk"](
        *_exp(torch.tensor([5.0, 1.0, 0.0]), torch.tensor([0, 1, 1]), torch.ones(3, 1), True)
    )
    assert lone[0].item() == 0.0 and lone[1].item() > 0 and torch.isfinite(lone).all()
    with pytest.raises(ValueError, match="at least 2 samples"):
        verl_grpo_passk(torch.tensor([[5.0], [1.0], [0.0]]), torch.ones(3, 1), [0, 1, 1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opo_is_verls_length_weighted_baseline(seed):
    scores, groups, mask = _rollout(seed, GROUPS + [4])  # and a group of one: its score, baseline 0
    adv, returns = ADV_ESTIMATORS["opo"](*_exp(scores, groups, mask))
    expected, _ = verl_opo(_token_rewards(scores, mask), mask, groups.tolist())
    torch.testing.assert_close(adv, expected)
    assert returns is None
    # A group whose completions are all empty: verl's 0 / 0; here nothing (it has no token to train anyway).
    empty, _ = ADV_ESTIMATORS["opo"](*_exp(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), torch.zeros(2, 3)))
    assert torch.equal(empty, torch.zeros(2, 3))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_is_verls_scaled_group_centred_score(seed):
    scores, groups, mask = _rollout(seed, GROUPS + [4])
    scores[[1, 4, 9]] = 0.0  # alpha = B / (non-zero scores) = 15 / 12
    adv, returns = ADV_ESTIMATORS["gpg"](*_exp(scores, groups, mask))
    expected, _ = verl_gpg(_token_rewards(scores, mask), mask, groups.tolist())
    torch.testing.assert_close(adv, expected)
    assert returns is None
    zeros, _ = ADV_ESTIMATORS["gpg"](*_exp(torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2)))
    assert torch.equal(zeros, torch.zeros(4, 2))  # no non-zero score: alpha = 4 / 1, times 0


def test_gpg_scale_counts_every_ranks_completions(monkeypatch):
    # verl computes alpha on the whole batch; each rank here holds its share of whole groups, so alpha's counts
    # are summed over the ranks (one all-reduce). Two ranks, simulated: rank 0 sees rank 1's counts added.
    from fastrlhf.algorithms import verl_estimators

    scores, groups, mask = _rollout(4, GROUPS + [4, 4, 5, 5])
    scores[[1, 4, 9, 15]] = 0.0
    mine = groups <= 2  # rank 0's groups; rank 1 holds groups 3, 4 and 5
    theirs = torch.tensor([float((~mine).sum()), float((scores[~mine] != 0).sum())], dtype=torch.float64)
    monkeypatch.setattr(verl_estimators.comm, "all_reduce_", lambda t: t.add_(theirs))
    adv, _ = ADV_ESTIMATORS["gpg"](*_exp(scores[mine], groups[mine], mask[mine]))
    expected, _ = verl_gpg(_token_rewards(scores, mask), mask, groups.tolist())
    torch.testing.assert_close(adv, expected[mine])


def test_traits_group_estimators_need_rollout_n_of_two():
    for name in ("grpo_passk", "opo", "gpg"):
        traits = ADV_ESTIMATOR_TRAITS[name]
        assert traits.needs_groups and traits.gives_returns is False
        assert not traits.needs_values and not traits.takes_kl_in_reward


# ---------------------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------------------


def _batch(seed, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g) * 2
    mask = torch.ones(B, T)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    mask[3, 2] = 0  # masked inside a row
    return lp, old, adv, mask


def _grad(fn, lp, mask, agg="token-mean"):
    x = lp.clone().requires_grad_()
    loss = aggregate_loss(fn(x), mask, agg)
    loss.backward()
    return loss.detach(), x.grad


def _ours(name, old, adv, mask, **options):
    return lambda x: actor_loss_per_token(
        x,
        torch.zeros_like(x),
        old,
        adv,
        mask,
        policy_loss=name,
        clip_low=0.2,
        clip_high=0.28,
        policy_loss_args=options or None,
    )[0]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gpg_loss_is_minus_a_logprob_with_no_ratio(agg):
    lp, old, adv, mask = _batch(0)
    ours = _grad(_ours("gpg", old, adv, mask), lp, mask, agg)
    verl = _grad(lambda x: verl_gpg_loss(old, x, adv, mask), lp, mask, agg)
    torch.testing.assert_close(ours, verl)
    torch.testing.assert_close(ours[1], -adv * mask * aggregation_weights(mask, agg))  # whatever old is
    assert POLICY_LOSSES["gpg"].token_level and policy_loss_options("gpg") == {}


@pytest.mark.parametrize("ratio", [2e-4, 0.1, 0.3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_cov_is_verls(seed, ratio):
    lp, old, adv, mask = _batch(seed)
    ours = _grad(_ours("kl_cov", old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=0.7), lp, mask)
    verl = _grad(lambda x: verl_kl_cov_loss(old, x, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=0.7), lp, mask)
    torch.testing.assert_close(ours, verl)
    _, penalised, _ = actor_loss_per_token(
        lp, lp, old, adv, mask, policy_loss="kl_cov", policy_loss_args={"kl_cov_ratio": ratio}
    )
    assert int(penalised.sum()) == max(1, int(mask.sum().item() * ratio)) and not penalised[mask == 0].any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_is_verls_when_every_candidate_is_cut(seed):
    # A budget above the candidates: verl's random draw takes them all, so both are exact.
    lp, old, adv, mask = _batch(seed)
    opts = dict(clip_cov_ratio=0.9, clip_cov_lb=0.05, clip_cov_ub=3.0)
    ours = _grad(_ours("clip_cov", old, adv, mask, **opts), lp, mask, "seq-mean-token-mean")
    verl_mat, corr, clip_num = verl_clip_cov_loss(old, lp.clone(), adv, mask, 0.2, 0.28, **opts)
    assert 0 < int((corr == 0).sum()) < clip_num  # some cut, and not capped by the budget
    verl = _grad(lambda x: verl_clip_cov_loss(old, x, adv, mask, 0.2, 0.28, **opts)[0], lp, mask, "seq-mean-token-mean")
    torch.testing.assert_close(ours, verl)
    _, cut, _ = actor_loss_per_token(
        lp, lp, old, adv, mask, policy_loss="clip_cov", clip_low=0.2, clip_high=0.28, policy_loss_args=opts
    )
    assert torch.equal(cut, corr == 0)  # is_clipped: verl's pg_clipfrac of this loss


def test_clip_cov_cuts_a_uniform_random_budget_of_its_candidates_the_same_at_every_call():
    # verl draws with the global RNG; here the draw is a hash of the rollout's data (old logprobs, advantages):
    # new with every rollout, the same at every call on one. Each "rollout" below moves the old logprobs by 1e-6.
    lp, old, adv, mask = _batch(5, B=6, T=20)
    opts = dict(clip_cov_ratio=0.05, clip_cov_lb=0.05, clip_cov_ub=3.0)
    budget = max(int(0.05 * mask.sum().item()), 1)
    hits, draws = torch.zeros_like(lp), 300
    for draw in range(draws):
        old_d = old + 1e-6 * draw
        _, corr, _ = verl_clip_cov_loss(
            old_d, lp.clone(), adv, mask, 0.2, 0.28, clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=3.0
        )
        candidates = corr == 0  # all of verl's candidates (its budget here is every token)
        assert int(candidates.sum()) > 4 * budget
        full = torch.maximum(-adv * torch.exp(lp - old_d), -adv * torch.exp(lp - old_d).clamp(0.8, 1.28))
        x = lp.clone().requires_grad_()
        loss_mat, cut, _ = actor_loss_per_token(
            x,
            torch.zeros_like(x),
            old_d,
            adv,
            mask,
            policy_loss="clip_cov",
            clip_low=0.2,
            clip_high=0.28,
            policy_loss_args=opts,
        )
        assert int(cut.sum()) == budget and not (cut & ~candidates).any()
        # verl's loss matrix with this draw's corr: max(l1, l2) * corr, gradient 0 at the cut tokens.
        torch.testing.assert_close(loss_mat, torch.where(mask > 0, full * (~cut), 0.0))
        loss_mat.sum().backward()
        assert (x.grad[cut] == 0).all() and (x.grad[candidates & ~cut] != 0).all()
        again = actor_loss_per_token(
            lp, lp, old_d, adv, mask, policy_loss="clip_cov", clip_low=0.2, clip_high=0.28, policy_loss_args=opts
        )[1]
        assert torch.equal(again, cut)
        hits += cut
    # Every candidate is drawn, about equally often (a uniform subset, not a fixed or a biased one).
    counts = hits[candidates]
    expected = draws * budget / int(candidates.sum())
    assert counts.min() > 0.5 * expected and counts.max() < 1.5 * expected, (counts, expected)


def test_cov_losses_pick_over_the_whole_micro_batch_so_they_are_not_token_level():
    # Picked over all the tokens of a call: the loss of two halves is not the halves' losses. The token-chunked
    # fused kernel evaluates a token-level loss chunk by chunk, so these two must stay out of it.
    lp, old, adv, mask = _batch(1, B=6, T=10)
    assert not POLICY_LOSSES["clip_cov"].token_level and not POLICY_LOSSES["kl_cov"].token_level
    args = dict(kl_cov_ratio=0.05)
    whole = actor_loss_per_token(lp, lp, old, adv, mask, policy_loss="kl_cov", policy_loss_args=args)[0]
    halves = torch.cat(
        [
            actor_loss_per_token(lp[s], lp[s], old[s], adv[s], mask[s], policy_loss="kl_cov", policy_loss_args=args)[0]
            for s in (slice(0, 3), slice(3, 6))
        ]
    )
    assert not torch.allclose(whole, halves)
    with pytest.raises(ValueError, match="'clip_cov' needs whole sequences"):
        fused_policy_loss(
            torch.randn(4, 9),
            torch.zeros(4, dtype=torch.long),
            None,
            torch.ones(4),
            torch.ones(4),
            policy_loss="clip_cov",
            backend="torch",
        )


def test_cov_losses_refuse_options_they_cannot_mean():
    one = torch.ones(1, 1)
    for name, options, message in [
        ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio must be > 0, got 0.0"),
        ("clip_cov", {"clip_cov_lb": 5.0}, "clip_cov_lb must be below clip_cov_ub"),
        ("kl_cov", {"kl_cov_ratio": -1.0}, "kl_cov_ratio must be > 0, got -1.0"),
    ]:
        with pytest.raises(ValueError, match=message):
            POLICY_LOSSES[name].fn(one, one, one, one, **options)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpg_runs_inside_the_fused_kernel(backend):
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 4, 5, 8, 41
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (B, T), generator=g)
    _, old, adv, mask = _batch(3, B, T)
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_kind="k3", entropy_coef=0.01, agg="seq-mean-token-mean")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _ = fused_linear_policy_loss(
        h, w, labels, old, adv, mask, old - 0.1, policy_loss="gpg", backend=backend, chunk_size=4, **kw
    )
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h2 @ w2.T
    lp, ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
    kl = kw["kl_coef"] * kl_penalty(lp, old - 0.1, "k3", mask)
    expected = aggregate_loss(verl_gpg_loss(old, lp, adv, mask) + kl - kw["entropy_coef"] * ent, mask, kw["agg"])
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Config and a step
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo_passk", "opo", "gpg"])
def test_config_accepts_the_estimators_with_groups_only(tmp_path, estimator):
    assert parse_config(fake_train_raw(tmp_path, adv_estimator=estimator)).trainer.adv_estimator == estimator
    with pytest.raises(ConfigError) as err:
        parse_config(fake_train_raw(tmp_path, n=1, adv_estimator=estimator))
    assert str(err.value) == (
        f"rollout.n: {estimator} compares completions within a group and needs rollout.n >= 2, got 1"
    )
    with pytest.raises(ConfigError, match=f"{estimator} gives no returns"):
        raw = fake_train_raw(tmp_path, adv_estimator=estimator)
        parse_config({**raw, "algorithm": "ppo", "critic": {"path": None}})


def test_config_accepts_the_losses_and_their_verl_options(tmp_path):
    cfg = parse_config(
        fake_train_raw(tmp_path, policy_loss="clip_cov", policy_loss_args={"clip_cov_ratio": 0.001, "clip_cov_lb": 0.5})
    )
    assert cfg.trainer.policy_loss == "clip_cov" and cfg.trainer.policy_loss_args["clip_cov_lb"] == 0.5
    assert parse_config(fake_train_raw(tmp_path, policy_loss="kl_cov", policy_loss_args={"ppo_kl_coef": 2.0})).trainer
    assert parse_config(fake_train_raw(tmp_path, policy_loss="gpg", adv_estimator="gpg")).trainer.policy_loss == "gpg"
    for trainer, key, phrase in [
        (
            {"policy_loss": "kl_cov", "policy_loss_args": {"kl_cov_ratio": 0.0}},
            "trainer.policy_loss_args",
            "kl_cov_ratio must be > 0, got 0.0",
        ),
        (
            {"policy_loss": "clip_cov", "policy_loss_args": {"kl_cov_ratio": 0.1}},
            "trainer.policy_loss_args.kl_cov_ratio",
            "is not an option of policy loss clip_cov (its options: clip_cov_lb, clip_cov_ratio, clip_cov_ub)",
        ),
        (
            {"policy_loss": "gpg", "policy_loss_args": {"x": 1.0}},
            "trainer.policy_loss_args.x",
            "is not an option of policy loss gpg (it takes none)",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_config(fake_train_raw(tmp_path, **trainer))
        assert err.value.key == key and phrase in str(err.value)


@pytest.mark.parametrize(
    "policy_loss, estimator, options, packing",
    [
        ("gpg", "gpg", None, False),
        # clip_cov with a budget above its candidates: its draw hashes the old logprobs, which each path recomputes
        # with its own rounding, so where the budget binds the paths may draw different (equally random) tokens.
        ("clip_cov", "grpo_passk", {"clip_cov_ratio": 0.9, "clip_cov_lb": 1e-4, "clip_cov_ub": 5.0}, False),
        ("kl_cov", "opo", {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0}, False),
        ("clip_cov", "gpg", {"clip_cov_ratio": 0.9, "clip_cov_lb": 1e-4, "clip_cov_ub": 5.0}, True),
    ],
)
def test_a_step_trains_the_same_fused_and_unfused(policy_loss, estimator, options, packing):
    # gpg runs inside the fused loss kernel; clip_cov and kl_cov on the fused logprob kernel's output, through
    # autograd (packed: its logprobs put back in rows). trainer.fused_loss: false (and not packed) is the same math
    # on materialised logits.
    from fastrlhf.modeling.loading import use_attention
    from fastrlhf.rl.step import RLStep

    results = []
    for fused in (True, False):
        actor, ref = tiny_actor(), tiny_actor(seed=1).eval()
        hp = make_config(
            GRPO,
            policy_loss=policy_loss,
            adv_estimator=estimator,
            fused_loss=fused,
            packing=packing and fused,
            policy_loss_args=options or {},
        )
        for model in (actor, ref):
            use_attention(model, hp.trainer.packing)
        rl = RLStep(
            hp,
            actor,
            rollout=None,
            scorer=FixedScorer(SCORES),
            reference=ref,
            actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=5e-3),
            pad_token_id=PAD,
            rollout_shares_actor=True,
        )
        results.append((rl(PROMPTS, None, step=3, completions=fixed_completions(actor, 0.8)), actor))
    (fused_metrics, fused_actor), (plain_metrics, plain_actor) = results
    assert fused_metrics["skipped"] == 0.0 and changed(tiny_actor(), fused_actor) > 1e-3
    if policy_loss != "gpg":
        assert fused_metrics["clipfrac"] > 0  # tokens were cut or penalised
    for key in ("policy_loss", "clipfrac"):
        assert math.isclose(fused_metrics[key], plain_metrics[key], rel_tol=1e-4, abs_tol=1e-6), key
    for (name, pa), (_, pb) in zip(fused_actor.named_parameters(), plain_actor.named_parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=2e-5, rtol=1e-4), name


@pytest.mark.parametrize(
    "policy_loss, options",
    [
        ("clip_cov", {"clip_cov_ratio": 0.1, "clip_cov_lb": 1e-4, "clip_cov_ub": 5.0}),
        ("kl_cov", {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0}),
        ("gpg", {}),
    ],
)
@pytest.mark.parametrize("packing", [False, True])
def test_policy_loss_from_model_is_the_same_fused_and_unfused_on_one_batch(policy_loss, options, packing):
    # One batch, its old logprobs and advantages given: the fused path (kernel logprobs, then autograd; packed or not)
    # and trainer.fused_loss: false give the same loss, picks and gradients, a binding budget included.
    from fastrlhf.modeling.loading import use_attention
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.forward import policy_loss_from_model

    actor = tiny_actor()
    exp = build_experience(PROMPTS, fixed_completions(actor, 0.8), PAD)
    g = torch.Generator().manual_seed(0)
    mask = exp.response_mask
    exp.old_logprobs = torch.where(mask > 0, -4.6 + 0.3 * torch.randn(mask.shape, generator=g), 0.0)
    exp.advantages = ADV_ESTIMATORS["grpo_passk"](*_exp(SCORES, exp.group_ids, mask, False))[0] * 3
    results = []
    for fused in (True, False):
        model = tiny_actor()
        hp = make_config(
            GRPO,
            policy_loss=policy_loss,
            fused_loss=fused,
            packing=packing and fused,
            kl_coef=0.0,
            policy_loss_args=options,
        )
        use_attention(model, hp.trainer.packing)
        loss, metrics = policy_loss_from_model(model, exp, hp)
        loss.backward()
        results.append((loss.detach(), metrics, [p.grad for p in model.parameters()]))
    (loss_f, metrics_f, grads_f), (loss_u, metrics_u, grads_u) = results
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics_f["clipfrac"], metrics_u["clipfrac"])
    if policy_loss != "gpg":
        budget = max(int(0.1 * mask.sum().item()), 1)
        assert math.isclose(float(metrics_f["clipfrac"]) * float(mask.sum()), budget, rel_tol=1e-5)
    for a, b in zip(grads_f, grads_u, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
