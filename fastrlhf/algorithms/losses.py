"""The losses: aggregation of per-token terms (``trainer.agg``), the policy losses by name
(``@register_policy_loss``: vanilla clipped surrogate with clip-higher and dual clip, CISPO, GSPO, SAPO), the
actor's whole per-token loss (policy term + KL - entropy bonus), the clipped value loss, the importance
weights against the rollout engine, and the SFT and reward-model losses.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastrlhf.algorithms.logprobs import LOG_RATIO_CLAMP, kl_penalty
from fastrlhf.algorithms.masked import _keep, check_same_shape, masked_mean, masked_sum, zero_masked

__all__ = [
    "AGG_MODES", "POLICY_LOSSES", "PolicyLoss", "actor_loss_per_token", "aggregate_loss",
    "aggregation_count", "aggregation_weights", "bradley_terry_loss", "cispo_policy_loss", "clipped_surrogate",
    "get_policy_loss",
    "gspo_policy_loss", "loss_weights", "nll_loss", "policy_loss", "policy_loss_options", "register_policy_loss",
    "rollout_is_weights", "sapo_policy_loss",
    "TIS_LEVELS", "TIS_MODES", "value_loss", "vanilla_policy_loss"
]


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")




def aggregation_count(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What ``mode`` divides by (0-dim fp32, on mask's device): the kept tokens (``token-mean``), or the sequences
    with a kept token (the ``seq-mean-*`` modes; fully masked rows are left out of the mean over sequences)."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    keep = _keep(mask).float()
    if mode == "token-mean":
        return keep.sum()
    if mask.dim() != 2:
        raise ValueError(f"aggregation mode {mode!r} needs [B, T] tensors, got shape {tuple(mask.shape)}")
    return (keep.sum(-1) > 0).sum().float()


def aggregation_weights(mask: torch.Tensor, mode: str, count: torch.Tensor | None = None,
                        length: int | None = None) -> torch.Tensor:
    """Per-token weights ``w`` with ``aggregate_loss(x, mask, mode) == sum(w * x)`` over kept tokens.

    Every mode is linear in the per-token loss; writing it as weights lets a chunked kernel
    know each token's gradient as soon as that token's loss is known. ``count``: the denominator to use instead
    of :func:`aggregation_count` of ``mask``, positive (the RL update passes every rank's sum, at least 1, over
    the ranks: their averaged gradients are then those of the whole minibatch's aggregate, however it was split).
    ``length``: ``seq-mean-token-sum-norm``'s divisor, a constant (Dr.GRPO's generation budget); None: the mask's
    width.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    keep = _keep(mask).to(mask.dtype if mask.is_floating_point() else torch.float32)
    denominator = aggregation_count(mask, mode).clamp(min=1) if count is None else count
    if mode == "token-mean":
        return keep / denominator
    tokens_per_seq = keep.sum(-1, keepdim=True)
    if mode == "seq-mean-token-mean":
        return keep / tokens_per_seq.clamp(min=1) / denominator
    weights = keep / denominator
    if mode == "seq-mean-token-sum-norm":
        weights = weights / (mask.shape[-1] if length is None else length)
    return weights


