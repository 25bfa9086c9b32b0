"""Every cross-rank reduction fastrlhf makes itself, in one place, right for NCCL as for gloo.

NCCL only moves accelerator tensors ("No backend type associated with device type cpu" for a
host tensor), gloo takes host tensors. A scalar built with ``torch.tensor([x])`` is a host tensor,
so code that works under gloo on a CPU machine raises at the first step of a GPU run. Here every
tensor handed to a collective first goes through :func:`to_collective_device`, which puts it where
the group's backend needs it (``cuda:<local rank>`` for NCCL, the host for gloo); the result is
copied back to where the caller's tensor lives.

DeepSpeed's own collectives (ZeRO's gradient reduce-scatter, parameter gathers) place their tensors
on DeepSpeed's accelerator themselves and do not come through here.

Host-side values (metrics, flags) cost one small copy each way on a GPU; they are reduced once per
step, never inside a loop over micro-batches or chunks. The copy back (or the read of a device flag) waits for the
device, so each is a named :func:`fastrlhf.engine.device.host_read`, as every deliberate read is. Importing this
module needs only torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastrlhf.distributed.ranks import local_rank
from fastrlhf.engine.device import host_read

__all__ = [
    "agree_on_failure",
    "agreed",
    "all_ranks_flag",
    "all_ranks_true",
    "all_reduce_",
    "any_rank_true",
    "barrier",
    "collective_device",
    "gather_bytes",
    "gather_padded",
    "device_for_backend",
    "is_agreed",
    "is_distributed",
    "mean_over_ranks",
    "reduce_floats",
    "to_collective_device",
    "world_size",
]

# Backends that move only accelerator tensors, and the device type each needs.
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def is_distributed() -> bool:
    """A process group exists and has more than one rank (otherwise every reduction is the identity)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def device_for_backend(backend: str, local_rank: int) -> torch.device:
    """Where a tensor handed to a group of ``backend`` must live: this rank's accelerator, or the host.

    ``backend`` as ``dist.get_backend`` spells it, including the mixed form ``"cpu:gloo,cuda:nccl"``
    (which takes both; accelerator tensors are the ones every part of it accepts).
    """
    for name, device_type in _ACCELERATOR_BACKENDS.items():
        if name in backend:
            return torch.device(device_type, local_rank)
    return torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """:func:`device_for_backend` of ``group`` (default: the default process group)."""
    return device_for_backend(str(dist.get_backend(group)), local_rank())


