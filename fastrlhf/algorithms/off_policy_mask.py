"""Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, eq. 9; TRL's ``GRPOConfig.off_policy_mask_threshold``
and ``GRPOTrainer.get_off_policy_mask``): ``trainer.off_policy_mask_threshold``.

A completion that scored below its baseline (advantage < 0) and whose tokens the current policy has drifted away from
says little about the current policy, and pushing it further down destabilises training: its policy term is dropped.
The drift is the mean over the completion's tokens of ``log pi_sampler - log pi_theta``, the k1 estimate of
KL(sampler || current), with the current policy's logprobs detached (the mask carries no gradient) and the sampler's
those of the rollout engine: TRL takes vLLM's sampling logprobs, to see both the drift of the update's earlier
optimizer steps and the engine's mismatch with the trainer. As TRL: keep where ``A >= 0`` or ``mean KL <= delta``, so
a zero advantage, a tie at the threshold and a completion without trained tokens (mean 0) are kept.

The advantages are per token (``[B, T]``): a group estimator's are one value per completion, so the mask drops whole
completions; GAE's differ per token, and the mask then drops the tokens of a drifted completion whose advantage is
negative (TRL broadcasts ``advantages >= 0`` the same way over ``[B, T]`` advantages; the paper writes ``M_{i,t}``).
"""

from __future__ import annotations

import torch

from fastrlhf.algorithms.masked import check_same_shape, masked_mean

__all__ = ["off_policy_keep"]


def off_policy_keep(advantages: torch.Tensor, logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[B, T]`` fp32: 1 where a token's policy term is kept, 0 where it is dropped. ``logprobs``: the current
    policy's (detached here); ``sampling_logprobs``: the sampler's; ``mask``: the trained tokens, over which each
    row's KL is averaged (0 elsewhere, whatever the logprobs hold there)."""
    check_same_shape(advantages=advantages, logprobs=logprobs, sampling_logprobs=sampling_logprobs, mask=mask)
    kl = sampling_logprobs.float() - logprobs.detach().float()
    mean_kl = masked_mean(kl, mask, dim=-1)[:, None]
    return ((advantages >= 0) | (mean_kl <= threshold)).float()