def loss_weights(mask: torch.Tensor, mode: str, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token weights a loss is aggregated with: ``aggregation_weights(mask, mode)``, or
    ``weights`` when the caller already has them (detached, of mask's shape).

    Precomputed weights are how a minibatch split into micro-batches keeps exactly its loss: the
    weights come from :func:`aggregation_weights` of the WHOLE minibatch's ``[B, T]`` mask, each
    micro-batch (padded rows, or packed tokens flattened to ``[n]``) carries its tokens' share,
    and the micro-batches' ``sum(w * loss)`` add up to the minibatch's aggregate, in every mode and
    whatever the grouping. Every function with a ``weights=`` argument (:func:`aggregate_loss`,
    :func:`policy_loss`, :func:`value_loss`, the fused kernels) resolves it here.
    """
    if weights is None:
        return aggregation_weights(mask, mode)
    check_same_shape(mask=mask, weights=weights)
    return weights.detach()


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar: ``token-mean`` over all kept tokens, or a mean over
    sequences (fully masked rows left out) of each row's token mean / token sum / token sum over T.
    ``weights``: precomputed per-token weights instead (see :func:`loss_weights`).
    """
    check_same_shape(loss_mat=loss_mat, mask=mask)
    weights = loss_weights(mask, mode, weights).to(loss_mat.dtype)
    return masked_sum(loss_mat * weights, mask)


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``max(-A*r, -A*clamp(r, 1-clip_low, 1+clip_high))`` and where the clipped
    term is the larger; with ``dual_clip`` c, tokens with A<0 are also capped at ``-A*c``.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, -advantages * dual_clip), loss_mat)
    return loss_mat, clipped > unclipped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (with clip-higher and optional dual clip); returns ``(loss, metrics)``.
    ``weights``: precomputed aggregation weights instead of ``agg`` (:func:`loss_weights`).

    ``old_logprobs=None`` is the on-policy update (the first and only optimizer step on a rollout
    batch): old = ``logprobs.detach()``, so the ratio is exactly 1 and its gradient is ``grad logprobs``.
    """
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    loss_mat, is_clipped = clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip)
    metrics = {
        "clipfrac": masked_mean(is_clipped.to(loss_mat.dtype), mask).detach(),
        "approx_kl": masked_mean(old_logprobs - logprobs, mask).detach(),
    }
    return aggregate_loss(loss_mat, mask, agg, weights), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * agg(max((v-R)^2, (old + clamp(v-old, -clip, clip) - R)^2))``; None: unclipped.
    ``weights``: precomputed aggregation weights instead of ``agg`` (:func:`loss_weights`)."""
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    # Zeros at masked positions first: a NaN or inf there would make the values' gradient NaN (0 * NaN).
    values, old_values, returns = (zero_masked(t, mask) for t in (values, old_values, returns))
    clip = math.inf if clip is None else clip
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_sq = (values - returns).square()
    clipped_sq = (clipped_values - returns).square()
    loss_mat = torch.maximum(unclipped_sq, clipped_sq)
    # Clipped: the clamp is active and its term is the larger. Where it is not active, old + (v - old)
    # rounds to v give or take an ulp, and that rounding must not count.
    is_clipped = (clipped_sq > unclipped_sq) & ((values - old_values).abs() > clip)
    metrics = {"vf_clipfrac": masked_mean(is_clipped.to(loss_mat.dtype), mask).detach()}
    return 0.5 * aggregate_loss(loss_mat, mask, agg, weights), metrics


TIS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")


