"""Where a batch meets its model, and where the training step reads the device.

**Batches.** Every batch is built on the host (token lists -> padded or packed tensors) and reaches
its model through :func:`to_device`, which takes it to :func:`model_device`: RL experience and its
minibatch indices, SFT and reward-model batches, packed layouts, generation, evaluation,
reward-model scoring and the critic. A host tensor that skipped it works on a CPU, where host and
model share one device, and fails on a GPU at the first op that mixes it with the weights ("index
is on cpu, different from other tensors on cuda:0"). ``tests/engine/test_device_placement.py`` runs each
command's step on an emulated second device, where such a tensor fails as it would on a GPU.

The copy to a device is ``non_blocking``: from pageable memory CUDA stages it synchronously anyway, and a
blocking host-to-device copy would wait for all queued device work first (a stall, and an error
under ``torch.cuda.set_sync_debug_mode("error")``). A copy to the host blocks (see :func:`to_device`).

**Host reads.** ``.item()``, ``float(t)``, ``.tolist()`` and ``bool(t)`` of a device tensor wait for
every kernel queued before it: on a CPU they are free, on a GPU each one stalls the stream. The
training step makes such reads only inside :func:`host_read`, which names them (the update makes at
most one per optimizer step: the guard's decision, which brings the step's metrics along). Under
CUDA's sync debug mode a named read is allowed and any other raises; the tests count the names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

__all__ = ["host_read", "model_device", "to_device", "watch_host_reads"]

_open_reads: list[str] = []
_watchers: list[Callable[[str], None]] = []


def model_device(model) -> torch.device:
    """The device of a model's weights: a DeepSpeed engine's ``device``, else its first parameter's."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    module = getattr(model, "module", model)
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def to_device(batch, device: torch.device | str):
    """``batch`` (a tensor, or dicts, lists and tuples of them) on ``device``; other values as they are."""
    if isinstance(batch, torch.Tensor):
        # To the host it blocks: a non-blocking device-to-host copy returns before its data has arrived, and the
        # host op that reads it next (a stack, a .tolist()) would read whatever the buffer held.
        return batch.to(device, non_blocking=device is None or torch.device(device).type != "cpu")
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@contextlib.contextmanager
def host_read(name: str):
    """A deliberate read of device values, named ``name``: allowed under CUDA's sync debug mode."""
    _open_reads.append(name)
    for watch in _watchers:
        watch(name)
    restore = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        restore = torch.cuda.get_sync_debug_mode()
        if restore:
            torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        _open_reads.pop()
        if restore:
            torch.cuda.set_sync_debug_mode(restore)


def current_host_read() -> str | None:
    """The name of the :func:`host_read` open now (None outside one)."""
    return _open_reads[-1] if _open_reads else None


@contextlib.contextmanager
def watch_host_reads():
    """Collects the names of the :func:`host_read` blocks entered inside it, in order (for tests)."""
    names: list[str] = []
    _watchers.append(names.append)
    try:
        yield names
    finally:
        _watchers.remove(names.append)
