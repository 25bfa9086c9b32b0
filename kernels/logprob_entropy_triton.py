"""Triton kernels of :func:`~fastrlhf.kernels.logprob_entropy.logprob_entropy` and their launchers.

The kernels are built lazily by :func:`triton_kernels`, so importing this module never imports
triton: ``stats`` makes one pass over each row's vocabulary keeping an online max, sum of
exponentials and entropy accumulator, and writes three fp32 numbers per row; ``grad`` recomputes
the softmax block by block and writes ``dlogits`` directly. The ``-1000.0`` in both kernels is
``_LOGP_FLOOR`` of ``logprob_entropy_torch.py``. ``_triton_aot.py`` AOT-compiles these kernels.
"""

from __future__ import annotations

import functools
import types

import torch

from ._backend import interpreter_enabled

# Widest vocabulary block one Triton program loads at once. On a GPU wider blocks spill registers;
# under the interpreter the cost is per loop iteration, nearly independent of width, so one block
# per row is fastest. Tests lower these (or pass block_v) to exercise the multi-block loop.
MAX_BLOCK_V_GPU = 4096
MAX_BLOCK_V_INTERPRETER = 1 << 16


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_block_v(vocab_size: int, on_gpu: bool | None = None) -> int:
    """BLOCK_V for a vocabulary: next power of two of V, capped (lower on GPU than in the interpreter)."""
    if on_gpu is None:
        on_gpu = not interpreter_enabled()
    cap = MAX_BLOCK_V_GPU if on_gpu else MAX_BLOCK_V_INTERPRETER
    return max(16, min(_next_power_of_2(vocab_size), cap))


def _num_warps(block_v: int) -> int:
    return 16 if block_v >= 8192 else 8 if block_v >= 2048 else 4


@functools.cache
def triton_kernels():
    """Build the Triton kernels on first use; returns a namespace with ``stats`` and ``grad``.

    Whether ``triton.jit`` makes an interpreted or a compiled kernel is fixed when the kernel is
    defined, from TRITON_INTERPRET at that moment.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _logprob_entropy_stats_kernel(
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
        cols = tl.arange(0, BLOCK_V)
        # Online softmax statistics of z = logits / T, relative to the running max m:
        # s = sum exp(z - m), a = sum exp(z - m) * (z - m); then H = log s - a / s.
        # m starts finite so that z - m never meets -inf - -inf.
        m = tl.full((), -3.0e38, tl.float32)
        s = tl.zeros((), tl.float32)
        a = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            valid = idx < V
            z = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
            m_new = tl.maximum(m, tl.max(z, axis=0))
            shift = m - m_new
            scale = tl.exp(shift)
            d = tl.maximum(z - m_new, -1000.0)  # _LOGP_FLOOR
            e = tl.exp(d)
            a = scale * (a + s * shift) + tl.sum(e * d, axis=0)
            s = s * scale + tl.sum(e, axis=0)
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        label = tl.load(labels_ptr + row)
        z_label = tl.load(row_ptr + label).to(tl.float32) * inv_temperature
        tl.store(logprobs_ptr + row, z_label - lse)
        tl.store(entropy_ptr + row, log_s - a / s)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _logprob_entropy_grad_kernel(
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
        # dlogits_j = (1/T) * [g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)]
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        out_row_ptr = out_ptr + row * stride_out_row
        cols = tl.arange(0, BLOCK_V)
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
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            valid = idx < V
            z = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
            logp = tl.maximum(z - lse, -1000.0)  # _LOGP_FLOOR
            p = tl.exp(logp)
            coef = g_lp + g_ent * (logp + h)
            d = tl.where(idx == label, g_lp, 0.0) - p * coef
            d = d * inv_temperature
            # (The interpreter truncates fp32 -> bf16 here; GPUs round to nearest even.)
            tl.store(out_row_ptr + idx, d.to(out_ptr.dtype.element_ty), mask=valid)

    return types.SimpleNamespace(stats=_logprob_entropy_stats_kernel, grad=_logprob_entropy_grad_kernel)


def _triton_stats(logits, labels, temperature, block_v):
    n, v = logits.shape
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    if n:
        block = block_v or default_block_v(v, on_gpu=logits.is_cuda)
        triton_kernels().stats[(n,)](
            logits, logits.stride(0), labels, logprobs, entropy, lse, v, 1.0 / temperature,
            BLOCK_V=block, num_warps=_num_warps(block),
        )
    return logprobs, entropy, lse


def _triton_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, temperature, out, block_v):
    n, v = logits.shape
    if n:
        block = block_v or default_block_v(v, on_gpu=logits.is_cuda)
        # An absent gradient is a constexpr switch; the pointer passed for it is never read.
        triton_kernels().grad[(n,)](
            logits, logits.stride(0), labels, lse, entropy,
            grad_logprobs if grad_logprobs is not None else lse,
            grad_entropy if grad_entropy is not None else lse,
            out, out.stride(0), v, 1.0 / temperature,
            HAS_GRAD_LOGPROBS=grad_logprobs is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
            BLOCK_V=block, num_warps=_num_warps(block),
        )
    return out
