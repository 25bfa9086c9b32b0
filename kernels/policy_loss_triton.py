"""The per-token policy loss of a chunk in one Triton kernel: PPO's clipped surrogate (clip-higher, dual clip),
the KL penalty (k1, abs, k2, k3) and the entropy bonus, with each token's gradient in its logprob and entropy
and the block's loss and metric sums.

Its reference is :func:`fastrlhf.kernels.policy_loss.policy_loss_from_token_stats` (autograd through
``fastrlhf.algorithms``, where the formulas live); this kernel does the same math, derivative by derivative,
in one launch instead of about a hundred small torch kernels per chunk, which on a GPU cost more in launches
than in arithmetic. The derivatives follow autograd's conventions where a choice exists: ``clamp`` passes the
gradient inside its bounds (inclusive), ``maximum``/``minimum`` split it in halves at a tie, ``abs`` gives 0
at 0. Covers the ``vanilla`` policy loss; other registered losses take the reference
(:func:`token_loss_function`). Built lazily (importing this module never imports triton);
``_triton_aot.py`` AOT-compiles every variant.
"""

from __future__ import annotations

import functools
import types

import torch

from fastrlhf.algorithms import KL_KINDS
from fastrlhf.algorithms.logprobs import _KL_ALIASES, K3_CLAMP, LOG_RATIO_CLAMP

from ._checks import check_token_inputs

__all__ = ["KL_KIND_CODES", "SUM_COLUMNS", "token_loss_kernels", "triton_policy_loss_from_token_stats"]

# KL kind -> the kernel's KL_KIND constexpr.
KL_KIND_CODES = {kind: code for code, kind in enumerate(KL_KINDS)}
# What each block writes, in this order: its loss, then the metric sums of policy_loss.METRIC_SUM_KEYS.
SUM_COLUMNS = ("loss", "clipped", "approx_kl", "entropy", "kl", "count")
BLOCK = 1024


