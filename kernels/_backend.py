"""Backend choice for every kernel: Triton on CUDA tensors, the chunked torch path on CPU.

Triton is imported lazily (only when a Triton backend is actually used) so that
``import fastrlhf.kernels`` costs nothing beyond torch.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


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
