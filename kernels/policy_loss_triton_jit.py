"""The ``@triton.jit`` functions of ``policy_loss_triton.py`` (read its docstring): the per-token loss math
(``_token_loss_math``) and the two kernels built on it. Defined at module level because a kernel calls the
helper by its global name (the interpreter resolves no closures); importing this module imports triton and
fixes, from TRITON_INTERPRET at that moment, whether the kernels are interpreted, so only
``policy_loss_triton.token_loss_kernels`` imports it, on first use. The row kernel's softmax passes are
``logprob_entropy_triton_jit.py``'s helpers.
"""

import triton
import triton.language as tl

from .logprob_entropy_triton_jit import row_softmax_grad, row_softmax_stats


@triton.jit
def _token_loss_math(lp, ent, old, adv, ref, clip_low, clip_high, dual_clip, kl_coef, entropy_coef, tau_pos, tau_neg,
                     HAS_REF: tl.constexpr, KL_KIND: tl.constexpr, HAS_DUAL: tl.constexpr, LOSS_KIND: tl.constexpr,
                     LOG_RATIO_MAX: tl.constexpr, K3_MAX: tl.constexpr):
    """Per token (a block or a scalar): (loss, d loss / d lp, whether clipped, kl); d loss / d ent is
    -entropy_coef. Inputs already sanitised: masked tokens hold 0. ``LOSS_KIND``: 0 vanilla, 1 CISPO, 2 SAPO.
    ``KL_KIND``: 0 k1, 1 |k1|, 2 k2, 3 k3, and 4 + those for their "+" kinds (``policy_loss_triton``'s
    ``KL_KIND_CODES`` and ``KL_STRAIGHT_THROUGH_CODES``)."""
    # ratio = exp(clamp(lp - old)), d ratio / d lp = ratio inside the clamp, 0 outside
    x = lp - old
    ratio = tl.exp(tl.minimum(tl.maximum(x, -LOG_RATIO_MAX), LOG_RATIO_MAX))
    d_ratio = tl.where((x >= -LOG_RATIO_MAX) & (x <= LOG_RATIO_MAX), ratio, 0.0)
    lo = 1.0 - clip_low
    hi = 1.0 + clip_high
    if LOSS_KIND == 1:  # CISPO: -sg(clamp(ratio)) * A * lp; the weight is detached, so the gradient is the weight's
        weight = tl.minimum(tl.maximum(ratio, lo), hi)
        loss = -adv * weight * lp
        g_lp = -adv * weight
        is_clipped = weight != ratio
    elif LOSS_KIND == 2:  # SAPO: -A * 4/tau * sigmoid(tau (ratio - 1)), tau by the advantage's sign
        tau = tl.where(adv > 0, tau_pos, tau_neg)
        gate = tl.sigmoid(tau * (ratio - 1.0))
        loss = -adv * gate * 4.0 / tau
        g_lp = -adv * 4.0 * gate * (1.0 - gate) * d_ratio
        is_clipped = ratio < 0.0  # never: no token is clipped
    else:
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
        diff = lp - ref
        if KL_KIND % 4 == 0:  # k1
            kl = diff
            d_kl = tl.zeros_like(diff) + 1.0
        elif KL_KIND % 4 == 1:  # |k1|
            kl = tl.abs(diff)
            d_kl = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        elif KL_KIND % 4 == 2:  # k2
            kl = 0.5 * diff * diff
            d_kl = diff
        else:  # k3 = exp(-diff) + diff - 1, both clamps as the reference
            nd = -diff
            ndc = tl.minimum(tl.maximum(nd, -LOG_RATIO_MAX), LOG_RATIO_MAX)
            e = tl.exp(ndc)
            # exp(x) - 1 - x cancels to rounding noise near x = 0 (a policy near its reference: negative k3 for
            # |x| ~ 1e-4 in fp32): its series there, as the reference's expm1(x) - x
            small = ndc * ndc * (0.5 + ndc * (1.0 / 6.0 + ndc * (1.0 / 24.0 + ndc * (1.0 / 120.0 + ndc / 720.0))))
            v = tl.where(tl.abs(ndc) < 0.1, small, e - ndc - 1.0)
            kl = tl.minimum(tl.maximum(v, -K3_MAX), K3_MAX)
            inner = (nd >= -LOG_RATIO_MAX) & (nd <= LOG_RATIO_MAX) & (v >= -K3_MAX) & (v <= K3_MAX)
            d_kl = tl.where(inner, 1.0 - e, 0.0)
        if KL_KIND >= 4:  # a "+" kind (verl's k3+): the estimate's value with k2's gradient, through no clamp
            d_kl = diff
        loss = loss + kl_coef * kl
        g_lp = g_lp + kl_coef * d_kl
    loss = loss - entropy_coef * ent
    return loss, g_lp, is_clipped, kl

