"""PPO pieces: KL-shaped token rewards + GAE advantages, and the critic's clipped value loss."""

from __future__ import annotations

import torch

from fastrlhf.algorithms import compute_gae, masked_whiten, shape_rewards, value_loss
from fastrlhf.rl.experience import Experience
from fastrlhf.rl.forward import token_values
from fastrlhf.rl.hparams import RLHParams

__all__ = ["compute_ppo_advantages", "critic_loss"]


def compute_ppo_advantages(exp: Experience, hp: RLHParams) -> None:
    """Fill ``exp.advantages`` / ``exp.returns`` from scores, old/ref logprobs and old values.

    With ``kl_in_reward`` the per-token reward is ``-kl_coef * KL(old || ref)`` plus the score at the
    last token (the loss then carries no KL term); otherwise only the score. Advantages are whitened
    over this rank's tokens when ``whiten_advantages``; returns are not.
    """
    mask = exp.response_mask
    if hp.kl_in_reward and hp.kl_coef != 0.0:
        token_rewards = shape_rewards(exp.scores, exp.old_logprobs, exp.ref_logprobs, mask, hp.kl_coef, hp.kl_kind)
    else:
        zeros = torch.zeros_like(exp.old_logprobs)
        token_rewards = shape_rewards(exp.scores, zeros, zeros, mask, 0.0, "k1")
    advantages, returns = compute_gae(token_rewards, exp.values, mask, hp.gamma, hp.lam)
    if hp.whiten_advantages and int((mask > 0).sum()) > 1:
        advantages = masked_whiten(advantages, mask)
    exp.advantages, exp.returns = advantages.detach(), returns.detach()
    exp.meta["token_rewards"] = token_rewards


def critic_loss(critic, mb: Experience, hp: RLHParams):
    """``vf_coef`` * clipped value loss of a micro-batch; returns ``(loss, metrics)``."""
    values = token_values(critic, mb, grad=True)
    loss, metrics = value_loss(values, mb.values, mb.returns, mb.response_mask, hp.vf_clip, hp.agg)
    metrics["value_loss"] = loss.detach()
    return hp.vf_coef * loss, metrics
