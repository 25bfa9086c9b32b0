"""verl's policy losses under verl's names (``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_<name>``):
GPG's plain policy gradient (``gpg``) and the covariance-guided losses of "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models" (Cui et al., arXiv 2505.22617): ``clip_cov`` and ``kl_cov``.

Clip-Cov and KL-Cov pick the tokens they treat differently by the covariance of each token's advantage and logprob
over all the tokens of the micro-batch (as verl does, per micro-batch), so a token's loss depends on the others:
they are registered with ``token_level=False`` and train on the fused logprob kernel's logprobs through autograd
(as GSPO), never inside the token-chunked kernel, whose chunks would each pick their own tokens. The picks are made
on the device (a sort, no host read), where verl reads the counts on the host.

The update applies ``trainer.tis_cap``'s importance weights and ``trainer.top_entropy_quantile``'s mask through the
advantages (``fastrlhf.rl.forward``), where verl weights each token's whole loss: the same for ``gpg``, but the
covariance picks would see the weighted advantages and KL-Cov's ``|log ratio|`` penalty would go unweighted, so
both are registered ``scales_with_advantage=False`` and the config checks refuse those settings with them.
"""

from __future__ import annotations

import torch

from fastrlhf.algorithms.logprobs import LOG_RATIO_CLAMP
from fastrlhf.algorithms.losses import register_policy_loss
from fastrlhf.algorithms.masked import _keep, masked_mean

__all__ = ["clip_cov_policy_loss", "gpg_policy_loss", "kl_cov_policy_loss", "token_covariance", "token_keys"]


@register_policy_loss("gpg")
def gpg_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """GPG (arXiv 2504.02546; verl's ``compute_policy_loss_gpg``): ``-A * logprob`` per token, no ratio and no
    clip: the policy gradient itself (its gradient ``-A grad logprob`` whatever the old policy). Token-level, so it
    runs inside the fused kernel. The clips are not used; no token is clipped."""
    return -advantages * logprobs, torch.zeros_like(logprobs, dtype=torch.bool)


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each kept token's ``(A - mean A) * (logprob - mean logprob)`` (means over the kept tokens), detached:
    its term of the covariance Cui et al. find drives the policy's entropy down."""
    lp, adv = logprobs.detach(), advantages.detach()
    return (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))


def _budget(keep: torch.Tensor, ratio: float) -> torch.Tensor:
    """verl's ``max(int(ratio * kept tokens), 1)`` as a 0-dim tensor (no host read), in fp64 as Python's float."""
    return (keep.sum().to(torch.float64) * ratio).floor().clamp(min=1)


def _first_in_order(order: torch.Tensor, budget: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Bool ``shape``: the first ``budget`` of the flat positions ``order`` lists."""
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return (rank < budget).view(shape)


_MASK31 = 0x7FFFFFFF  # the hash below keeps 31 bits: a product with a 31-bit odd constant stays within int64


def _mix(x: torch.Tensor, multiplier: int) -> torch.Tensor:
    return ((x ^ (x >> 15)) * multiplier) & _MASK31


def token_keys(old_logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """A pseudo-random key in ``[0, 1)`` per token, a hash of its old logprob's and advantage's fp32 bits and its
    place (row, column): uniform over tokens and new at every step, as a draw, but a function of the rollout's data
    alone (the same at every call on it). On the device: integer ops, no host read."""
    shape = old_logprobs.shape
    column = torch.arange(shape[-1], device=old_logprobs.device).expand(shape)
    row = torch.arange(old_logprobs.numel() // max(shape[-1], 1), device=old_logprobs.device)
    place = column + row.view(*shape[:-1], 1) * 0x10000 if len(shape) > 1 else column

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float().contiguous().view(torch.int32).to(torch.int64) & _MASK31

    x = bits(old_logprobs) ^ ((bits(advantages) * 0x27D4EB2F) & _MASK31) ^ ((place * 0x165667B1) & _MASK31)
    x = _mix(_mix(_mix(x, 0x5BD1E995), 0x27D4EB2F), 0x165667B1)
    return x.to(torch.float64) / (_MASK31 + 1)


def _check_ratio(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@register_policy_loss("clip_cov", token_level=False, scales_with_advantage=False)
def clip_cov_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    clip_cov_ratio=2e-4,
    clip_cov_lb=1.0,
    clip_cov_ub=5.0,
):
    """Clip-Cov (verl's ``compute_policy_loss_clip_cov``): PPO's clipped surrogate, with the gradient of a few
    more tokens cut: ``max(1, floor(clip_cov_ratio * kept tokens))`` of those the clip left alone whose
    :func:`token_covariance` lies in ``(clip_cov_lb, clip_cov_ub)``, drawn at random (all of them when fewer),
    get loss 0. ``is_clipped`` marks the tokens so cut (verl's ``pg_clipfrac`` of this loss); ``dual_clip`` is
    not used. Any shape; the covariance is over all of the call's kept tokens.

    The draw is :func:`token_keys`' (of the rollout's data), not the global RNG's as verl's: the same tokens
    whatever else the step draws, so the fused, unfused and packed paths, and a resumed run, cut the same ones.
    """
    _check_ratio("clip_cov_ratio", clip_cov_ratio)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb must be below clip_cov_ub, got {clip_cov_lb} and {clip_cov_ub}")
    keep = _keep(mask)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    cov = token_covariance(logprobs, advantages, mask)
    candidates = keep & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    # A random subset: the candidates of lowest key win (verl: the head of a randperm).
    keys = torch.where(candidates, token_keys(old_logprobs, advantages), 2.0)
    cut = candidates & _first_in_order(keys.flatten().argsort(), _budget(keep, clip_cov_ratio), cov.shape)
    return torch.where(cut, 0.0, torch.maximum(unclipped, clipped)), cut


@register_policy_loss("kl_cov", token_level=False, scales_with_advantage=False)
def kl_cov_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    kl_cov_ratio=2e-4,
    ppo_kl_coef=0.1,
):
    """KL-Cov (verl's ``compute_policy_loss_kl_cov``): the unclipped surrogate ``-A * r``, plus
    ``ppo_kl_coef * |logprob - old_logprob|`` on the ``max(1, floor(kl_cov_ratio * kept tokens))`` kept tokens of
    largest :func:`token_covariance`. No clip (the clips and ``dual_clip`` are not used); ``is_clipped`` marks
    the penalised tokens. Any shape; the covariance is over all of the call's kept tokens.
    """
    _check_ratio("kl_cov_ratio", kl_cov_ratio)
    keep = _keep(mask)
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    cov = torch.where(keep, token_covariance(logprobs, advantages, mask), -torch.inf)
    top = keep & _first_in_order(cov.flatten().argsort(descending=True), _budget(keep, kl_cov_ratio), cov.shape)
    penalty = torch.where(top, ppo_kl_coef * log_ratio.abs(), 0.0)
    return -advantages * torch.exp(log_ratio) + penalty, top
