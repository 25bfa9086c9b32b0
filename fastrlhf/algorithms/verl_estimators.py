"""verl's outcome estimators that compare the completions of a prompt, under verl's names: Pass@k GRPO
(``grpo_passk``: only a group's best completion learns), OPO (``opo``: a length-weighted group baseline) and GPG
(``gpg``: the group-centred score scaled by the batch's share of non-zero scores). Each is verl's
``verl/trainer/ppo/core_algos.py`` estimator of that name, vectorised over the batch: no loop over rows or groups,
no host read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastrlhf.algorithms.advantages import (
    EstimatorTraits,
    _group_centered,
    register_adv_est,
    std_across_ranks,
)
from fastrlhf.algorithms.masked import _keep
from fastrlhf.distributed import comm

__all__ = [
    "compute_gpg_advantages",
    "compute_grpo_passk_advantages",
    "compute_opo_advantages",
    "gpg_token_advantages",
    "grpo_passk_token_advantages",
    "opo_token_advantages",
]


def compute_grpo_passk_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int],
    eps: float = 1e-6,
    scale_by_std: bool | str = True,
) -> torch.Tensor:
    """Pass@k advantages ``[B]`` (arXiv 2503.19595; verl's ``compute_grpo_passk_outcome_advantage``): the best
    completion of each group gets its score minus the group's second best, every other completion 0.

    ``scale_by_std`` as :func:`~fastrlhf.algorithms.compute_grpo_advantages`: true divides by the group's unbiased
    std + eps (verl's ``norm_adv_by_std_in_grpo``), ``"batch"`` by the whole batch's, false by nothing. A tie for
    the best gives 0 (best minus second best is 0, whichever of them holds it). A group of one gets 0 (verl refuses
    it; refusing here would read the device's values on the host, and the config's ``rollout.n >= 2`` leaves none).
    """
    centered, count, inverse, zeros = _group_centered(scores, group_ids)
    s = scores.to(zeros.dtype)
    rows = torch.arange(s.shape[0], device=s.device)
    best = zeros.scatter_reduce(0, inverse, s, "amax", include_self=False)[inverse]
    # One row holds each group's best: the first of those that reach it.
    first = torch.full_like(rows, s.shape[0]).scatter_reduce(
        0, inverse, torch.where(s == best, rows, s.shape[0]), "amin", include_self=False
    )
    is_best = rows == first[inverse]
    others = torch.where(is_best, torch.finfo(s.dtype).min, s)
    second = zeros.scatter_reduce(0, inverse, others, "amax", include_self=False)[inverse]
    gap = best - second
    if scale_by_std == "batch":
        gap = gap / (std_across_ranks(scores).to(gap.dtype) + eps)
    elif scale_by_std:
        sq = zeros.index_add(0, inverse, centered.square())
        gap = gap / ((sq[inverse] / (count - 1).clamp(min=1)).sqrt() + eps)
    return torch.where(is_best & (count > 1), gap, torch.zeros_like(gap))


def compute_opo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor | Sequence[int], lengths: torch.Tensor
) -> torch.Tensor:
    """OPO advantages ``[B]`` (arXiv 2505.23585; verl's ``compute_opo_outcome_advantage``): each score minus its
    group's length-weighted mean score ``sum(len * score) / sum(len)``, the baseline of least variance for a
    policy gradient summed over tokens. ``lengths``: each completion's kept tokens. A group of one keeps its score
    (baseline 0, as verl); a group whose completions have no tokens at all, baseline 0 (nothing trains on it)."""
    _, count, inverse, zeros = _group_centered(scores, group_ids)
    wide, length = scores.to(torch.float64), lengths.to(torch.float64)
    sums = torch.zeros(wide.shape[0], dtype=torch.float64, device=wide.device)
    weighted = sums.index_add(0, inverse, length * wide)[inverse]
    total = sums.index_add(0, inverse, length)[inverse]
    baseline = torch.where(count > 1, weighted / total.clamp(min=1), 0.0)
    return (wide - baseline).to(zeros.dtype)


def compute_gpg_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """GPG advantages ``[B]`` (arXiv 2504.02546; verl's ``compute_gpg_outcome_advantage``): ``alpha`` times each
    score less its group's mean, ``alpha = B / max(M, 1)`` with ``B`` the completions of the step and ``M`` those
    whose score is not 0, every rank's together (verl computes it on the whole batch). A group of one keeps
    ``alpha`` times its score (mean 0, as verl). verl's ``f_norm`` is always 1 there, so it is not an option."""
    centered, count, _, _ = _group_centered(scores, group_ids)
    totals = comm.all_reduce_(
        torch.stack([torch.ones_like(scores, dtype=torch.float64).sum(), (scores != 0).sum().to(torch.float64)])
    )
    alpha = (totals[0] / totals[1].clamp(min=1)).to(centered.dtype)
    return alpha * torch.where(count > 1, centered, scores.to(centered.dtype))


def _on_tokens(per_sequence: torch.Tensor, exp) -> tuple[torch.Tensor, None]:
    """A completion's advantage on every one of its tokens; no critic, no returns."""
    return (per_sequence[:, None] * exp.response_mask).detach(), None


# Each reads exp.scores [B], exp.group_ids [B] and exp.response_mask [B, T]; the KL goes into the loss (kl_coef).
_GROUPS = EstimatorTraits(gives_returns=False, needs_groups=True)


@register_adv_est("grpo_passk", _GROUPS)
def grpo_passk_token_advantages(exp, cfg) -> tuple[torch.Tensor, None]:
    """verl's ``grpo_passk``: :func:`compute_grpo_passk_advantages`, scaled as ``cfg.scale_by_std`` says."""
    return _on_tokens(compute_grpo_passk_advantages(exp.scores, exp.group_ids, scale_by_std=cfg.scale_by_std), exp)


@register_adv_est("opo", _GROUPS)
def opo_token_advantages(exp, cfg) -> tuple[torch.Tensor, None]:
    """verl's ``opo``: :func:`compute_opo_advantages`, lengths counted on ``exp.response_mask``."""
    lengths = _keep(exp.response_mask).sum(-1)
    return _on_tokens(compute_opo_advantages(exp.scores, exp.group_ids, lengths), exp)


@register_adv_est("gpg", _GROUPS)
def gpg_token_advantages(exp, cfg) -> tuple[torch.Tensor, None]:
    """verl's ``gpg``: :func:`compute_gpg_advantages`. Pair it with ``trainer.policy_loss: gpg`` as verl's GPG
    recipe does."""
    return _on_tokens(compute_gpg_advantages(exp.scores, exp.group_ids), exp)
