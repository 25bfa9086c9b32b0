"""Token rewards and advantages: GAE (PPO, with a critic), group-relative scores (GRPO), leave-one-out
baselines (RLOO), discounted returns whitened over the batch (REINFORCE++, with or without a group baseline), and
the registry of estimators by name (``@register_adv_est``; ``ADV_ESTIMATOR_OF[algorithm]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from fastrlhf.algorithms.logprobs import kl_penalty
from fastrlhf.algorithms.masked import (
    _keep,
    check_same_shape,
    masked_sum,
    whiten_with_stats,
)
from fastrlhf.distributed import comm

__all__ = [
    "ADV_ESTIMATORS", "ADV_ESTIMATOR_OF", "ADV_ESTIMATOR_TRAITS", "EstimatorTraits", "adv_estimator_of",
    "compute_gae", "compute_grpo_advantages", "compute_rloo_advantages", "discounted_over_kept", "discounted_returns",
    "gae_advantages", "gae_by_recursion",
    "grpo_token_advantages", "kl_in_reward", "last_token_index", "overlong_penalty", "register_adv_est",
    "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "rloo_token_advantages", "shape_rewards",
    "std_across_ranks", "whiten_across_ranks",
]


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last mask==1 position (-1 for a row with none)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(_keep(mask), positions, torch.full_like(positions, -1)).amax(-1)


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> torch.Tensor:
    """Per-token reward ``-kl_coef * kl * mask`` with ``scores[b]`` added at row b's last token.

    A row with no mask==1 position receives no score (there is no token to credit). No host read: the score goes
    in by a scatter, not by indexing the rows that have a last token (``nonzero`` waits for the device).
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"shape mismatch: scores has shape {tuple(scores.shape)} but logprobs has shape "
                         f"{tuple(logprobs.shape)} (expected scores of shape [B])")
    kl = kl_penalty(logprobs, ref_logprobs, kind, mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(_keep(mask), -kl_coef * kl, zero)
    last = last_token_index(mask)
    credit = torch.where(last >= 0, scores.to(rewards.dtype), zero)
    return rewards.scatter_add_(1, last.clamp(min=0).unsqueeze(1), credit.unsqueeze(1))


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of ``[B]`` completion lengths: 0 up to ``max_len - buffer`` tokens, then
    falling linearly to ``-factor`` at ``max_len``. Near the cap a completion is more likely rambling than
    finished, and a ramp tells the policy so before the cap cuts it (where only ``truncated_reward`` would)."""
    over = (lengths.to(torch.float32) - (max_len - buffer)).clamp(min=0.0)
    return over * (-factor / buffer)


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; returns ``(advantages, returns)``, advantages not whitened.

    Over each row's kept (mask==1) positions ``s_1 < s_2 < ...``: ``delta_i = r(s_i) + gamma V(s_{i+1}) - V(s_i)``
    (``V(s_{m+1}) = 0``) and ``A_i = delta_i + gamma lam A_{i+1}``. mask==0 positions neither receive an advantage
    (0 there) nor break the chain (the next value and running advantage carry across them), so a multi-turn
    response with masked tool output in the middle is one trajectory. Returns are ``A + V`` everywhere.

    Computed without a step per token (a Python loop over T dispatches about 15 ops per token, most of them a
    kernel launch on a GPU: some 61,000 for 4,096-token completions): the next kept value by a reverse running
    minimum, the recursion by :func:`discounted_over_kept`. Its reference: :func:`gae_by_recursion`.
    """
    check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    keep = _keep(mask)
    B, T = values.shape
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # For each position, the first kept position after it (T: none), and the value there (0 after the last).
    kept_at = torch.where(keep, torch.arange(T, device=values.device), T)
    first_from = kept_at.flip(-1).cummin(-1).values.flip(-1)
    after = torch.cat([first_from[:, 1:], first_from.new_full((B, 1), T)], dim=-1)
    next_value = torch.cat([values, zero.expand(B, 1)], dim=-1).gather(-1, after)
    delta = torch.where(keep, token_rewards + gamma * next_value - values, zero)
    adv = discounted_over_kept(delta, keep, gamma * lam)
    return adv, adv + values


def gae_by_recursion(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                     lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference :func:`compute_gae` is tested against: the reverse recursion one position at a time, skipping
    mask==0 positions (a few kernel launches per token on a GPU: not for training)."""
    keep = _keep(mask)
    B, T = values.shape
    next_value, running = values.new_zeros(B), values.new_zeros(B)
    advantages = []
    for t in reversed(range(T)):
        gae = token_rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        running = torch.where(keep[:, t], gae, running)
        advantages.append(torch.where(keep[:, t], gae, torch.zeros_like(gae)))
    adv = torch.stack(advantages[::-1], dim=1)
    return adv, adv + values


GAE_BLOCK = 32  # positions per block of :func:`discounted_over_kept`: its one loop runs T / GAE_BLOCK times
GAE_BLOCK_ELEMENTS = 1 << 24  # at most this many weights (B x blocks x K x K) at once: 64 MiB in fp32


def discounted_over_kept(x: torch.Tensor, keep: torch.Tensor, c: float) -> torch.Tensor:
    """``A_t = sum over kept s >= t of c^(kept positions in [t, s)) x_s`` at kept ``t``, 0 elsewhere (``[B, T]``;
    ``x`` is 0 at positions not kept): the reverse recursion ``A_i = x_i + c A_{i+1}`` over each row's kept
    positions.

    In blocks of :data:`GAE_BLOCK` positions: within a block as one batched matrix product (weights ``c^k`` with
    ``k`` at most the block's length, so no power under- or overflows as ``c^-t`` would over a whole row), then
    the sum after each block by a reverse loop over the blocks (2 ops each), added with its discount.
    """
    B, T = x.shape
    K = GAE_BLOCK
    blocks = -(-T // K)
    pad = blocks * K - T
    xs = torch.nn.functional.pad(x, (0, pad)).reshape(B, blocks, K)
    kept = torch.nn.functional.pad(keep, (0, pad)).reshape(B, blocks, K).to(torch.int32)
    before = kept.cumsum(-1, dtype=torch.int32) - kept  # kept positions before each one, in its block
    total = kept.sum(-1, dtype=torch.int32)  # [B, blocks]
    # c^0 .. c^K, looked up rather than raised to a power per weight; a column of zeros for "s before t"
    powers = torch.full((K + 1,), c, dtype=x.dtype, device=x.device).pow(torch.arange(K + 1, device=x.device))
    powers = torch.cat([powers, powers.new_zeros(1)])
    earlier = torch.ones(K, K, dtype=torch.bool, device=x.device).tril(-1)  # [t, s]: s < t
    inner = []
    step = max(1, GAE_BLOCK_ELEMENTS // (B * K * K))
    for lo in range(0, blocks, step):  # the weights of a few blocks at once: memory bounded at any T
        b = before[:, lo:lo + step]
        weights = powers[(b.unsqueeze(-2) - b.unsqueeze(-1)).masked_fill_(earlier, K + 1)]
        inner.append((weights @ xs[:, lo:lo + step].unsqueeze(-1)).squeeze(-1))
    inner = torch.cat(inner, dim=1)
    head = (powers[before] * xs).sum(-1)  # each block's sum, discounted to its first kept position
    decay = powers[total]
    carry, following = [], x.new_zeros(B)  # the sum after each block, at the first kept position after it
    for i in reversed(range(blocks)):
        carry.append(following)
        following = head[:, i] + decay[:, i] * following
    carry = torch.stack(carry[::-1], dim=1)
    out = inner + powers[total.unsqueeze(-1) - before] * carry.unsqueeze(-1)
    return torch.where(kept > 0, out, 0.0).reshape(B, blocks * K)[:, :T]


def _group_centered(scores: torch.Tensor, group_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(centered, count, inverse, zeros)``: each score minus its group's mean (at least fp32), the size of each
    row's group, each row's group index, and zeros of one per row (at least one per group; the spare ones stay 0).

    No host read: ``torch.unique`` sizes its output from the device's values (a wait for the queued kernels), so
    the group index comes from a sort instead: a row's index is the count of distinct ids below its own."""
    group_ids = (group_ids if isinstance(group_ids, torch.Tensor) else torch.as_tensor(group_ids)).to(scores.device)
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"shape mismatch: scores has shape {tuple(scores.shape)} but group_ids has shape "
                         f"{tuple(group_ids.shape)} (expected both [B])")
    ordered, order = torch.sort(group_ids)
    starts = torch.ones_like(ordered, dtype=torch.long)
    starts[1:] = (ordered[1:] != ordered[:-1]).long()
    inverse = torch.empty_like(order).scatter_(0, order, starts.cumsum(0) - 1)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    # The mean in fp64: an fp32 sum of equal scores (16 x 0.7) is often an ulp off their value, and that ulp,
    # divided by a std made of ulps, became a full-size advantage for every member of a group with nothing to learn.
    wide = scores.to(torch.float64)
    sums = torch.zeros(scores.shape[0], dtype=torch.float64, device=scores.device)
    count = sums.index_add(0, inverse, torch.ones_like(wide))
    mean = sums.index_add(0, inverse, wide) / count
    zeros = torch.zeros(scores.shape[0], dtype=dtype, device=scores.device)
    return (wide - mean[inverse]).to(dtype), count[inverse].to(dtype), inverse, zeros


def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int],
    eps: float = 1e-6,
    scale_by_std: bool | str = True,
) -> torch.Tensor:
    """Group-relative advantages ``[B]``: score minus its group's mean, over (unbiased std + eps).

    ``scale_by_std=False`` is Dr.GRPO (no std division); ``"batch"`` divides by the std of every score of the
    batch, all ranks' together (TRL's ``scale_rewards="batch"``): a group whose scores differ by noise (a
    saturated learned reward) keeps small advantages instead of being scaled up to full size. A group of one
    gets 0.
    """
    centered, count, inverse, zeros = _group_centered(scores, group_ids)
    adv = centered
    if scale_by_std == "batch":
        adv = centered / (std_across_ranks(scores).to(centered.dtype) + eps)
    elif scale_by_std:
        sq = zeros.index_add(0, inverse, centered.square())
        std = (sq[inverse] / (count - 1).clamp(min=1)).sqrt()
        adv = centered / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def std_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """The unbiased std (0-dim, fp64) of ``[B]`` values, every rank's together, on their device (no host read).
    Fewer than two values in all: 0."""
    return _moments_across_ranks(values, torch.ones_like(values))[1].sqrt()


