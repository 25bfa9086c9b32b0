"""PPO pieces: KL-shaped token rewards + GAE advantages, and the critic's clipped value loss."""

from __future__ import annotations

import torch

from fastrlhf import comm
from fastrlhf.algorithms import compute_gae, masked_sum, shape_rewards, value_loss, whiten_with_stats
from fastrlhf.rl.experience import Experience
from fastrlhf.rl.forward import token_values
from fastrlhf.rl.hparams import RLHParams

__all__ = ["compute_ppo_advantages", "critic_loss", "whiten_across_ranks"]


def compute_ppo_advantages(exp: Experience, hp: RLHParams) -> None:
    """Fill ``exp.advantages`` / ``exp.returns`` from scores, old/ref logprobs and old values.

    With ``kl_in_reward`` the per-token reward is ``-kl_coef * KL(old || ref)`` plus the score at the
    last token (the loss then carries no KL term); otherwise only the score. Advantages are whitened
    over the whole batch, every rank's tokens together, when ``whiten_advantages``; returns are not.
    """
    mask = exp.response_mask
    if hp.kl_in_reward and hp.kl_coef != 0.0:
        token_rewards = shape_rewards(exp.scores, exp.old_logprobs, exp.ref_logprobs, mask, hp.kl_coef, hp.kl_kind)
    else:
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        token_rewards = shape_rewards(exp.scores, zeros, zeros, mask, 0.0, "k1")
    advantages, returns = compute_gae(token_rewards, exp.values, mask, hp.gamma, hp.lam)
    if hp.whiten_advantages:
        advantages = whiten_across_ranks(advantages, mask)
    exp.advantages, exp.returns = advantages.detach(), returns.detach()
    exp.meta["token_rewards"] = token_rewards


def whiten_across_ranks(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``masked_whiten`` with the mean and variance of the global batch, not of this rank's share.

    Per-rank statistics would make the update depend on how the batch was split. Two reductions
    of two numbers each (sum and count, then the sum of squared deviations from the global mean:
    the same two-pass variance as ``masked_var``), on the advantages' device; no host sync.
    Fewer than two kept tokens in the whole batch: returned unchanged (no variance to divide by).
    """
    x = advantages.detach().double()
    totals = comm.all_reduce_(torch.stack([masked_sum(x, mask), (mask > 0).sum().double()]))
    count = totals[1]
    mean = totals[0] / count.clamp(min=1)
    squares = comm.all_reduce_(masked_sum((x - mean).square(), mask).reshape(1))[0]
    var = squares / (count - 1).clamp(min=1)
    whitened = whiten_with_stats(advantages, mask, mean.to(advantages.dtype), var.to(advantages.dtype))
    return torch.where(count >= 2, whitened, advantages)


def critic_loss(critic, mb: Experience, hp: RLHParams):
    """``vf_coef`` * clipped value loss of a micro-batch; returns ``(loss, metrics)``."""
    values = token_values(critic, mb, grad=True)
    loss, metrics = value_loss(values, mb.values, mb.returns, mb.response_mask, hp.vf_clip, hp.agg)
    metrics["value_loss"] = loss.detach()
    return hp.vf_coef * loss, metrics
