"""Backend choice for every kernel (Triton on CUDA tensors, the chunked torch path on CPU), and
the per-device rules that keep the kernels free of host syncs off the CPU.

Triton is imported lazily (only when a Triton backend is actually used) so that
``import fastrlhf.kernels`` costs nothing beyond torch.

Host reads. Reading a tensor's value into Python (``.item()``, ``bool(t)``, ``.tolist()``, ``if t``)
is free on the CPU but stalls the host until a GPU's queue drains, and inside a chunk loop that
serialises every chunk's kernels with Python. So every such read in the kernels is a CPU-only
shortcut gated by :func:`on_cpu`, a decision on the device and never on values; other devices take
a branch-free equivalent. On ``device="meta"`` tensors any value read raises, which is how the
tests prove the absence of syncs.

Chunk budget. The chunked paths size their chunks by bytes of fp32 logits (or softmax buffers).
On the CPU a small budget wins: every op is an OpenMP parallel region whose barrier is costly on a
busy machine, GEMMs reach full speed at a few hundred rows, and the buffer stays in a small share of
RAM. On an accelerator each chunk costs kernel launches and a re-read of the whole LM head, so
chunks must be large; the budget is :data:`GPU_CHUNK_BYTES`, capped by a share of the device's free
memory (:func:`free_device_bytes`, a host-side driver query that does not wait for the stream).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")

# Bytes of fp32 logits per chunk on the CPU: 512 tokens at V=32k, 104 at V=152k.
CPU_CHUNK_BYTES = 64 << 20
# Bytes of fp32 logits per chunk on an accelerator: ~1.7k tokens at V=152k, so a 16k-token
# micro-batch is about ten GEMMs. A chunk's working set is a small multiple of it (half of it for
# bf16 logits on Triton; up to 2.5x on the torch path: logits plus two fp32 softmax buffers).
GPU_CHUNK_BYTES = 1 << 30
# Share of the device's free memory one chunk's fp32 logits may take, so that the working set
# above (and the head's gradient buffers allocated next to it) still fits.
GPU_FREE_MEMORY_FRACTION = 0.25


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """Return "triton" or "torch" for ``backend`` given where ``tensor`` lives; raise a clear error otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if tensor.is_cuda else "torch"
    if backend == "triton" and not tensor.is_cuda and not interpreter_enabled():
        raise RuntimeError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is first "
            "imported to run the kernels on CPU; use backend='torch' or 'auto' for CPU tensors"
        )
    return backend


def on_cpu(where: torch.Tensor | torch.device | str | None) -> bool:
    """Whether a tensor (or device; None means the CPU) is on the CPU, where reading values is free.

    Gate every value read into Python on this, so that other devices never sync.
    """
    if isinstance(where, torch.Tensor):
        where = where.device
    return where is None or torch.device(where).type == "cpu"


def free_device_bytes(device: torch.device | str) -> int | None:
    """Memory a CUDA device can still give this process; None where unknown (meta, other kinds).

    The driver's free memory (a host-side query that does not wait for the stream) plus what
    PyTorch's caching allocator holds reserved but unused (host-side counters), since the driver
    counts that cache as used although the chunk buffers will be carved from it.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached))


def chunk_budget_bytes(device: torch.device | str | None = None, free_bytes: int | None = None) -> int:
    """Bytes of fp32 logits one chunk may hold on ``device`` (None: the CPU).

    CPU: :data:`CPU_CHUNK_BYTES`. Elsewhere :data:`GPU_CHUNK_BYTES`, capped by
    :data:`GPU_FREE_MEMORY_FRACTION` of ``free_bytes`` (default: :func:`free_device_bytes`, queried
    only for CUDA devices; pass a value to test the cap).
    """
    if on_cpu(device):
        return CPU_CHUNK_BYTES
    if free_bytes is None:
        free_bytes = free_device_bytes(device)
    if free_bytes is None:
        return GPU_CHUNK_BYTES
    return max(1, min(GPU_CHUNK_BYTES, int(free_bytes * GPU_FREE_MEMORY_FRACTION)))