def compute_rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """RLOO advantages ``[B]``: each score minus the mean of the other scores of its group (its own left out,
    so the baseline does not depend on the sample it judges): ``n / (n - 1)`` times the score minus the group's
    mean. A group of one gets 0."""
    centered, count, _, _ = _group_centered(scores, group_ids)
    return torch.where(count > 1, centered * count / (count - 1).clamp(min=1), torch.zeros_like(centered))


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``sum_{s >= t} gamma^(s - t) r_s`` over each row's kept tokens (0 elsewhere): GAE with no values and
    ``lam = 1``, so masked positions (tool output between turns) are skipped as :func:`compute_gae` skips them."""
    return compute_gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)[0]


# fn(exp, trainer_config) -> (advantages [B, T], returns [B, T] or None); ``exp`` is the step's batch
# (``fastrlhf.rl.experience.Experience``), read for the fields each estimator names.
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


ADV_ESTIMATORS: dict[str, AdvantageFn] = {}


class EstimatorTraits(NamedTuple):
    """What the config checks and the step need to know of an estimator before it runs."""

    needs_values: bool = False  # reads the critic's values: algorithm ppo only
    # returns the critic's targets (algorithm ppo trains a critic on them); None: not said (checked at step 1)
    gives_returns: bool | None = None
    # trainer.kl_in_reward puts the KL into its token rewards; otherwise the KL (kl_coef) goes into the loss
    takes_kl_in_reward: bool = False
    needs_groups: bool = False  # compares completions of one prompt: rollout.n >= 2


ADV_ESTIMATOR_TRAITS: dict[str, EstimatorTraits] = {}


# The estimator each algorithm uses (PPO's needs the critic's values).
ADV_ESTIMATOR_OF = {"ppo": "gae", "grpo": "grpo"}


UNKNOWN_TRAITS = EstimatorTraits()  # an estimator registered without them: only the step-1 checks apply


def register_adv_est(name: str, traits: EstimatorTraits = UNKNOWN_TRAITS):
    """Decorator: register an advantage estimator under ``name``, with its :class:`EstimatorTraits`."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"an advantage estimator named {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        ADV_ESTIMATOR_TRAITS[name] = traits
        return fn

    return decorator


def adv_estimator_of(config) -> str:
    """The estimator a run config uses: ``trainer.adv_estimator``, ``auto`` resolved by the algorithm."""
    name = config.trainer.adv_estimator
    return ADV_ESTIMATOR_OF[config.algorithm] if name == "auto" else name


def kl_in_reward(config) -> bool:
    """Whether the run's KL penalty goes into token rewards (``trainer.kl_in_reward`` with an estimator that
    takes it) rather than into the loss: never both."""
    traits = ADV_ESTIMATOR_TRAITS.get(adv_estimator_of(config), UNKNOWN_TRAITS)
    return config.trainer.kl_in_reward and traits.takes_kl_in_reward


@register_adv_est("grpo", EstimatorTraits(gives_returns=False, needs_groups=True))
def grpo_token_advantages(exp, cfg) -> tuple[torch.Tensor, None]:
    """GRPO: each completion's group-relative score on every one of its tokens; no critic, no returns.

    Reads ``exp.scores [B]``, ``exp.group_ids [B]``, ``exp.response_mask [B, T]`` and
    ``cfg.scale_by_std`` (false: Dr.GRPO). Groups never straddle ranks (each rank samples all n
    completions of its prompts), so this needs no communication, but for ``scale_by_std: batch``'s std.
    """
    per_sequence = compute_grpo_advantages(exp.scores, exp.group_ids, scale_by_std=cfg.scale_by_std)
    return (per_sequence[:, None] * exp.response_mask).detach(), None


def _token_rewards(exp, cfg, scores: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: ``scores`` at each row's last token, plus ``-kl_coef * KL(old || ref)`` on every token where
    ``cfg.kl_in_reward`` puts the KL there (GAE's and REINFORCE++'s token rewards)."""
    mask = exp.response_mask
    if cfg.kl_in_reward and cfg.kl_coef != 0.0:
        return shape_rewards(scores, exp.old_logprobs, exp.ref_logprobs, mask, cfg.kl_coef, cfg.kl_kind)
    zeros = torch.zeros(mask.shape, dtype=torch.promote_types(scores.dtype, torch.float32), device=mask.device)
    return shape_rewards(scores, zeros, zeros, mask, 0.0, "k1")  # rewards in the scores' precision, fp32 at least


@register_adv_est("gae", EstimatorTraits(needs_values=True, gives_returns=True, takes_kl_in_reward=True))
def gae_advantages(exp, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: token rewards (score at the last token, ``-kl_coef * KL(old || ref)`` on every token when
    ``cfg.kl_in_reward``), then GAE over the critic's values; advantages whitened over the whole
    batch, every rank's tokens together, when ``cfg.whiten_advantages`` (returns are not).

    Reads ``exp.scores [B]``, ``exp.values``, ``exp.old_logprobs``, ``exp.ref_logprobs`` and
    ``exp.response_mask`` (``[B, T]``); ``cfg.gamma``, ``cfg.lam``, ``cfg.kl_coef``, ``cfg.kl_kind``.
    Returns ``(advantages, returns)`` ``[B, T]``.
    """
    mask = exp.response_mask
    advantages, returns = compute_gae(_token_rewards(exp, cfg, exp.scores), exp.values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = whiten_across_ranks(advantages, _trained(exp))
    return advantages.detach(), returns.detach()


def _trained(exp) -> torch.Tensor:
    """The tokens the losses train (``trainer.mask_truncated_completions`` leaves cut rows out): the whitening
    statistics' too, so that a row that trains nothing cannot move, or flip, the others' advantages."""
    return getattr(exp, "trained_mask", exp.response_mask)


@register_adv_est("rloo", EstimatorTraits(gives_returns=False, needs_groups=True))
def rloo_token_advantages(exp, cfg) -> tuple[torch.Tensor, None]:
    """RLOO: each completion's score minus the mean of the other completions of its prompt, on every one of its
    tokens; no critic, not whitened (the baseline is already unbiased). KL in the loss (``cfg.kl_coef``)."""
    per_sequence = compute_rloo_advantages(exp.scores, exp.group_ids)
    return (per_sequence[:, None] * exp.response_mask).detach(), None


def _reinforce_pp(exp, cfg, scores: torch.Tensor) -> tuple[torch.Tensor, None]:
    """REINFORCE++ on ``scores``: the score at the last token (and ``-kl_coef * KL(old || ref)`` on every token
    with ``cfg.kl_in_reward``), discounted returns (``cfg.gamma``) as advantages, whitened over the whole batch,
    every rank's tokens together (``cfg.whiten_advantages``): the batch's statistics stand in for a critic."""
    mask = exp.response_mask
    advantages = discounted_returns(_token_rewards(exp, cfg, scores), mask, cfg.gamma)
    if cfg.whiten_advantages:
        advantages = whiten_across_ranks(advantages, _trained(exp))
    return advantages.detach(), None


@register_adv_est("reinforce_plus_plus", EstimatorTraits(gives_returns=False, takes_kl_in_reward=True))
def reinforce_pp_advantages(exp, cfg) -> tuple[torch.Tensor, None]:
    """REINFORCE++ (Hu, 2025): see :func:`_reinforce_pp`; no critic, no groups needed (``rollout.n`` may be 1)."""
    return _reinforce_pp(exp, cfg, exp.scores)


@register_adv_est("reinforce_plus_plus_baseline",
                  EstimatorTraits(gives_returns=False, takes_kl_in_reward=True, needs_groups=True))
def reinforce_pp_baseline_advantages(exp, cfg) -> tuple[torch.Tensor, None]:
    """REINFORCE++ with each score less its group's mean first (OpenRLHF's ``reinforce_baseline``): the group
    removes the prompt's difficulty, the batch whitening then scales every prompt's advantages alike."""
    return _reinforce_pp(exp, cfg, compute_grpo_advantages(exp.scores, exp.group_ids, scale_by_std=False))


def whiten_across_ranks(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`masked_whiten` with the mean and variance of the global batch, not of this rank's share.

    Per-rank statistics would make the update depend on how the batch was split (statistics:
    :func:`_moments_across_ranks`, no host sync). Fewer than two kept tokens in the whole batch:
    returned unchanged (no variance to divide by).
    """
    mean, var, count = _moments_across_ranks(advantages, mask)
    whitened = whiten_with_stats(advantages, mask, mean.to(advantages.dtype), var.to(advantages.dtype))
    return torch.where(count >= 2, whitened, advantages)


def _moments_across_ranks(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, unbiased variance, count)`` (0-dim, fp64) of ``x`` where ``mask`` keeps it, every rank's values
    together: two reductions (sum and count, then the squared deviations from the global mean: the same two-pass
    variance as :func:`masked_var`), on ``x``'s device, no host read. Variance 0 below two values."""
    x = x.detach().double()
    totals = comm.all_reduce_(torch.stack([masked_sum(x, mask), (mask > 0).sum().double()]))
    count = totals[1]
    mean = totals[0] / count.clamp(min=1)
    squares = comm.all_reduce_(masked_sum((x - mean).square(), mask).reshape(1))[0]
    return mean, squares / (count - 1).clamp(min=1), count
