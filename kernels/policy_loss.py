"""Fused PPO/GRPO policy loss from logits: logprob, entropy, ratio, clipping, KL in one pass.

The loss is evaluated on per-token vectors by :func:`policy_loss_from_token_stats`, through
``fastrlhf.algorithms`` with autograd, which yields the loss together with its gradient in each
token's logprob and entropy; the per-token math therefore has one home. On the Triton backend the
vanilla, CISPO and SAPO losses run the same math as one kernel (``policy_loss_triton.py``, tested against that
reference; :func:`token_loss_function` picks). Around it, no [N, V] tensor is created besides the
gradient:

* Triton backend: forward runs the per-row statistics kernel of ``logprob_entropy_triton.py``; backward
  is one pass of its dlogits kernel, with the per-token gradients scaled by ``grad_output``.
* torch backend (CPU): a row chunk's softmax is still in cache when its tokens' gradients become
  known, so forward writes that chunk's dlogits at once (the logits are read once, nothing is
  recomputed) and backward only scales the finished gradient.

Off the CPU nothing reads a tensor value into Python (labels are checked by a device-side assert,
``grad_output`` is applied unconditionally), so neither pass waits for the device.
"""

from __future__ import annotations

import torch

from fastrlhf.algorithms import actor_loss_per_token, check_same_shape, get_policy_loss, loss_weights, masked_sum

from ._backend import on_cpu, resolve_backend
from ._checks import check_token_inputs
from .fused_linear_chunks import scale_and_cast
from .logprob_entropy import (
    _check_labels_in_range,
    _check_temperature,
    _chunk_rows,
    _row_chunks,
    blockwise_grad,
    blockwise_stats,
    logprob_entropy_grad,
    logprob_entropy_stats,
    row_blocks,
)

__all__ = [
    "FusedPolicyLossFunction",
    "METRIC_SUM_KEYS",
    "finalize_metrics",
    "fused_policy_loss",
    "policy_loss_from_token_stats",
    "token_loss_function",
]

# Keys of the per-chunk metric sums; "count" is the number of kept tokens.
METRIC_SUM_KEYS = ("clipped", "approx_kl", "entropy", "kl", "count")


