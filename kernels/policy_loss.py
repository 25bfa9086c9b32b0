"""Fused PPO/GRPO policy loss from logits: logprob, entropy, ratio, clipping, KL in one pass.

Forward runs the per-row statistics kernel of ``logprob_entropy.py`` once (no [N, V] tensor is
created), then :func:`policy_loss_from_token_stats` evaluates the loss on the per-token vectors
through ``fastrlhf.algorithms`` with autograd, which yields the loss together with its gradient
with respect to each token's logprob and entropy. Backward is then a single ``dlogits`` pass of
the gradient kernel, scaled by ``grad_output``. The per-token math therefore has one home
(``fastrlhf.algorithms``); this module only wires it to the vocabulary-sized kernels.
"""

from __future__ import annotations

import torch

from fastrlhf.algorithms import (
    aggregation_weights,
    check_same_shape,
    clipped_surrogate,
    kl_penalty,
    masked_sum,
)

from ._backend import resolve_backend
from .logprob_entropy import flatten_logits_labels, logprob_entropy_grad, logprob_entropy_stats

__all__ = [
    "FusedPolicyLossFunction",
    "METRIC_SUM_KEYS",
    "finalize_metrics",
    "fused_policy_loss",
    "policy_loss_from_token_stats",
]

# Keys of the per-chunk metric sums; "count" is the number of kept tokens.
METRIC_SUM_KEYS = ("clipped", "approx_kl", "entropy", "kl", "count")


