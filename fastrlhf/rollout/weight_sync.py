"""Trainer -> rollout engine weight sync, in buckets (never one parameter at a time, never all at once).

Per-parameter gathers/broadcasts make weight sync a large share of a step in other trainers;
gathering the whole ZeRO-3 model at once defeats ZeRO-3. Here parameters are gathered
``bucket_bytes`` at a time, copied out (converted to the engine's dtype), released, and handed to
the engine as one lazy stream of Hugging Face-named tensors, so a whole sync is one
``update_weights`` call (one prefix-cache reset) while memory stays at about one bucket.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "SyncStats", "iter_bucketed_weights", "sync_weights", "unwrap_model"]

# verl packs 2 GiB buckets on GPUs; 256 MiB bounds the extra memory on CPU hosts and is already far
# above the point where per-bucket overhead matters.
DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass
class SyncStats:
    """What one sync cost."""

    seconds: float = 0.0
    gather_seconds: float = 0.0
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    bucket_bytes: int = 0
    zero3: bool = False
    bucket_sizes: list[int] = field(default_factory=list, repr=False)


def unwrap_model(source) -> torch.nn.Module:
    """The HF module inside a DeepSpeed engine (or the module itself)."""
    module = getattr(source, "module", source)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(
            f"weight sync source must be a torch module or a DeepSpeed engine, got {type(source).__name__}"
        )
    return module


def _is_zero3(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def _full_numel(param: torch.nn.Parameter) -> int:
    # A partitioned ZeRO-3 parameter has numel() 0 outside a gather; ds_numel is the full size.
    return int(param.ds_numel) if _is_zero3(param) else param.numel()


def _buckets(named_params, bucket_bytes: int, dtype: torch.dtype | None):
    bucket, size = [], 0
    for name, param in named_params:
        nbytes = _full_numel(param) * (dtype or param.dtype).itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, size
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield bucket, size


def iter_bucketed_weights(
    source,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    stats: SyncStats | None = None,
    name_prefix: str = "",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every parameter of ``source``, gathering ZeRO-3 ones bucket by bucket.

    Collective under ZeRO-3: every rank must consume the whole iterator, in the same order. Tied
    weights appear once (under the name ``named_parameters`` gives them, e.g. embed_tokens), which is
    what HF and vLLM loaders expect; a parameter larger than ``bucket_bytes`` is a bucket of its own.
    ``name_prefix`` is stripped from names (e.g. "base_model.model." for a wrapped model).
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    module = unwrap_model(source)
    stats = stats if stats is not None else SyncStats()
    stats.bucket_bytes = bucket_bytes
    named = [
        (n[len(name_prefix) :] if name_prefix and n.startswith(name_prefix) else n, p)
        for n, p in module.named_parameters()
    ]
    stats.zero3 = any(_is_zero3(p) for _, p in named)
    for bucket, size in _buckets(named, bucket_bytes, dtype):
        t0 = time.perf_counter()
        params = [p for _, p in bucket]
        if stats.zero3:
            import deepspeed

            # modifier_rank=None: read-only gather, entered on every rank; the copies below let the
            # gathered storage be released before the engine even sees the bucket.
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                out = [(n, p.detach().to(dtype or p.dtype, copy=True)) for n, p in bucket]
        else:
            # Plain or ZeRO-0/1/2 parameters are whole on every rank; no copy unless converting.
            out = [(n, p.detach().to(dtype or p.dtype)) for n, p in bucket]
        stats.gather_seconds += time.perf_counter() - t0
        stats.num_buckets += 1
        stats.bucket_sizes.append(size)
        out.reverse()
        while out:  # pop so each tensor is freed as soon as the engine has taken it
            name, tensor = out.pop()
            stats.bytes += tensor.numel() * tensor.element_size()
            stats.num_tensors += 1
            yield name, tensor


def sync_weights(
    source,
    engine,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    name_prefix: str = "",
) -> SyncStats:
    """Push ``source``'s weights (a module or DeepSpeed engine at ZeRO 0-3) into ``engine``.

    Call it on every rank (the ZeRO-3 gather is collective); each rank's engine is updated. The
    dtype defaults to the engine's weight dtype. Returns the stats of this sync.
    """
    stats = SyncStats()
    if dtype is None:
        dtype = getattr(engine, "weight_dtype", None)
    t0 = time.perf_counter()
    engine.update_weights(iter_bucketed_weights(source, bucket_bytes, dtype, stats, name_prefix))
    stats.seconds = time.perf_counter() - t0
    return stats