def policy_loss_from_token_stats(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    policy_loss: str = "vanilla",
    policy_loss_args: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of a chunk of tokens and its gradient in each token's logprob and entropy.

    All per-token inputs are 1-D ``[n]``; ``weights`` are the flattened aggregation weights
    (``fastrlhf.algorithms.aggregation_weights``), 0 where a token is masked. Returns
    ``(loss, grad_logprobs, grad_entropy, metric_sums)`` with

        loss = sum(weights * actor_loss_per_token(...))     (fastrlhf.algorithms: policy term + KL - entropy)

    (fp32 scalar, detached) and fp32 ``[n]`` gradients that are exactly 0 at masked tokens whatever
    their inputs hold (-inf, NaN). ``old_logprobs=None`` is the on-policy update: old = the
    logprobs themselves, detached (ratio 1), as ``fastrlhf.algorithms.policy_loss`` does. A token
    is kept where ``weights > 0``: every aggregation mode gives each unmasked token a positive weight.
    ``metric_sums`` holds SUMS over kept tokens (keys :data:`METRIC_SUM_KEYS`), so chunked callers
    can add them up and call :func:`finalize_metrics` once. The "kl" sum is 0 when ``ref_logprobs`` is None.
    """
    check_token_inputs(logprobs, entropy, old_logprobs, advantages, weights, ref_logprobs, kl_coef)
    if not get_policy_loss(policy_loss).token_level:
        raise ValueError(f"policy loss {policy_loss!r} needs whole sequences; the token-chunked kernel cannot fuse it")

    weights = weights.detach().float()
    keep = weights > 0
    zero = torch.zeros((), dtype=torch.float32, device=weights.device)

    # Replace masked entries by 0 BEFORE any math: a NaN or -inf there would otherwise turn a zero
    # upstream gradient into NaN on its way back through exp().
    def kept(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t.detach().float(), zero)

    lp = kept(logprobs).requires_grad_()
    ent = kept(entropy).requires_grad_()
    old = kept(old_logprobs) if old_logprobs is not None else lp.detach()
    adv = kept(advantages)
    ref = kept(ref_logprobs) if ref_logprobs is not None else None

    with torch.enable_grad():
        loss_mat, is_clipped, kl = actor_loss_per_token(lp, ent, old, adv, keep, ref, policy_loss=policy_loss,
                                                        clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                                                        kl_coef=kl_coef, kl_kind=kl_kind, entropy_coef=entropy_coef,
                                                        policy_loss_args=policy_loss_args)
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


def token_loss_function(backend: str, policy_loss: str):
    """The per-token loss of a chunk for ``backend``: on Triton, for the policy losses it covers (vanilla, CISPO,
    SAPO: ``policy_loss_triton.POLICY_LOSS_CODES``), the one-launch kernel of ``policy_loss_triton.py`` (about a
    hundred small torch kernels fewer per chunk); otherwise :func:`policy_loss_from_token_stats`, its reference.
    Both take and return the same."""
    from .policy_loss_triton import POLICY_LOSS_CODES

    if backend == "triton" and policy_loss in POLICY_LOSS_CODES:
        from .policy_loss_triton import triton_policy_loss_from_token_stats

        return triton_policy_loss_from_token_stats
    return policy_loss_from_token_stats


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


def _rows(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """``t[rows]`` of an optional per-token tensor (None: old_logprobs on-policy, ref_logprobs without KL)."""
    return None if t is None else t[rows]


def _add_sums(total: dict | None, part: dict) -> dict:
    return dict(part) if total is None else {k: total[k] + part[k] for k in total}


def _torch_loss_and_grad(logits, labels, old_logprobs, advantages, weights, ref_logprobs, loss_kwargs,
                         temperature, dlogits):
    """The CPU path for one [rows, V] block: loss and metric sums, and dlogits written into
    ``dlogits`` (unless it is None), in ONE pass over the logits.

    Each token's loss gradient is known as soon as its logprob and entropy are, so each row chunk's
    dlogits is written while its softmax is still in the two chunk buffers (``probs_out`` /
    ``pz_out`` of the shared statistics, handed to the shared gradient): no recompute in backward,
    and the logits are read once.
    """
    _check_temperature(temperature)
    n, v = logits.shape
    rows = _chunk_rows(n, v, logits.device)
    p_buf = torch.empty(min(rows, n), v, dtype=torch.float32, device=logits.device)
    pz_buf = torch.empty_like(p_buf)
    shift_buf = torch.empty(min(rows, n), dtype=torch.float32, device=logits.device)
    loss, sums = torch.zeros((), dtype=torch.float32, device=logits.device), None
    for chunk in _row_chunks(n, rows):
        k = chunk.stop - chunk.start
        p, pz, shift = p_buf[:k], pz_buf[:k], shift_buf[:k]
        lp, ent, lse = logprob_entropy_stats(logits[chunk], labels[chunk], temperature, "torch", shift_out=shift,
                                             probs_out=p, pz_out=pz, check_labels=False)
        ref = _rows(ref_logprobs, chunk)
        part_loss, g_lp, g_ent, part_sums = policy_loss_from_token_stats(
            lp, ent, _rows(old_logprobs, chunk), advantages[chunk], weights[chunk], ref, **loss_kwargs
        )
        loss = loss + part_loss
        sums = _add_sums(sums, part_sums)
        if dlogits is not None:
            logprob_entropy_grad(logits[chunk], labels[chunk], lse, ent, g_lp,
                                 g_ent if loss_kwargs["entropy_coef"] != 0.0 else None, temperature, "torch",
                                 out=dlogits[chunk], shift=shift, probs=p, pz=pz)
    if sums is None:  # no tokens at all: the sums a token would have made (a KL's too), each zero
        empty = torch.zeros(0, device=logits.device)
        sums = policy_loss_from_token_stats(*(empty,) * 5, None if ref_logprobs is None else empty, **loss_kwargs)[3]
    return loss, sums


class FusedPolicyLossFunction(torch.autograd.Function):
    """Forward computes the loss and the per-token gradients; backward is one dlogits pass.

    On the torch backend the dlogits pass runs in forward too (see :func:`_torch_loss_and_grad`)
    and backward only scales it; that gradient is handed over, not kept, so the graph can be
    backpropagated once (no ``retain_graph`` re-use).
    """

    @staticmethod
    def forward(ctx, logits, labels, old_logprobs, advantages, weights, ref_logprobs, loss_kwargs, temperature,
                backend, need_grad):
        """``loss_kwargs``: the keyword arguments of :func:`policy_loss_from_token_stats` (clips, KL, entropy,
        policy_loss name)."""
        ctx.backend = backend
        _check_labels_in_range(labels, logits.shape[-1])  # once, not per block or chunk
        blocks = row_blocks(logits, labels)
        if backend == "torch":
            ctx.dlogits = None
            if need_grad:
                ctx.dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            flat_out = ctx.dlogits.view(-1, logits.shape[-1]) if ctx.dlogits is not None else None
            loss, metric_sums = torch.zeros((), dtype=torch.float32, device=logits.device), None
            for start, block, block_labels in blocks:
                sl = slice(start, start + block.shape[0])
                part_loss, part_sums = _torch_loss_and_grad(
                    block, block_labels, _rows(old_logprobs, sl), advantages[sl], weights[sl],
                    _rows(ref_logprobs, sl), loss_kwargs, temperature,
                    flat_out[sl] if flat_out is not None else None,
                )
                loss = loss + part_loss
                metric_sums = _add_sums(metric_sums, part_sums)
        else:
            logprobs, entropy, lse = blockwise_stats(blocks, temperature, backend, check_labels=False)
            loss, grad_lp, grad_ent, metric_sums = token_loss_function(backend, loss_kwargs["policy_loss"])(
                logprobs, entropy, old_logprobs, advantages, weights, ref_logprobs, **loss_kwargs
            )
            ctx.save_for_backward(logits, labels, lse, entropy, grad_lp, grad_ent)
            ctx.temperature = temperature
            ctx.has_entropy_grad = loss_kwargs["entropy_coef"] != 0.0
        sums = tuple(metric_sums[k] for k in METRIC_SUM_KEYS)
        ctx.mark_non_differentiable(*sums)
        return (loss,) + sums

    @staticmethod
    def backward(ctx, grad_output, *_metric_grads):
        if ctx.backend == "torch":
            dlogits, ctx.dlogits = ctx.dlogits, None
            if dlogits is None:
                raise RuntimeError(
                    "fused_policy_loss (torch backend) hands its precomputed gradient to the first backward; "
                    "backpropagating through the same loss twice (retain_graph) is not supported"
                )
            # Dropping ctx's reference lets autograd adopt this tensor as logits.grad without a copy.
            # The loss is usually backpropagated with grad_output == 1, which the CPU checks for free.
            if not on_cpu(grad_output) or grad_output.item() != 1.0:
                scale_and_cast(dlogits, grad_output, dlogits.dtype)  # in place, each product rounded once
            return (dlogits,) + (None,) * 9
        logits, labels, lse, entropy, grad_lp, grad_ent = ctx.saved_tensors
        scale = grad_output.float()
        dlogits = blockwise_grad(
            logits, row_blocks(logits, labels), lse, entropy, grad_lp * scale,
            grad_ent * scale if ctx.has_entropy_grad else None, ctx.temperature, ctx.backend,
        )
        return (dlogits,) + (None,) * 9


def fused_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor | None,
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
    policy_loss: str = "vanilla",
    weights: torch.Tensor | None = None,
    policy_loss_args: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss (a registered token-level policy loss, with its options ``policy_loss_args``, + KL
    penalty - entropy bonus) straight from logits; ``(loss, metrics)``.

    Equal to ``aggregate_loss(actor_loss_per_token(lp, entropy, old_logprobs, advantages, mask,
    ref_logprobs, ...)[0], mask, agg)`` of ``fastrlhf.algorithms``, with lp and entropy those of
    softmax(logits / temperature). logits ``[N, V]`` or ``[B, T, V]`` (a strided
    slice such as ``logits[:, :-1]`` is read in place); every
    per-token tensor has labels' shape. Only ``logits`` receives a gradient (the others are data).
    Metrics ``clipfrac``, ``approx_kl``, ``entropy``, ``kl`` are detached masked means (``kl`` is 0
    without ``ref_logprobs``). ``old_logprobs=None``: on-policy (old = lp, detached). ``weights``: the
    per-token aggregation weights, precomputed, instead of ``agg`` (``fastrlhf.algorithms.loss_weights``).
    """
    backend = resolve_backend(backend, logits)
    per_token = dict(labels=labels, advantages=advantages, mask=mask)
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is not None:
            per_token[name] = t
    check_same_shape(**per_token)
    row_blocks(logits, labels)  # shape errors now, not inside autograd
    weights = loss_weights(mask, agg, weights).reshape(-1)

    def flat(t):
        return t.detach().reshape(-1) if t is not None else None

    loss_kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, kl_coef=kl_coef, kl_kind=kl_kind,
                       entropy_coef=entropy_coef, policy_loss=policy_loss, policy_loss_args=policy_loss_args)
    loss, *sums = FusedPolicyLossFunction.apply(
        logits, labels, flat(old_logprobs), flat(advantages), weights, flat(ref_logprobs), loss_kwargs,
        temperature, backend,
        # Decided here: inside forward grad mode is always off, and needs_input_grad ignores no_grad().
        torch.is_grad_enabled() and logits.requires_grad,
    )
    return loss, finalize_metrics(dict(zip(METRIC_SUM_KEYS, sums, strict=True)))
