"""The process group: joined once per process, with a timeout, the same under every launcher.

Works the same under ``deepspeed``/``torchrun`` (which set RANK, WORLD_SIZE, ...) and as a bare
``python -m fastrlhf`` (one rank; the rendezvous variables are filled in here).
"""

from __future__ import annotations

import os
from datetime import timedelta

from fastrlhf.distributed.ranks import DEFAULT_TIMEOUT_S, free_port, local_rank, rank

__all__ = ["DEFAULT_TIMEOUT_S", "before_group", "clear_stale_build_lock", "discard_before_group", "init_distributed",
           "run_before_group"]

# Rank 0's work on the shared output_dir that no other rank may race (``--overwrite`` removing an earlier run):
# run once every rank has passed its checks at the start gate, before the process group starts. Until the
# group is up no rank writes into output_dir, and every other rank waits for rank 0 in the rendezvous.
_before_group: list = []


def before_group(fn) -> None:
    """Run ``fn()`` in :func:`init_distributed` on rank 0, after the start gate and before the process group."""
    _before_group.append(fn)


def run_before_group() -> None:
    """Run (and forget) what :func:`before_group` registered, in order."""
    while _before_group:
        _before_group.pop(0)()


def discard_before_group() -> None:
    """Forget what :func:`before_group` registered (the command ended before its process group started)."""
    _before_group.clear()



def init_distributed(timeout_s: float | None = None, shared_dir: str | None = None) -> None:
    """Join (or, alone, create) the default process group; idempotent.

    First every rank passes the start gate (``fastrlhf.distributed.multinode.start_gate``): a rank that failed
    its checks on another node stops this one here, with its error line. ``shared_dir`` (the run's
    ``output_dir``): once the group is up, check that every node sees it as the same folder.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if timeout_s is None:
        timeout_s = float(os.environ.get("FASTRLHF_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    import torch

    from fastrlhf.distributed import multinode

    multinode.start_gate(timeout_s=timeout_s)
    if rank() == 0:  # every rank passed its checks; none has joined the group, so none writes yet
        run_before_group()
    else:
        discard_before_group()
    if torch.cuda.is_available():
        # Before the first collective: NCCL (and ``barrier``) otherwise put every rank's traffic,
        # and a CUDA context, on device 0.
        torch.cuda.set_device(local_rank())
    else:
        clear_stale_build_lock("deepspeed_shm_comm")
    import deepspeed

    try:
        deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
    finally:
        multinode.release_gate_store()
    _unlink_shm_buffers()
    if shared_dir is not None:
        multinode.check_shared_dir(shared_dir)


def _unlink_shm_buffers() -> None:
    """Remove the names of DeepSpeed's CPU shared-memory all-reduce buffers once every rank has mapped them.

    DeepSpeed (0.19) creates one 66 MiB ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``
    per rank when all ranks are on one host (``LOCAL_SIZE`` = the world size, one rank included: the
    launcher with one process) and never unlinks it: every such run, finished or killed, left its buffers in
    /dev/shm (RAM) for good. Each rank maps every buffer inside ``init_distributed``; after a barrier the
    names are no longer needed and the mappings stay valid.
    """
    import torch

    from fastrlhf.distributed import comm

    if torch.cuda.is_available():
        return
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{rank()}")
    comm.barrier()
    try:
        os.remove(name)
    except FileNotFoundError:  # not a single-host CPU run, or DeepSpeed's shm op not built
        pass


# DeepSpeed JIT-builds its CPU shared-memory collective on the first init_distributed (30-60 s on 2
# cores). torch's build lock outlives a process killed mid-build, and every later run then waits on
# it forever, before any timeout of ours applies.
STALE_BUILD_LOCK_S = 600


def clear_stale_build_lock(extension: str, max_age_s: float = STALE_BUILD_LOCK_S) -> bool:
    """Remove the torch-extension build lock of ``extension`` when it is older than any real build;
    returns whether one was removed."""
    import sys
    import time

    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(extension, verbose=False), "lock")
        age = time.time() - os.path.getmtime(lock)
    except (ImportError, OSError):
        return False
    if age < max_age_s:
        return False
    try:
        os.remove(lock)
    except FileNotFoundError:  # another rank removed it first
        return False
    print(f"warning: removed a stale build lock ({lock}, {age / 60:.0f} min old) left by an interrupted run",
          file=sys.stderr)
    return True