def to_collective_device(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` where ``group``'s backend can take it (the same tensor when it already is there).

    The one place a tensor is placed for a collective; tests replace it to check placements.
    """
    return t.to(collective_device(group))


def _op(name: str):
    if name not in _OPS:
        raise ValueError(f"op must be one of {', '.join(_OPS)}, got {name!r}")
    return getattr(dist.ReduceOp, _OPS[name])


def all_reduce_(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Reduce ``t`` over ranks in place (wherever it lives) and return it; a no-op on one rank. A NaN on any rank
    makes the max (or min) NaN on every rank, under every backend (:func:`_extreme_keeping_nan_`)."""
    reduce_op = _op(op)
    if not is_distributed():
        return t
    if op != "sum" and t.is_floating_point():
        return _extreme_keeping_nan_(t, op, group)
    staged = to_collective_device(t, group)
    dist.all_reduce(staged, op=reduce_op, group=group)
    if staged is not t:
        t.copy_(staged)
    return t


def _extreme_keeping_nan_(t: torch.Tensor, op: str, group=None) -> torch.Tensor:
    """``t``'s elementwise max (or min) over ranks in place, NaN where a rank has NaN, as ``torch.max`` gives it.

    The backends' own MAX does not say so: NCCL's is ``fmax``, which drops a NaN wherever another rank has a
    number, and gloo's keeps or drops it by rank order. So a NaN (a rank's engine logprobs, a metric) would vanish
    on a GPU run that a CPU test saw. One collective: the values (NaN as the identity, negated for a min) and
    their NaN flags, in one MAX."""
    sign = 1.0 if op == "max" else -1.0
    flat = t.detach().reshape(-1)
    nan = torch.isnan(flat)
    staged = to_collective_device(torch.cat([torch.where(nan, float("-inf"), flat * sign), nan.to(flat.dtype)]), group)
    dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=group)
    n = flat.numel()
    t.copy_(torch.where(staged[n:] > 0, float("nan"), staged[:n] * sign).reshape(t.shape))
    return t


def reduce_floats(values: list[float], op: str = "sum") -> list[float]:
    """Python floats reduced over ranks in one float64 collective (one copy each way on a GPU)."""
    if not is_distributed() or not values:
        return [float(v) for v in values]
    with host_read(f"floats reduced over the ranks ({op})"):  # on NCCL: reduced on the device, copied back
        return all_reduce_(torch.tensor(values, dtype=torch.float64), op).tolist()


def _flag(flag) -> torch.Tensor:
    if isinstance(flag, torch.Tensor):  # a device-side flag (or flags): reduced where it is, read once
        return flag.detach().to(torch.int32)
    return torch.tensor(1 if flag else 0, dtype=torch.int32)


def all_ranks_flag(flag) -> torch.Tensor:
    """``flag`` (a bool, or a tensor of flags) AND-ed over ranks, elementwise, as int32 where it lives: no host
    read (a collective when distributed; on NCCL it stays on the device)."""
    return all_reduce_(_flag(flag).clone(), "min")


def any_rank_true(flag) -> bool:
    """``flag`` (a bool, or a 0-dim tensor on any device) OR-ed over ranks; collective when distributed."""
    with host_read("a flag OR-ed over the ranks"):
        return bool(all_reduce_(_flag(flag).clone(), "max").item())


def all_ranks_true(flag) -> bool:
    """``flag`` AND-ed over ranks, so every rank takes the same branch; collective when distributed."""
    with host_read("a flag AND-ed over the ranks"):
        return bool(all_ranks_flag(flag).item())


def gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank: two all_gathers (sizes, then padded bytes)
    of tensors placed for the backend, where ``all_gather_object`` would pickle through whatever
    device is current."""
    if not is_distributed():
        return [data]
    n = world_size()
    size = to_collective_device(torch.tensor([len(data)], dtype=torch.int64))
    sizes = [to_collective_device(torch.zeros(1, dtype=torch.int64)) for _ in range(n)]
    dist.all_gather(sizes, size)
    with host_read("the sizes of the ranks' gathered bytes"):
        lengths = [int(v) for v in torch.cat(sizes).tolist()]
    width = max(max(lengths), 1)
    payload = torch.zeros(width, dtype=torch.uint8)
    if data:
        payload[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    payload = to_collective_device(payload)
    parts = [to_collective_device(torch.zeros(width, dtype=torch.uint8)) for _ in range(n)]
    dist.all_gather(parts, payload)
    with host_read("the ranks' gathered bytes"):
        return [p[:k].cpu().numpy().tobytes() for p, k in zip(parts, lengths, strict=True)]


def gather_padded(values: torch.Tensor, fill: float) -> torch.Tensor:
    """The 1-D ``values`` of every rank, in rank order, each padded with ``fill`` to the longest rank's, on
    ``values``' device (the same tensor on every rank). One host read: the longest length, to size the buffers."""
    if not is_distributed():
        return values
    width = int(reduce_floats([float(values.numel())], "max")[0])
    padded = torch.full((width,), fill, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    staged = to_collective_device(padded)
    parts = [torch.empty_like(staged) for _ in range(world_size())]
    dist.all_gather(parts, staged)
    return torch.cat(parts).to(values.device)


def agreed(exc: BaseException) -> BaseException:
    """``exc``, marked as raised alike on every rank (a check whose verdict the ranks shared through a collective,
    e.g. :func:`gather_bytes`): the command line says it once, on rank 0, where an unmarked error is said by each
    rank that raised it, naming the rank (``fastrlhf.cli``). Usage: ``raise comm.agreed(DataError(problems))``."""
    exc.agreed = True
    return exc


def is_agreed(exc: BaseException) -> bool:
    """Whether :func:`agreed` marked ``exc``."""
    return getattr(exc, "agreed", False) is True


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value averaged over ranks (keys must be the same on every rank)."""
    if not is_distributed() or not values:
        return dict(values)
    keys = sorted(values)
    summed = reduce_floats([float(values[k]) for k in keys], "sum")
    return {k: s / world_size() for k, s in zip(keys, summed, strict=True)}


def barrier() -> None:
    """Wait for every rank; on NCCL on this rank's own device (not whichever device is current)."""
    if not is_distributed():
        return
    device = collective_device()
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def agree_on_failure(call: Callable[[], object], error_type: type):
    """``call()`` on every rank (a collective: call it on every rank). An ``error_type`` raised on any rank is raised
    on every rank, with the first failing rank's message and exit code, so that no rank is left waiting in the next
    collective and every rank ends the same way: one small all-reduce of the ranks' failure flags each call, and on
    a failure one gather of the failing ranks' messages. ``error_type``: a
    :class:`fastrlhf.engine.guards.AgreedStepFailure`."""
    from fastrlhf.distributed.ranks import rank, world_size

    world, me = world_size() if is_distributed() else 1, rank() if is_distributed() else 0
    error, result = None, None
    try:
        result = call()
    except error_type as exc:
        error = exc
    codes = reduce_floats([float(error.exit_code if error is not None and r == me else 0) for r in range(world)],
                          "max")
    if not any(codes):
        return result
    if world == 1:
        raise error
    mine = b"" if error is None else json.dumps([error.summary, error.user_traceback, error.exit_code]).encode()
    first = next(p for p in gather_bytes(mine) if p)
    summary, user_traceback, exit_code = json.loads(first)
    if error is not None and error.summary == summary:
        raise error
    raise error_type(summary, local=False, exit_code=exit_code, user_traceback=user_traceback)
