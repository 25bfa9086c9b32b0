"""The last pass of the fused LM head's backward on a GPU: a gradient summed in fp32 (``grad_weight``'s ``[V, H]``
accumulator), scaled by ``grad_output`` and written in the weight's bf16/fp16, in one vectorized pass.

torch's ``mul`` of an fp32 tensor into a bf16 ``out`` takes its casting elementwise kernel: on an H100 that pass
took 2.45 ms for the 7B head's sum (3.27 GB moved, about half the copy rate; the profile in
``benchmarks/results/history/2026-11-28-h100-session.md``). This kernel reads each fp32 value once, multiplies it by
the one ``grad_output`` value it loads from the device (no host read) and stores the product rounded once, as
torch's ``mul`` does: on a GPU the two agree bit for bit (TRITON_INTERPRET's bf16 conversion truncates, so under
the interpreter bf16 is within one ulp). The same kernel scales a bf16/fp16 gradient in place (the head's
``grad_hidden``), its products in fp32 and rounded once. The kernel lives in ``grad_cast_triton_jit.py``;
``_triton_aot.py`` compiles it for sm_80 and sm_90.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 4096  # elements per program: 16 KiB of fp32 read, enough in flight per SM for a memory-bound pass
NUM_WARPS = 8
OUT_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def scale_cast_kernel():
    from .grad_cast_triton_jit import scale_cast

    return scale_cast


def takes(grad: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`scale_cast` covers this: a contiguous fp32 ``grad`` written in bf16/fp16, or a contiguous
    bf16/fp16 ``grad`` scaled in place (``dtype`` its own)."""
    return (grad.dtype == torch.float32 or grad.dtype == dtype) and dtype in OUT_DTYPES and grad.is_contiguous()


def scale_cast(grad: torch.Tensor, grad_output: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``(grad * grad_output).to(dtype)`` in one pass, each product in fp32 and rounded once (see :func:`takes` for
    what it covers); ``out``: where to write it (``grad`` itself for a bf16/fp16 ``grad`` scaled in place)."""
    if not takes(grad, dtype):
        raise ValueError(f"scale_cast: needs a contiguous float32 (or {dtype}) grad and a bf16/fp16 dtype, got "
                         f"{grad.dtype} ({'' if grad.is_contiguous() else 'not '}contiguous) -> {dtype}")
    if out is None:
        out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    elif out.dtype != dtype or out.shape != grad.shape or not out.is_contiguous():
        raise ValueError(f"scale_cast: out must be a contiguous {dtype} tensor of grad's shape {tuple(grad.shape)}")
    scale = grad_output.detach().to(device=grad.device, dtype=torch.float32).reshape(1)
    n = grad.numel()
    if n:
        scale_cast_kernel()[((n + BLOCK - 1) // BLOCK,)](grad, scale, out, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
