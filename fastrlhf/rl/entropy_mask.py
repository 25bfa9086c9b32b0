"""``trainer.top_entropy_quantile``: only the high-entropy ("forking") tokens train the policy term (Wang et al.,
"Beyond the 80/20 Rule", arXiv 2506.01939; TRL's ``GRPOConfig.top_entropy_quantile``).

A token is kept when its entropy is at or above the ``1 - q`` quantile (``torch.quantile``'s linear interpolation,
as TRL's ``get_high_entropy_mask``) of the entropies of every rank's trained completion tokens (``trained_mask``:
``trainer.mask_truncated_completions`` leaves its rows out of the quantile, as TRL's masked completions are). The
entropies are the old policy's, from the step's old-logprob pass (the policy that sampled the tokens: on-policy they
are the update's own), and the threshold is taken once per step over the whole batch, so which tokens train does not
depend on how the batch is cut into minibatches and micro-batches, nor on how it is dealt over the ranks.

What it masks is TRL's: the policy term only. A dropped token's advantage is set to 0: a policy term that is 0 at
advantage 0 (PPO's, CISPO's, GSPO's, SAPO's, GPG's) then gives it no loss and no gradient, on the fused and unfused
paths alike; a loss that does not scale with its advantages (``PolicyLoss.scales_with_advantage``: KL-Cov's
``|logprob - old|`` penalty, Clip-Cov's picks by advantage) is refused by the config checks. The token stays in the
aggregation's denominator and keeps its KL term, as TRL multiplies ``per_token_loss`` by the mask before adding the
KL and divides by the completion mask. TRL also restricts its entropy bonus to the kept tokens, which the fused
kernel cannot: ``trainer.entropy_coef`` with a quantile is refused by the config checks.
"""

from __future__ import annotations

import torch

from fastrlhf.distributed import comm

__all__ = [
    "entropy_threshold",
    "high_entropy_mask",
    "keep_high_entropy_tokens",
]

# Below every entropy (>= 0): marks the slots of untrained tokens and of padding in the gathered values.
_NOT_TRAINED = float("-inf")


def entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(threshold, count)``: the ``1 - quantile`` quantile of the entropies of every rank's tokens that ``mask``
    keeps, and how many there are (0-dim, on ``entropy``'s device, equal on every rank; the threshold is +inf
    where no rank has a token).

    ``torch.quantile``'s linear interpolation, worked out on the sorted values with the count on the device (no
    host read of it, and none of ``torch.quantile``'s limit of 2**24 values): the untrained slots sort first."""
    values = torch.where(mask > 0, entropy.detach().float(), _NOT_TRAINED).reshape(-1)
    ordered = torch.sort(comm.gather_padded(values, _NOT_TRAINED)).values
    count = (ordered > _NOT_TRAINED).sum()
    first = ordered.numel() - count  # where the trained values start
    # As aten's quantile: the rank in the dtype of the values, rounded down and up, interpolated by torch.lerp; the
    # two values are taken at once with a 1-D index tensor, on the device.
    rank = (count - 1).float() * (1.0 - quantile)
    below = rank.long()
    index = (first + torch.stack([below, rank.ceil().long()])).clamp(0, max(ordered.numel() - 1, 0))
    low, high = (ordered[index] if ordered.numel() else ordered.new_zeros(2)).unbind()
    threshold = torch.lerp(low, high, rank - below.float())
    return torch.where(count > 0, threshold, float("inf")), count


def high_entropy_mask(
    entropy: torch.Tensor, mask: torch.Tensor, quantile: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bool ``[B, T]``: the tokens of ``mask`` whose entropy is at or above :func:`entropy_threshold`; and the
    metrics ``entropy_kept_fraction`` (of every rank's trained tokens) and ``entropy_threshold`` (0-dim, on the
    device, equal on every rank). A collective: call it on every rank."""
    threshold, count = entropy_threshold(entropy, mask, quantile)
    keep = (entropy.detach().float() >= threshold) & (mask > 0)
    kept = comm.all_reduce_(keep.sum().double().reshape(1))[0]
    return keep, {
        "entropy_kept_fraction": kept / count.double().clamp(min=1),
        "entropy_threshold": torch.where(count > 0, threshold, 0.0),
    }


def keep_high_entropy_tokens(exp, quantile: float) -> dict[str, torch.Tensor]:
    """Zero the advantages of ``exp``'s trained tokens below the step's entropy threshold (``exp.entropy``, the old
    policy's, which this releases); returns :func:`high_entropy_mask`'s metrics. A collective."""
    keep, metrics = high_entropy_mask(exp.entropy, exp.trained_mask, quantile)
    # A product, not a select: a NaN advantage stays NaN for the step's guard to see.
    exp.advantages = exp.advantages * keep.to(exp.advantages.dtype)
    exp.entropy = None
    return metrics
