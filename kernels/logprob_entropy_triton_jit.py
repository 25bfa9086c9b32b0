"""The ``@triton.jit`` functions of ``logprob_entropy_triton.py`` (read its docstring): one row's online softmax
statistics (``row_softmax_stats``) and its ``dlogits`` pass (``row_softmax_grad``), and the two kernels built on
them. ``policy_loss_triton_jit.py``'s row kernel calls the same two helpers, so the softmax math has one home.
Defined at module level because a kernel calls a helper by its global name (the interpreter resolves no
closures); importing this module imports triton and fixes, from TRITON_INTERPRET at that moment, whether the
kernels are interpreted, so only the launchers import it, on first use. The ``-1000.0`` is ``_LOGP_FLOOR`` of
``logprob_entropy_torch.py``.
"""

import triton
import triton.language as tl


@triton.jit
def row_softmax_stats(row_ptr, V, inv_temperature, BLOCK_V: tl.constexpr):
    """``(lse, entropy)`` of softmax(row / T), in one pass over the row's vocabulary."""
    cols = tl.arange(0, BLOCK_V)
    # Online softmax statistics of z = logits / T, relative to the running max m:
    # s = sum exp(z - m), a = sum exp(z - m) * (z - m); then H = log s - a / s.
    # m starts finite so that z - m never meets -inf - -inf.
    m = tl.full((), -3.0e38, tl.float32)
    s = tl.zeros((), tl.float32)
    a = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        z = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        shift = m - m_new
        scale = tl.exp(shift)
        d = tl.maximum(z - m_new, -1000.0)  # _LOGP_FLOOR
        e = tl.exp(d)
        a = scale * (a + s * shift) + tl.sum(e * d, axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    return m + log_s, log_s - a / s


@triton.jit
def row_softmax_grad(row_ptr, out_row_ptr, V, label, lse, h, g_lp, g_ent, inv_temperature, BLOCK_V: tl.constexpr):
    """Writes the row's ``dlogits`` (in ``out_row_ptr``'s dtype) for the gradients ``g_lp`` of its label's logprob
    and ``g_ent`` of its entropy ``h``: dlogits_j = (1/T) * [g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)]."""
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        valid = idx < V
        z = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
        logp = tl.maximum(z - lse, -1000.0)  # _LOGP_FLOOR
        p = tl.exp(logp)
        d = (tl.where(idx == label, g_lp, 0.0) - p * (g_lp + g_ent * (logp + h))) * inv_temperature
        # (The interpreter truncates fp32 -> bf16 here; GPUs round to nearest even.)
        tl.store(out_row_ptr + idx, d.to(out_row_ptr.dtype.element_ty), mask=valid)


@triton.jit
def logprob_entropy_stats_kernel(
    logits_ptr,
    stride_row,
    labels_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    inv_temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    lse, entropy = row_softmax_stats(row_ptr, V, inv_temperature, BLOCK_V)
    label = tl.load(labels_ptr + row)
    z_label = tl.load(row_ptr + label).to(tl.float32) * inv_temperature
    tl.store(logprobs_ptr + row, z_label - lse)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)


@triton.jit
def logprob_entropy_grad_kernel(
    logits_ptr,
    stride_row,
    labels_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    out_ptr,
    stride_out_row,
    V,
    inv_temperature,
    HAS_GRAD_LOGPROBS: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row)
    if HAS_GRAD_LOGPROBS:
        g_lp = tl.load(grad_logprobs_ptr + row).to(tl.float32)
    else:
        g_lp = tl.zeros((), tl.float32)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row).to(tl.float32)
        h = tl.load(entropy_ptr + row)
    else:
        g_ent = tl.zeros((), tl.float32)
        h = tl.zeros((), tl.float32)
    row_softmax_grad(logits_ptr + row * stride_row, out_ptr + row * stride_out_row, V, label, lse, h, g_lp, g_ent,
                     inv_temperature, BLOCK_V)