def policy_loss_from_token_stats(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of a chunk of tokens and its gradient in each token's logprob and entropy.

    All per-token inputs are 1-D ``[n]``; ``weights`` are the flattened aggregation weights
    (``fastrlhf.algorithms.aggregation_weights``), 0 where a token is masked. Returns
    ``(loss, grad_logprobs, grad_entropy, metric_sums)`` with

        loss = sum(weights * (clipped_surrogate + kl_coef * kl_penalty - entropy_coef * entropy))

    (fp32 scalar, detached) and fp32 ``[n]`` gradients that are exactly 0 at masked tokens whatever
    their inputs hold (-inf, NaN). A token is kept where ``weights > 0``: every aggregation mode
    gives each unmasked token a positive weight. ``metric_sums`` holds SUMS over kept tokens
    (keys :data:`METRIC_SUM_KEYS`), so chunked callers can add them up and call
    :func:`finalize_metrics` once. The "kl" sum is 0 when ``ref_logprobs`` is None.
    """
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be 1-D [n] (a chunk of flattened tokens), got shape {tuple(logprobs.shape)}")
    tensors = dict(logprobs=logprobs, entropy=entropy, old_logprobs=old_logprobs, advantages=advantages,
                   weights=weights)
    if ref_logprobs is not None:
        tensors["ref_logprobs"] = ref_logprobs
    check_same_shape(**tensors)
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef is {kl_coef} but ref_logprobs is None; pass ref_logprobs or set kl_coef=0")

    weights = weights.detach().float()
    keep = weights > 0
    zero = torch.zeros((), dtype=torch.float32, device=weights.device)

    # Replace masked entries by 0 BEFORE any math: a NaN or -inf there would otherwise turn a zero
    # upstream gradient into NaN on its way back through exp().
    def kept(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t.detach().float(), zero)

    lp = kept(logprobs).requires_grad_()
    ent = kept(entropy).requires_grad_()
    old, adv = kept(old_logprobs), kept(advantages)
    ref = kept(ref_logprobs) if ref_logprobs is not None else None

    with torch.enable_grad():
        loss_mat, is_clipped = clipped_surrogate(lp, old, adv, clip_low, clip_high, dual_clip)
        kl = kl_penalty(lp, ref, kl_kind) if ref is not None else None
        if kl_coef != 0.0:
            loss_mat = loss_mat + kl_coef * kl
        if entropy_coef != 0.0:
            loss_mat = loss_mat - entropy_coef * ent
        loss = masked_sum(loss_mat * weights, keep)
        grad_lp, grad_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True)

    grad_lp = torch.where(keep, grad_lp, zero) if grad_lp is not None else torch.zeros_like(weights)
    grad_ent = torch.where(keep, grad_ent, zero) if grad_ent is not None else torch.zeros_like(weights)
    with torch.no_grad():
        metric_sums = {
            "clipped": masked_sum(is_clipped.float(), keep),
            "approx_kl": masked_sum(old - lp, keep),
            "entropy": masked_sum(ent, keep),
            "kl": masked_sum(kl, keep) if kl is not None else zero.clone(),
            "count": keep.sum().float(),
        }
    return loss.detach(), grad_lp, grad_ent, metric_sums


def finalize_metrics(metric_sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Masked means ``clipfrac``, ``approx_kl``, ``entropy``, ``kl`` from (summed) metric sums.

    No kept token gives 0, as ``fastrlhf.algorithms.masked_mean`` does.
    """
    missing = [k for k in METRIC_SUM_KEYS if k not in metric_sums]
    if missing:
        raise ValueError(f"metric_sums is missing {', '.join(missing)}; expected keys {', '.join(METRIC_SUM_KEYS)}")
    count = metric_sums["count"].detach().float().clamp(min=1)
    return {
        "clipfrac": (metric_sums["clipped"].detach().float() / count),
        "approx_kl": (metric_sums["approx_kl"].detach().float() / count),
        "entropy": (metric_sums["entropy"].detach().float() / count),
        "kl": (metric_sums["kl"].detach().float() / count),
    }


class FusedPolicyLossFunction(torch.autograd.Function):
    """Forward computes the loss and the per-token gradients; backward is one dlogits pass."""

    @staticmethod
    def forward(ctx, logits, labels, old_logprobs, advantages, weights, ref_logprobs, clip_low, clip_high,
                dual_clip, kl_coef, kl_kind, entropy_coef, temperature, backend):
        logprobs, entropy, lse = logprob_entropy_stats(logits, labels, temperature, backend)
        loss, grad_lp, grad_ent, metric_sums = policy_loss_from_token_stats(
            logprobs, entropy, old_logprobs, advantages, weights, ref_logprobs,
            clip_low, clip_high, dual_clip, kl_coef, kl_kind, entropy_coef,
        )
        ctx.save_for_backward(logits, labels, lse, entropy, grad_lp, grad_ent)
        ctx.temperature = temperature
        ctx.backend = backend
        ctx.has_entropy_grad = entropy_coef != 0.0
        sums = tuple(metric_sums[k] for k in METRIC_SUM_KEYS)
        ctx.mark_non_differentiable(*sums)
        return (loss,) + sums

    @staticmethod
    def backward(ctx, grad_output, *_metric_grads):
        logits, labels, lse, entropy, grad_lp, grad_ent = ctx.saved_tensors
        scale = grad_output.float()
        dlogits = logprob_entropy_grad(
            logits, labels, lse, entropy, grad_lp * scale,
            grad_ent * scale if ctx.has_entropy_grad else None,
            ctx.temperature, ctx.backend,
        )
        return (dlogits,) + (None,) * 13


def fused_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    agg: str = "token-mean",
    backend: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped policy loss (+ KL penalty, - entropy bonus) straight from logits; ``(loss, metrics)``.

    Equal to ``policy_loss(lp, old_logprobs, advantages, mask, ...)[0]
    + kl_coef * aggregate_loss(kl_penalty(lp, ref_logprobs, kl_kind), mask, agg)
    - entropy_coef * aggregate_loss(entropy, mask, agg)`` of ``fastrlhf.algorithms``, with lp and
    entropy those of softmax(logits / temperature). logits ``[N, V]`` or ``[B, T, V]``; every
    per-token tensor has labels' shape. Only ``logits`` receives a gradient (the others are data).
    Metrics ``clipfrac``, ``approx_kl``, ``entropy``, ``kl`` are detached masked means (``kl`` is 0
    without ``ref_logprobs``).
    """
    backend = resolve_backend(backend, logits)
    per_token = dict(labels=labels, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if ref_logprobs is not None:
        per_token["ref_logprobs"] = ref_logprobs
    check_same_shape(**per_token)
    flat_logits, flat_labels = flatten_logits_labels(logits, labels)
    weights = aggregation_weights(mask, agg).reshape(-1)

    def flat(t):
        return t.detach().reshape(-1) if t is not None else None

    loss, *sums = FusedPolicyLossFunction.apply(
        flat_logits, flat_labels, flat(old_logprobs), flat(advantages), weights, flat(ref_logprobs),
        clip_low, clip_high, dual_clip, kl_coef, kl_kind, entropy_coef, temperature, backend,
    )
    return loss, finalize_metrics(dict(zip(METRIC_SUM_KEYS, sums, strict=True)))