def rollout_is_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, cap: float,
                       *, level: str = "token", mode: str = "truncate",
                       floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights against the rollout engine ``[B, T]`` (0 where masked) and which tokens' ratio fell
    outside the bounds (bool ``[B, T]``).

    The engine sampled from its own distribution (another precision, kernels, or stale weights); the update
    treats the samples as the trainer's old policy's. Weighting each token's policy term by the ratio
    ``exp(old - engine)`` corrects the mismatch; bounding it keeps the variance bounded. ``level``: the ratio
    of each token (``token``), of each completion (``sequence``: the exponent is the completion's summed
    log-ratio) or its per-token geometric mean (``geometric``: the mean log-ratio, which does not grow with
    the length); a completion's ratio weights all its tokens. ``mode``: ``truncate`` clamps the ratio into
    ``[floor, cap]`` (TIS; TRL's ``*_truncate`` modes with ``vllm_importance_sampling_clip_min``); ``mask`` zeroes it
    where it is above ``cap`` or below ``floor`` (TRL's ``*_mask`` modes, ICEPOP with a floor).
    """
    check_same_shape(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, mask=mask)
    if level not in TIS_LEVELS or mode not in TIS_MODES:
        raise ValueError(f"level must be one of {TIS_LEVELS} and mode one of {TIS_MODES}, got {level!r}, {mode!r}")
    keep = _keep(mask)
    log_r = torch.where(keep, old_logprobs.float() - engine_logprobs.float(), 0.0)
    if level != "token":
        log_r = log_r.sum(-1, keepdim=True)
        if level == "geometric":
            log_r = log_r / keep.sum(-1, keepdim=True).clamp(min=1)
    log_cap = math.log(cap)
    outside = log_r > log_cap
    if floor is not None:
        outside |= log_r < math.log(floor)
    # Clamped before exp: a sequence's summed log-ratio can reach hundreds, and exp(-20) is 0 in effect.
    log_floor = -LOG_RATIO_CLAMP if floor is None else max(math.log(floor), -LOG_RATIO_CLAMP)
    weights = torch.exp(log_r.clamp(log_floor, log_cap))
    if mode == "mask":
        weights = torch.where(outside, 0.0, weights)
    return torch.where(keep, weights, 0.0), keep & outside


PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # see vanilla_policy_loss


@dataclass(frozen=True)
class PolicyLoss:
    fn: PolicyLossFn
    token_level: bool  # True: fusable into the token-chunked kernels (a token's loss needs that token only)
    # True: each token's policy term is its advantage times a factor that no advantage moves (0 at advantage 0),
    # so weighting a token's advantage weights its term: the importance weights (trainer.tis_cap) and the entropy
    # mask (trainer.top_entropy_quantile) act on the advantages. Not so for a loss that picks tokens by their
    # advantages or has a term of its own (Clip-Cov, KL-Cov): the config checks refuse those settings with it.
    scales_with_advantage: bool = True


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, token_level: bool = True, scales_with_advantage: bool = True):
    """Decorator: make ``fn`` available as ``trainer.policy_loss: <name>`` (the flags: :class:`PolicyLoss`)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"a policy loss named {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLoss(fn, token_level, scales_with_advantage)
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


@register_policy_loss("vanilla")
def vanilla_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """PPO's clipped surrogate (clip-higher, optional dual clip), per token.

    logprobs, old_logprobs, advantages, mask: ``[B, T]`` or flat ``[n]``; returns
    ``(loss_mat, is_clipped)`` of the same shape (see :func:`clipped_surrogate`).
    """
    return clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip)


@register_policy_loss("cispo")
def cispo_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """CISPO (MiniMax-M1): ``-sg(clamp(r, 1-clip_low, 1+clip_high)) * A * logprob`` per token.

    The importance weight is clipped and detached instead of the update, so every token keeps a
    gradient (PPO's clipping zeroes it for clipped tokens). Shapes as :func:`vanilla_policy_loss`;
    ``is_clipped`` marks tokens whose weight was clipped; ``dual_clip`` is not used.
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -advantages * weight * logprobs, weight != ratio


@register_policy_loss("gspo", token_level=False)
def gspo_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=3e-4, clip_high=4e-4, dual_clip=None):
    """GSPO-token: the clipped surrogate on each sequence's length-normalised ratio.

    ``s_b = exp(mean_t(logprobs - old_logprobs))`` over row b's kept tokens; token t uses
    ``sg(s_b) * exp(logprob_t - sg(logprob_t))`` (value ``s_b``, gradient ``s_b * grad logprob_t``).
    ``[B, T]`` only (the ratio needs whole rows: not token-level, so not fused). Pair it with
    ``trainer.agg: seq-mean-token-mean`` and small clips (GSPO's paper: 3e-4 / 4e-4).
    """
    if logprobs.dim() != 2:
        raise ValueError(f"gspo needs [B, T] logprobs (whole sequences), got shape {tuple(logprobs.shape)}")
    # In fp32 at least: GSPO's clips (1 +- 4e-4) are below bf16's step at 1 (1/128), so a bf16 ratio is 1 or far off.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logprobs, old_logprobs, advantages = logprobs.to(dtype), old_logprobs.to(dtype), advantages.to(dtype)
    seq_log_ratio = masked_mean(logprobs - old_logprobs, mask, dim=-1).detach()
    log_ratio = (logprobs - logprobs.detach() + seq_log_ratio[:, None]).clamp(max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("sapo")
def sapo_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
                     tau_pos=1.0, tau_neg=1.05):
    """SAPO (Qwen, arXiv 2511.20347; TRL's ``loss_type="sapo"``): a soft gate in place of the clip,
    ``-A * 4/tau * sigmoid(tau * (r - 1))`` per token, ``tau = tau_pos`` where A > 0, else ``tau_neg``.

    Its gradient, ``-A * 4 sigmoid'(tau (r - 1)) r * grad logprob``, is vanilla's ``-A grad logprob`` at
    r = 1 and fades smoothly as the ratio leaves 1, faster for negative advantages (``tau_neg > tau_pos``,
    the paper's choice). The clips are not used: no token is clipped (``is_clipped`` all False).
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos} and {tau_neg}")
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    tau = torch.where(advantages > 0, float(tau_pos), float(tau_neg))
    return -advantages * torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau, torch.zeros_like(ratio, dtype=torch.bool)


# What every registered policy loss takes besides its own options (trainer.policy_loss_args).
_SHARED_LOSS_ARGS = ("clip_low", "clip_high", "dual_clip")


def policy_loss_options(name: str) -> dict[str, object]:
    """The options of a registered policy loss (``trainer.policy_loss_args``): its keyword-only arguments
    beyond the clips, with their defaults."""
    params = inspect.signature(get_policy_loss(name).fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name not in _SHARED_LOSS_ARGS}


def actor_loss_per_token(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    *,
    policy_loss: str = "vanilla",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    policy_loss_args: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The actor's per-token loss: ``policy term + kl_coef * KL(policy || ref) - entropy_coef * entropy``.
    ``policy_loss_args``: the policy loss's own options (:func:`policy_loss_options`).

    All tensors ``[B, T]`` (or flat ``[n]`` for token-level losses). Returns ``(loss_mat,
    is_clipped, kl)``, ``kl`` None without ``ref_logprobs``; aggregate ``loss_mat`` with
    :func:`aggregate_loss` (or its :func:`aggregation_weights`, as the fused kernels do).
    """
    # Zeros at masked positions first, as the fused kernels do: a NaN or inf there (an estimator's 0/0 on padding)
    # would turn a zero upstream gradient into NaN on its way back through the loss.
    logprobs, old_logprobs, advantages = (zero_masked(t, mask) for t in (logprobs, old_logprobs, advantages))
    if ref_logprobs is not None:
        ref_logprobs = zero_masked(ref_logprobs, mask)
    loss_mat, is_clipped = get_policy_loss(policy_loss).fn(logprobs, old_logprobs, advantages, mask,
                                                           clip_low=clip_low, clip_high=clip_high,
                                                           dual_clip=dual_clip, **(policy_loss_args or {}))
    kl = kl_penalty(logprobs, ref_logprobs, kl_kind, mask) if ref_logprobs is not None else None
    if kl_coef != 0.0:
        if kl is None:
            raise ValueError(f"kl_coef is {kl_coef} but ref_logprobs is None; pass ref_logprobs or set kl_coef=0")
        loss_mat = loss_mat + kl_coef * kl
    if entropy_coef != 0.0:
        loss_mat = loss_mat - entropy_coef * entropy
    return loss_mat, is_clipped, kl


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SFT: mean negative log-likelihood of the kept tokens (``[B, T]`` logprobs and mask); 0 if none."""
    return -masked_mean(logprobs, mask)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Pairwise reward-model loss ``mean(-logsigmoid(r_chosen - r_rejected))`` over ``[B]`` rewards."""
    check_same_shape(chosen=chosen, rejected=rejected)
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()
