"""glibc's heap in a CPU training process: large freed blocks go back to the OS at once.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and unmaps
it on ``free``; anything smaller comes from the heap, whose freed memory stays resident for later
allocations. The threshold starts at 128 KiB but is dynamic: each freed mmapped block raises it to
that block's size, up to 32 MiB. A training step frees tensors of every size up to tens of MiB, so
after the first one nearly every activation lives on the heap, and what the update's forward pass
frees in the backward stays resident while the backward, the ZeRO reduction and the optimizer step
allocate their own buffers beside it (workload C: about 1 GB per rank, kept for the rest of the run).

:func:`configure_cpu_heap` fixes the threshold at :data:`MMAP_THRESHOLD_BYTES` (``mallopt``, which
also stops the dynamic adjustment): every tensor of 4 MiB or more is unmapped when freed, so the
process holds what it uses. The cost is a page fault per 4 KiB page of each such allocation; with
4 MiB it was within the noise of a workload-C step's CPU time (1 MiB cost about 10%).
Values the user set (``MALLOC_MMAP_THRESHOLD_``, or ``GLIBC_TUNABLES`` naming it) are left alone.

:func:`trim_heap_after_backward` returns the heap's free pages to the OS (``malloc_trim``) each time a
backward pass reaches a model's input embeddings: by then every layer's activations (mostly under
4 MiB, so heap-allocated) are freed, and what comes next (the embedding's gradient, the ZeRO
reduction's buffers, the optimizer step) is allocated beside them otherwise. About 10-20 ms per
backward on workload C, for 120-190 MiB per rank given back just before the update's largest buffers.

:func:`discard_pages` gives the whole pages under some tensors back to the OS while the tensors stay
allocated (``madvise(MADV_DONTNEED)``): they read as zeros until written again. It is for buffers whose
contents the owner rewrites before the next read: a CPU rollout engine's packed weights and KV cache
while the update runs (``VLLMEngine.sleep``; the weight sync rewrites them).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys

import torch

__all__ = ["MMAP_THRESHOLD_BYTES", "configure_cpu_heap", "discard_pages", "madvise", "mmap_threshold_set_by_user",
           "trim_heap", "trim_heap_after_backward", "whole_pages"]

MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # malloc.h
MADV_DONTNEED = 4  # <sys/mman.h>, Linux


def mmap_threshold_set_by_user(environ=os.environ) -> bool:
    """Whether the environment already fixes glibc's mmap threshold."""
    return "MALLOC_MMAP_THRESHOLD_" in environ or "mmap_threshold" in environ.get("GLIBC_TUNABLES", "")


@functools.lru_cache(maxsize=1)
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- present in glibc only (musl has no mallopt to speak of)
        return libc
    except (OSError, AttributeError):
        return None


def configure_cpu_heap(threshold: int = MMAP_THRESHOLD_BYTES, environ=os.environ) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; returns whether it was set
    (False off glibc, or where the environment sets it already). Call it before the models load."""
    if not isinstance(threshold, int) or threshold <= 0:
        raise ValueError(f"threshold must be a positive int (bytes), got {threshold!r}")
    if mmap_threshold_set_by_user(environ):
        return False
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1


def trim_heap() -> bool:
    """Give the free pages of glibc's heaps back to the OS now; whether any were (False off glibc)."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


def _trim_on_grad(grad):
    trim_heap()


def _hook_output(module, args, output):
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(_trim_on_grad)


def trim_heap_after_backward(model) -> bool:
    """Trim the heap (:func:`trim_heap`) whenever a backward pass has gone through every layer of
    ``model`` and reaches its input embeddings; returns whether a hook was installed (False off glibc,
    or for a model without ``get_input_embeddings``). Only when the embeddings' output needs a
    gradient: not for a frozen embedding (LoRA), unless peft's ``enable_input_require_grads`` hook
    (LoRA with gradient checkpointing) makes it need one."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if _glibc() is None or embeddings is None:
        return False
    embeddings.register_forward_hook(_hook_output)
    return True


@functools.lru_cache(maxsize=1)
def madvise():
    """libc's ``madvise(addr, length, advice) -> int``, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """``(start, end)``: the page-aligned range of the pages that ``nbytes`` bytes at ``address`` cover
    whole (``end <= start`` when there is none); the partial pages at either end may hold other data."""
    page = mmap.PAGESIZE
    return -(-address // page) * page, (address + nbytes) // page * page


def discard_pages(spans) -> int:
    """Drop the whole pages inside each ``(address, nbytes)`` span from this process's memory; returns
    the bytes dropped (0 where madvise is missing).

    The spans stay valid memory: a later write faults fresh pages in, a read before any write sees
    zeros (anonymous memory) or the file's bytes (a private file mapping). The partial pages at either
    end are kept, since other allocations may share them. Only for memory whose every byte the caller
    rewrites before reading it again.
    """
    fn, dropped = madvise(), 0
    if fn is None:
        return 0
    for address, nbytes in spans:
        start, end = whole_pages(address, nbytes)
        if end > start and fn(start, end - start, MADV_DONTNEED) == 0:
            dropped += end - start
    return dropped