@functools.cache
def token_loss_kernels():
    """Build the kernel on first use (``triton.jit`` reads TRITON_INTERPRET now); a namespace with ``loss``."""
    import triton
    import triton.language as tl

    @triton.jit
    def _token_loss_kernel(
        lp_ptr, ent_ptr, old_ptr, adv_ptr, w_ptr, ref_ptr, grad_lp_ptr, grad_ent_ptr, sums_ptr,
        n, clip_low, clip_high, dual_clip, kl_coef, entropy_coef,
        HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, KL_KIND: tl.constexpr, HAS_DUAL: tl.constexpr,
        LOG_RATIO_MAX: tl.constexpr, K3_MAX: tl.constexpr, BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        w = tl.load(w_ptr + offs, mask=inside, other=0.0)
        keep = w > 0
        # Masked entries become 0 before any math: a -inf or NaN there must not reach a gradient.
        lp = tl.where(keep, tl.load(lp_ptr + offs, mask=inside, other=0.0), 0.0)
        ent = tl.where(keep, tl.load(ent_ptr + offs, mask=inside, other=0.0), 0.0)
        adv = tl.where(keep, tl.load(adv_ptr + offs, mask=inside, other=0.0), 0.0)
        if HAS_OLD:
            old = tl.where(keep, tl.load(old_ptr + offs, mask=inside, other=0.0), 0.0)
        else:  # on-policy: old = the logprobs, detached (ratio 1, gradient 1)
            old = lp
        # ratio = exp(clamp(lp - old)), d ratio / d lp = ratio inside the clamp, 0 outside
        x = lp - old
        ratio = tl.exp(tl.minimum(tl.maximum(x, -LOG_RATIO_MAX), LOG_RATIO_MAX))
        d_ratio = tl.where((x >= -LOG_RATIO_MAX) & (x <= LOG_RATIO_MAX), ratio, 0.0)
        lo = 1.0 - clip_low
        hi = 1.0 + clip_high
        unclipped = -adv * ratio
        clipped = -adv * tl.minimum(tl.maximum(ratio, lo), hi)
        g_un = -adv
        g_cl = tl.where((ratio >= lo) & (ratio <= hi), -adv, 0.0)
        loss = tl.maximum(unclipped, clipped)
        g = tl.where(unclipped > clipped, g_un, tl.where(clipped > unclipped, g_cl, 0.5 * (g_un + g_cl)))
        is_clipped = clipped > unclipped
        if HAS_DUAL:  # advantages < 0: min(loss, -A * c)
            cap = -adv * dual_clip
            g_cap = tl.where(loss < cap, g, tl.where(loss > cap, 0.0, 0.5 * g))
            negative = adv < 0
            loss = tl.where(negative, tl.minimum(loss, cap), loss)
            g = tl.where(negative, g_cap, g)
        g_lp = g * d_ratio
        kl = tl.zeros_like(lp)
        if HAS_REF:
            ref = tl.where(keep, tl.load(ref_ptr + offs, mask=inside, other=0.0), 0.0)
            diff = lp - ref
            if KL_KIND == 0:  # k1
                kl = diff
                d_kl = tl.full([BLOCK], 1.0, tl.float32)
            elif KL_KIND == 1:  # |k1|
                kl = tl.abs(diff)
                d_kl = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
            elif KL_KIND == 2:  # k2
                kl = 0.5 * diff * diff
                d_kl = diff
            else:  # k3 = exp(-diff) + diff - 1, both clamps as the reference
                nd = -diff
                ndc = tl.minimum(tl.maximum(nd, -LOG_RATIO_MAX), LOG_RATIO_MAX)
                e = tl.exp(ndc)
                v = e - ndc - 1.0
                kl = tl.minimum(tl.maximum(v, -K3_MAX), K3_MAX)
                inner = (nd >= -LOG_RATIO_MAX) & (nd <= LOG_RATIO_MAX) & (v >= -K3_MAX) & (v <= K3_MAX)
                d_kl = tl.where(inner, 1.0 - e, 0.0)
            loss = loss + kl_coef * kl
            g_lp = g_lp + kl_coef * d_kl
        loss = loss - entropy_coef * ent
        tl.store(grad_lp_ptr + offs, tl.where(keep, w * g_lp, 0.0), mask=inside)
        tl.store(grad_ent_ptr + offs, tl.where(keep, -entropy_coef * w, 0.0), mask=inside)
        row = sums_ptr + pid * 6
        tl.store(row + 0, tl.sum(tl.where(keep, loss * w, 0.0), axis=0))
        tl.store(row + 1, tl.sum(tl.where(keep & is_clipped, 1.0, 0.0), axis=0))
        tl.store(row + 2, tl.sum(tl.where(keep, old - lp, 0.0), axis=0))
        tl.store(row + 3, tl.sum(tl.where(keep, ent, 0.0), axis=0))
        tl.store(row + 4, tl.sum(tl.where(keep, kl, 0.0), axis=0))
        tl.store(row + 5, tl.sum(tl.where(keep, 1.0, 0.0), axis=0))

    return types.SimpleNamespace(loss=_token_loss_kernel)


def triton_policy_loss_from_token_stats(logprobs, entropy, old_logprobs, advantages, weights, ref_logprobs=None, *,
                                        clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.0, kl_kind="k3",
                                        entropy_coef=0.0, policy_loss="vanilla"):
    """:func:`fastrlhf.kernels.policy_loss.policy_loss_from_token_stats` (same arguments, checks and results) in
    one kernel launch and one sum; the ``vanilla`` policy loss only."""
    if policy_loss != "vanilla":
        raise ValueError(f"the Triton token loss fuses the vanilla policy loss only, got {policy_loss!r}")
    check_token_inputs(logprobs, entropy, old_logprobs, advantages, weights, ref_logprobs, kl_coef)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
    kind = _KL_ALIASES.get(kl_kind, kl_kind)
    if kind not in KL_KIND_CODES:
        raise ValueError(f"unknown KL kind {kl_kind!r}; expected one of {', '.join(KL_KINDS)}")
    n, device = logprobs.numel(), logprobs.device
    grad_lp = torch.empty(n, dtype=torch.float32, device=device)
    grad_ent = torch.empty(n, dtype=torch.float32, device=device)
    blocks = -(-n // BLOCK)
    sums = torch.zeros(max(blocks, 1), len(SUM_COLUMNS), dtype=torch.float32, device=device)
    if n:
        def f32(t):
            return t.detach().float().contiguous()

        lp = f32(logprobs)
        token_loss_kernels().loss[(blocks,)](
            lp, f32(entropy), lp if old_logprobs is None else f32(old_logprobs), f32(advantages), f32(weights),
            lp if ref_logprobs is None else f32(ref_logprobs), grad_lp, grad_ent, sums,
            n, float(clip_low), float(clip_high), float(dual_clip or 0.0), float(kl_coef), float(entropy_coef),
            HAS_OLD=old_logprobs is not None, HAS_REF=ref_logprobs is not None, KL_KIND=KL_KIND_CODES[kind],
            HAS_DUAL=dual_clip is not None, LOG_RATIO_MAX=LOG_RATIO_CLAMP, K3_MAX=K3_CLAMP, BLOCK=BLOCK,
        )
    total = sums.sum(0)
    return total[0], grad_lp, grad_ent, {k: total[i] for i, k in enumerate(SUM_COLUMNS) if k != "loss"}
