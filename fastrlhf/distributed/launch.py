"""The process group: joined once per process, with a timeout, the same under every launcher.

Works the same under ``deepspeed``/``torchrun`` (which set RANK, WORLD_SIZE, ...) and as a bare
``python -m fastrlhf`` (one rank; the rendezvous variables are filled in here).
"""

from __future__ import annotations

import os
from datetime import timedelta

from fastrlhf.distributed.ranks import DEFAULT_TIMEOUT_S, free_port, local_rank, rank

__all__ = ["DEFAULT_TIMEOUT_S", "before_group", "discard_before_group", "init_distributed",
           "run_before_group"]

# Rank 0's work on the shared output_dir that no other rank may race (``--overwrite`` moving an earlier run aside):
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

    from fastrlhf.distributed import multinode

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:
        if problem := _unset_rank_problem():
            error = multinode.NodeError(problem)
            error.exit_code, error.local = 2, True
            raise error
        # A port of its own, not one inherited from the shell or a launched parent: two one-rank runs on a node
        # would both bind it (EADDRINUSE), and nothing outside this process needs to find it.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    elif problem := _missing_launch_problem():
        error = multinode.NodeError(problem)
        error.exit_code, error.local = 2, True
        raise error
    import torch

    problem = multinode.timeout_problem() if timeout_s is None else None
    timeout_s = multinode.dist_timeout_s(timeout_s)
    if problem := problem or _gpu_problem():  # said by rank 0 too, not only as this rank's traceback
        multinode.start_gate(failure=problem, timeout_s=timeout_s)
        error = multinode.NodeError(problem)
        error.exit_code, error.local = 2, True
        raise error
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
        _no_shm_comm_op()
    import deepspeed

    _new_groups_take_timeout(timedelta(seconds=timeout_s))
    try:
        deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
    finally:
        multinode.release_gate_store()
    if shared_dir is not None:
        multinode.check_shared_dir(shared_dir)


# Launchers that start every process of a job but say so in variables of their own, not RANK and WORLD_SIZE.
_OTHER_LAUNCHERS = {"SLURM_STEP_NUM_TASKS": "srun", "OMPI_COMM_WORLD_SIZE": "mpirun (Open MPI)",
                    "PMI_SIZE": "mpirun (MPICH, Intel MPI)"}


def _unset_rank_problem() -> str | None:
    """Why this process, without RANK, must not run as rank 0 of 1, or None. Under ``srun -n 8`` or ``mpirun -np 8``
    (also DeepSpeed's ``--launcher slurm`` and its MPI launchers, which leave RANK to ``deepspeed.init_distributed``'s
    mpi4py discovery, after the start gate that needs it) each of the 8 would: 8 copies of the whole job, all on
    GPU 0 (LOCAL_RANK 0), writing one output_dir."""
    for name, launcher in _OTHER_LAUNCHERS.items():
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return (f"distributed error: {launcher} started {value} processes ({name}={value}) but set no RANK, "
                    "so each would run the whole job alone, as rank 0 of 1 on GPU 0: start the ranks with "
                    "`deepspeed` (a hostfile, or --no_ssh on each node; not --launcher slurm or an MPI launcher) or "
                    "`torchrun`, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each process "
                    "(for separate runs, one per process: RANK=0 and WORLD_SIZE=1)")
    return None


# What a launcher sets beside RANK (``deepspeed`` and ``torchrun`` set them all).
_LAUNCH_VARIABLES = ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _missing_launch_problem() -> str | None:
    """Why a process with RANK cannot join its group, or None: a launch variable is unset. Without one,
    DeepSpeed's ``init_distributed`` (0.19) takes the launch for an MPI one and asks mpi4py: "No module named
    'mpi4py'", or, with mpi4py installed, a world of one process outside ``mpirun``, so that the rank silently
    runs the whole job alone as rank 0 of 1; and the start gate needs MASTER_ADDR and MASTER_PORT."""
    missing = [name for name in _LAUNCH_VARIABLES if not os.environ.get(name)]
    if not missing:
        return None
    return (f"distributed error: RANK is set ({os.environ['RANK']}) but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: a launched rank needs RANK, WORLD_SIZE, LOCAL_RANK (its "
            "number on its node: 0 with one process per node), MASTER_ADDR and MASTER_PORT; start the ranks with "
            "`deepspeed` or `torchrun`, which set them all, or set the missing ones for each process")


def _new_groups_take_timeout(timeout: timedelta) -> None:
    """Make ``timeout`` the default of every process group created later without one.

    ``dist.new_group`` does not inherit the world group's timeout: it takes torch's default (10 min for NCCL,
    30 for gloo). ZeRO's collectives (gradient reduce-scatter, ZeRO-3 gathers) all run on such a group,
    DeepSpeed's clone of the world (``deepspeed.utils.groups._clone_world_group``), as do vLLM's groups; so
    ``FASTRLHF_DIST_TIMEOUT`` would hold only for fastrlhf's own collectives. ``new_group`` reads these two
    module values at each call.
    """
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def _gpu_problem() -> str | None:
    """Why this rank cannot use GPU ``LOCAL_RANK``, or None (also without CUDA).

    DeepSpeed (0.19: ``DeepSpeedEngine._set_distributed_vars``) puts each rank on the GPU numbered by its
    local rank among the GPUs it sees, and so does fastrlhf. A launcher that shows each rank only its own GPU
    (SLURM's ``--gpus-per-task``, ``CUDA_VISIBLE_DEVICES`` set per rank) leaves rank 3 of a node one GPU,
    numbered 0: ``set_device(3)`` fails with CUDA's "invalid device ordinal" on that rank alone.
    """
    import torch

    if not torch.cuda.is_available() or local_rank() < torch.cuda.device_count():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
    return (f"distributed error: LOCAL_RANK is {local_rank()} but this rank sees {torch.cuda.device_count()} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={visible}): each rank uses the GPU numbered LOCAL_RANK, so every rank of a "
            "node must see all of the node's GPUs (under SLURM: --gpus-per-node, not --gpus-per-task)")


def _no_shm_comm_op() -> None:
    """Keep DeepSpeed from building and starting its CPU shared-memory all-reduce (``deepspeed_shm_comm``).

    Only ``inference_all_reduce`` (DeepSpeed's AutoTP inference) uses it: ZeRO's collectives are
    torch.distributed's (gloo) with or without it. Left alone, DeepSpeed's ``init_distributed`` (0.19)
    JIT-compiles it on a machine's first run (17-30 s of g++ on 2 cores, under a torch build lock that a run
    killed mid-build leaves behind, to hang every later run), then maps a 66 MiB
    ``/dev/shm/deepspeed_allreduce_buffer_*`` per rank that it never unlinks. DeepSpeed builds only the ops
    its ``__compatible_ops__`` marks compatible, a dict kept for the process.
    """
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
