"""The last pass of the fused LM head's backward on a GPU: a gradient summed in fp32 (``grad_weight``'s ``[V, H]``
accumulator), scaled by ``grad_output`` and written in the weight's bf16/fp16, in one vectorized pass.

torch's ``mul`` of an fp32 tensor into a bf16 ``out`` takes its casting elementwise kernel: on an H100 that pass
took 2.45 ms for the 7B head's sum (3.27 GB moved, about half the copy rate; 2026-11-28 profile in
``benchmarks/results/history/2026-11-28-h100-session.md``). This kernel reads each fp32 value once, multiplies it by
the one ``grad_output`` value it loads from the device (no host read) and stores the product rounded once, as
torch's ``mul`` does: on a GPU the two agree bit for bit (TRITON_INTERPRET's bf16 conversion truncates, so under
the interpreter bf16 is within one ulp). The kernel lives in ``grad_cast_triton_jit.py``;
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
    """Whether :func:`scale_cast` covers this: a contiguous fp32 ``grad`` written in bf16/fp16."""
    return grad.dtype == torch.float32 and dtype in OUT_DTYPES and grad.is_contiguous()


def scale_cast(grad: torch.Tensor, grad_output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(grad * grad_output).to(dtype)`` in one pass (see :func:`takes` for what it covers)."""
    if not takes(grad, dtype):
        raise ValueError(f"scale_cast: needs a contiguous float32 grad and a bf16/fp16 dtype, got "
                         f"{grad.dtype} ({'' if grad.is_contiguous() else 'not '}contiguous) -> {dtype}")
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    scale = grad_output.detach().to(device=grad.device, dtype=torch.float32).reshape(1)
    n = grad.numel()
    if n:
        scale_cast_kernel()[((n + BLOCK - 1) // BLOCK,)](grad, scale, out, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
