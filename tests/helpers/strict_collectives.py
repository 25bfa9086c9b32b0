"""Strict collectives: catch, on a CPU machine with gloo, a tensor that NCCL would reject on a GPU run.

gloo moves host tensors, so a CPU run accepts ``dist.all_reduce(torch.tensor([x]))``; NCCL moves
only CUDA tensors and raises "No backend type associated with device type cpu" at that call. On
a machine without a GPU no real tensor can be on CUDA, so device checks alone would pass
vacuously. This mode therefore declares the default group an NCCL group, as on a GPU node, and:

* replaces ``fastrlhf.distributed.comm.collective_device`` with what NCCL needs (``cuda:<local rank>``) and
  ``fastrlhf.distributed.comm.to_collective_device`` with a placement that keeps the tensor on the host (gloo
  still does the work) but records the device it would have had on the GPU;
* wraps the ``torch.distributed`` collectives: every tensor that fastrlhf (or a test) hands to the
  default group must carry that declared device. A tensor that was not placed by the comm module
  has its real device, the host, and is rejected with NCCL's message. Object collectives
  (``all_gather_object``, ...) from our code are rejected too: they pickle through the device.

Calls owned by DeepSpeed or vLLM (the first frame outside the transport layers is theirs) are
counted but not checked: they place their own tensors on their accelerator.

Use: ``install(log_path)`` at the top of a rank's script, before any collective. The log (JSON,
written at exit) counts checked and library calls per owner module, so a test can prove the
checks ran.
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import os
import sys

import torch
import torch.distributed as dist

TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                      "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
# Frames of these modules only pass a call on; the first frame outside them owns the call.
TRANSPORT = ("torch.distributed", "deepspeed.comm", __name__)
# Libraries that place their own tensors on their own accelerator device.
LIBRARIES = ("deepspeed", "vllm", "torch")

DECLARED_ATTR = "_strict_declared_device"


class StrictCollectiveError(RuntimeError):
    pass


def _owner() -> tuple[str, str]:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "?")
        if not module.startswith(TRANSPORT):
            return module, f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?", "?"


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class StrictCollectives:
    def __init__(self, declared_backend: str = "nccl"):
        from fastrlhf.distributed import comm

        self.comm = comm
        self.declared = comm.device_for_backend(declared_backend, int(os.environ.get("LOCAL_RANK", 0)))
        self.checked = collections.Counter()
        self.library = collections.Counter()
        self.barriers = collections.Counter()

    # -- the comm module's placement, as on the GPU run
    def collective_device(self, group=None):
        return self.declared if self._is_default(group) else torch.device("cpu")

    def to_collective_device(self, t, group=None):
        out = t.to("cpu")
        setattr(out, DECLARED_ATTR, self.collective_device(group))
        return out

    @staticmethod
    def _is_default(group) -> bool:
        return group is None or group is dist.GroupMember.WORLD

    # -- the wrapped torch.distributed functions
    def wrap(self, name, fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            module, where = _owner()
            if module.startswith(LIBRARIES):
                self.library[f"{module}.{name}"] += 1
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            if name in OBJECT_COLLECTIVES:
                raise StrictCollectiveError(f"{name} from {where}: object collectives pickle through the device "
                                            "on NCCL; reduce tensors through fastrlhf.distributed.comm instead")
            if self._is_default(group):
                for t in _tensors(list(args) + list(kwargs.values())):
                    device = getattr(t, DECLARED_ATTR, t.device)
                    if device != self.declared:
                        raise StrictCollectiveError(
                            f"{name} from {where} got a tensor on {device}; on the GPU run the default group is "
                            f"NCCL, which takes {self.declared} tensors only (NCCL: \"No backend type associated "
                            f"with device type {device.type}\")")
            self.checked[f"{module}.{name}"] += 1
            return fn(*args, **kwargs)

        return checked

    def wrap_barrier(self, fn):
        @functools.wraps(fn)
        def barrier(group=None, async_op=False, device_ids=None):
            module, where = _owner()
            if not module.startswith(LIBRARIES) and self._is_default(group):
                # Without device_ids an NCCL barrier runs on whichever device is current (device 0 on
                # every rank unless someone set it): the right one is this rank's.
                if device_ids != [self.declared.index]:
                    raise StrictCollectiveError(f"barrier from {where} with device_ids={device_ids}; on NCCL "
                                                f"it must name this rank's device [{self.declared.index}]")
                self.barriers[module] += 1
            return fn(group=group, async_op=async_op)  # gloo takes no device_ids

        return barrier

    def report(self) -> dict:
        return {"declared": str(self.declared), "checked": dict(self.checked), "library": dict(self.library),
                "barriers": dict(self.barriers)}


def install(log_path: str | None = None, declared_backend: str = "nccl") -> StrictCollectives:
    """Switch this process to strict collectives; with ``log_path``, write the call counts there at exit.

    ``uninstall()`` on the returned object puts everything back (for in-process tests).
    """
    from fastrlhf.distributed import comm

    strict = StrictCollectives(declared_backend)
    originals = [(comm, "collective_device", comm.collective_device),
                 (comm, "to_collective_device", comm.to_collective_device), (dist, "barrier", dist.barrier)]
    comm.collective_device = strict.collective_device
    comm.to_collective_device = strict.to_collective_device
    for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
        if hasattr(dist, name):
            originals.append((dist, name, getattr(dist, name)))
            setattr(dist, name, strict.wrap(name, getattr(dist, name)))
    dist.barrier = strict.wrap_barrier(dist.barrier)

    def uninstall():
        for owner, name, value in originals:
            setattr(owner, name, value)

    strict.uninstall = uninstall
    if log_path:
        def write():
            with open(log_path, "w") as f:
                json.dump(strict.report(), f)

        atexit.register(write)
    return strict
