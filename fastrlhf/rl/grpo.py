"""GRPO pieces: group-relative advantages broadcast over each completion's tokens (no critic)."""

from __future__ import annotations

from fastrlhf.algorithms import compute_grpo_advantages
from fastrlhf.rl.experience import Experience
from fastrlhf.rl.hparams import RLHParams

__all__ = ["compute_grpo_token_advantages"]


def compute_grpo_token_advantages(exp: Experience, hp: RLHParams) -> None:
    """``exp.advantages[b, t] = A_b`` on completion tokens (0 elsewhere); ``scale_by_std=False`` is Dr.GRPO.

    Groups are the rows sampled from one prompt; they never straddle ranks (each rank samples all
    ``n`` completions of its own prompts), so this needs no communication.
    """
    per_sequence = compute_grpo_advantages(exp.scores, exp.group_ids, scale_by_std=hp.scale_by_std)
    exp.advantages = (per_sequence[:, None] * exp.response_mask).detach()
    exp.returns = None