@triton.jit
def _token_loss_kernel(
    lp_ptr, ent_ptr, old_ptr, adv_ptr, w_ptr, ref_ptr, grad_lp_ptr, grad_ent_ptr, sums_ptr,
    n, clip_low, clip_high, dual_clip, kl_coef, entropy_coef, tau_pos, tau_neg,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, KL_KIND: tl.constexpr, HAS_DUAL: tl.constexpr,
    LOSS_KIND: tl.constexpr, LOG_RATIO_MAX: tl.constexpr, K3_MAX: tl.constexpr, BLOCK: tl.constexpr,
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
    if HAS_REF:
        ref = tl.where(keep, tl.load(ref_ptr + offs, mask=inside, other=0.0), 0.0)
    else:
        ref = lp
    loss, g_lp, is_clipped, kl = _token_loss_math(lp, ent, old, adv, ref, clip_low, clip_high, dual_clip,
                                                  kl_coef, entropy_coef, tau_pos, tau_neg, HAS_REF, KL_KIND, HAS_DUAL,
                                                  LOSS_KIND, LOG_RATIO_MAX, K3_MAX)
    tl.store(grad_lp_ptr + offs, tl.where(keep, w * g_lp, 0.0), mask=inside)
    tl.store(grad_ent_ptr + offs, tl.where(keep, -entropy_coef * w, 0.0), mask=inside)
    row = sums_ptr + pid * 6
    tl.store(row + 0, tl.sum(tl.where(keep, loss * w, 0.0), axis=0))
    tl.store(row + 1, tl.sum(tl.where(keep & is_clipped, 1.0, 0.0), axis=0))
    tl.store(row + 2, tl.sum(tl.where(keep, old - lp, 0.0), axis=0))
    tl.store(row + 3, tl.sum(tl.where(keep, ent, 0.0), axis=0))
    tl.store(row + 4, tl.sum(tl.where(keep, kl, 0.0), axis=0))
    tl.store(row + 5, tl.sum(tl.where(keep, 1.0, 0.0), axis=0))


@triton.jit
def _row_loss_kernel(
    logits_ptr, stride_row, labels_ptr, old_ptr, adv_ptr, w_ptr, ref_ptr, out_ptr, stride_out_row, sums_ptr,
    n_rows, num_programs, V, inv_temperature, clip_low, clip_high, dual_clip, kl_coef, entropy_coef, tau_pos, tau_neg,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, KL_KIND: tl.constexpr, HAS_DUAL: tl.constexpr,
    LOSS_KIND: tl.constexpr, NEED_GRAD: tl.constexpr, LOG_RATIO_MAX: tl.constexpr, K3_MAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Program p takes rows p, p + num_programs, ...: one each when launched with a program per row, several when
    # fewer run (a program per SM), so that the rows being read at once fit in L2 for their second read.
    for row in range(tl.program_id(0).to(tl.int64), n_rows, num_programs):
        # Compiled, the loop variable is int64 already; TRITON_INTERPRET's loop yields Python ints, which times an
        # int32 stride wrap past 2^31 elements (16,384 rows of a 151,936 vocabulary), so widen it for both.
        r = tl.cast(row, tl.int64)
        _row_loss_one_row(logits_ptr + r * stride_row, labels_ptr + r, old_ptr + r, adv_ptr + r, w_ptr + r,
                          ref_ptr + r, out_ptr + r * stride_out_row, sums_ptr + r * 6,
                          V, inv_temperature, clip_low, clip_high, dual_clip, kl_coef, entropy_coef, tau_pos, tau_neg,
                          HAS_OLD, HAS_REF, KL_KIND, HAS_DUAL, LOSS_KIND, NEED_GRAD, LOG_RATIO_MAX, K3_MAX, BLOCK_V)


@triton.jit
def _row_loss_one_row(
    row_ptr, label_ptr, old_ptr, adv_ptr, w_ptr, ref_ptr, out_row_ptr, sums_row,
    V, inv_temperature, clip_low, clip_high, dual_clip, kl_coef, entropy_coef, tau_pos, tau_neg,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, KL_KIND: tl.constexpr, HAS_DUAL: tl.constexpr,
    LOSS_KIND: tl.constexpr, NEED_GRAD: tl.constexpr, LOG_RATIO_MAX: tl.constexpr, K3_MAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row of :func:`_row_loss_kernel`; the pointers are the row's own."""
    w = tl.load(w_ptr)
    if w > 0:
        lse, ent = row_softmax_stats(row_ptr, V, inv_temperature, BLOCK_V)
        label = tl.load(label_ptr)
        lp = tl.load(row_ptr + label).to(tl.float32) * inv_temperature - lse
        adv = tl.load(adv_ptr)
        if HAS_OLD:
            old = tl.load(old_ptr)
        else:
            old = lp
        if HAS_REF:
            ref = tl.load(ref_ptr)
        else:
            ref = lp
        loss, g_lp, is_clipped, kl = _token_loss_math(lp, ent, old, adv, ref, clip_low, clip_high, dual_clip,
                                                      kl_coef, entropy_coef, tau_pos, tau_neg, HAS_REF, KL_KIND,
                                                      HAS_DUAL, LOSS_KIND, LOG_RATIO_MAX, K3_MAX)
        tl.store(sums_row + 0, loss * w)
        tl.store(sums_row + 1, tl.where(is_clipped, 1.0, 0.0))
        tl.store(sums_row + 2, old - lp)
        tl.store(sums_row + 3, ent)
        tl.store(sums_row + 4, kl)
        tl.store(sums_row + 5, 1.0)
        if NEED_GRAD:  # the row's second read follows its first: from L2 on a GPU, where the row fits
            row_softmax_grad(row_ptr, out_row_ptr, V, label, lse, ent, w * g_lp, -entropy_coef * w,
                             inv_temperature, BLOCK_V)
    else:
        # A masked row: no loss, no metric, a zero gradient; its logits are never read.
        for k in range(0, 6):
            tl.store(sums_row + k, 0.0)
        if NEED_GRAD:
            zeros = tl.zeros([BLOCK_V], tl.float32).to(out_row_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                idx = start + tl.arange(0, BLOCK_V)
                tl.store(out_row_ptr + idx, zeros, mask=idx < V)
