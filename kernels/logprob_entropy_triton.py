"""Triton kernels of :func:`~fastrlhf.kernels.logprob_entropy.logprob_entropy` and their launchers.

The kernels live in ``logprob_entropy_triton_jit.py`` and are built lazily by :func:`triton_kernels`, so
importing this module never imports triton: ``stats`` makes one pass over each row's vocabulary keeping an online
max, sum of exponentials and entropy accumulator, and writes three fp32 numbers per row; ``grad`` recomputes
the softmax block by block and writes ``dlogits`` directly. ``_triton_aot.py`` AOT-compiles these kernels.
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
    return 32 if block_v >= 16384 else 16 if block_v >= 8192 else 8 if block_v >= 2048 else 4


@functools.cache
def triton_kernels():
    """The Triton kernels, built on first use (importing ``logprob_entropy_triton_jit`` reads TRITON_INTERPRET then:
    whether ``triton.jit`` makes an interpreted or a compiled kernel is fixed when the kernel is defined); a
    namespace with ``stats`` and ``grad``."""
    from . import logprob_entropy_triton_jit as jit

    return types.SimpleNamespace(stats=jit.logprob_entropy_stats_kernel, grad=jit.logprob_entropy_grad_kernel)


def _triton_stats(logits, labels, temperature, block_v):
    n, v = logits.shape
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    if n:
        block = block_v or default_block_v(v, on_gpu=logits.is_cuda)
        # labels.contiguous(): the kernels read them at unit stride (a column of pairs is a strided view)
        triton_kernels().stats[(n,)](
            logits, logits.stride(0), labels.contiguous(), logprobs, entropy, lse, v, 1.0 / temperature,
            BLOCK_V=block, num_warps=_num_warps(block),
        )
    return logprobs, entropy, lse


def _triton_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, temperature, out, block_v):
    n, v = logits.shape
    if n:
        block = block_v or default_block_v(v, on_gpu=logits.is_cuda)
        # An absent gradient is a constexpr switch; the pointer passed for it is never read.
        triton_kernels().grad[(n,)](
            logits, logits.stride(0), labels.contiguous(), lse, entropy,
            grad_logprobs if grad_logprobs is not None else lse,
            grad_entropy if grad_entropy is not None else lse,
            out, out.stride(0), v, 1.0 / temperature,
            HAS_GRAD_LOGPROBS=grad_logprobs is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
            BLOCK_V=block, num_warps=_num_warps(block),
        )
    return out
