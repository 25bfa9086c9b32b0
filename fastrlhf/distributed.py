"""Process group set-up, rank helpers, and DeepSpeed engines built from a run config.

Works the same under ``deepspeed``/``torchrun`` (which set RANK, WORLD_SIZE, ...) and as a bare
``python -m fastrlhf`` (one rank; the rendezvous variables are filled in here).
"""

from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta

__all__ = [
    "free_port",
    "init_distributed",
    "rank",
    "world_size",
    "local_rank",
    "is_main",
    "deepspeed_config",
    "build_train_engine",
    "build_frozen_engine",
    "deep_merge",
    "clear_stale_build_lock",
]

# Long enough for real runs; tests set FASTRLHF_DIST_TIMEOUT to turn a rank mismatch into a quick error.
DEFAULT_TIMEOUT_S = 1800


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for MASTER_PORT / the launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float | None = None, shared_dir: str | None = None) -> None:
    """Join (or, alone, create) the default process group; idempotent.

    First every rank passes the start gate (``fastrlhf.multinode.start_gate``): a rank that failed
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

    from fastrlhf import multinode

    multinode.start_gate(timeout_s=timeout_s)
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
    per rank when all ranks are on one host and never unlinks it: every such run, finished or killed,
    left its buffers in /dev/shm (RAM) for good. Each rank maps every buffer inside
    ``init_distributed``; after a barrier the names are no longer needed and the mappings stay valid.
    """
    import torch

    from fastrlhf import comm

    if torch.cuda.is_available() or world_size() < 2:
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


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else int(os.environ.get("RANK", 0))


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def deep_merge(base: dict, extra: dict) -> dict:
    """``base`` updated by ``extra``, recursing into nested mappings (``extra`` wins)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def deepspeed_config(ds, micro_batch_size: int = 1, grad_accum: int = 1, max_grad_norm: float | None = None,
                     zero_stage: int | None = None, trainable: bool = True) -> dict:
    """The DeepSpeed config dict for one engine, from the ``deepspeed:`` section (``extra`` merged last)."""
    stage = ds.zero_stage if zero_stage is None else zero_stage
    zero: dict = {"stage": stage}
    if trainable and ds.offload_optimizer and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_param and stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum if trainable else 1,
        "zero_optimization": zero,
        # True only when resolved so (fastrlhf.precision); an unresolved "auto" is off. Non-finite gradients
        # are the guard's to find (GuardedAdamW, in the step's one host read): DeepSpeed's own bf16 check
        # would read the device twice more per optimizer step (ZeRO 1-2).
        "bf16": {"enabled": ds.bf16 is True, "check_grad_overflow": False},
        # Our optimizer is a torch AdamW (no 30-45 s C++ compile); DeepSpeed refuses it under offload unless told.
        "zero_force_ds_cpu_optimizer": False,
        # GuardedAdamW is torch AdamW plus a skip check; DeepSpeed only whitelists the exact AdamW class.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if trainable:
        # Always explicit: DeepSpeed's own default is to clip at 1.0, so leaving the key out would
        # clip a run that asked for no clipping.
        config["gradient_clipping"] = float(max_grad_norm or 0.0)
    return deep_merge(config, ds.extra or {})


def _warmup(warmup_steps: int):
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return factor


def build_train_engine(model, ds, lr: float, weight_decay: float = 0.0, warmup_steps: int = 0,
                       micro_batch_size: int = 1, grad_accum: int = 1, max_grad_norm: float | None = None,
                       guard=None):
    """A trainable DeepSpeed engine (ZeRO ``ds.zero_stage``) with a guarded torch AdamW and linear warmup."""
    import deepspeed
    import torch

    from fastrlhf.guards import GuardedAdamW

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    half = {p.dtype for p in params} & {torch.bfloat16, torch.float16}
    if half and ds.bf16 is not True and not ds.pure_bf16:
        # The config check, again where the engine is built, for models and configs made in code.
        raise ValueError(f"the model's trainable weights are {half.pop()} and deepspeed.bf16 is off: that trains "
                         "without fp32 master weights; enable deepspeed.bf16 or set deepspeed.pure_bf16")
    # At stage 0 in fp32 DeepSpeed clips with clip_grad_norm_ and throws the norm away, so
    # get_global_grad_norm() would report nothing; there the optimizer clips instead and keeps the
    # norm where the engine reads it. (Stages 1-3 and bf16 compute the norm themselves.)
    clip_in_optimizer = ds.zero_stage == 0 and ds.bf16 is not True
    optimizer = GuardedAdamW(params, lr=lr, weight_decay=weight_decay, guard=guard,
                             max_grad_norm=(max_grad_norm or float("inf")) if clip_in_optimizer else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup(warmup_steps))
    config = deepspeed_config(ds, micro_batch_size, grad_accum, None if clip_in_optimizer else max_grad_norm,
                              trainable=True)
    from fastrlhf.precision import gpu_available

    if not gpu_available():
        from fastrlhf.hostmem import trim_heap_after_backward

        trim_heap_after_backward(model)  # before the update's large buffers: see fastrlhf.hostmem
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if not clip_in_optimizer:
        # The norm DeepSpeed's wrapper computed before it calls our step (ZeRO 1-3, bf16): carried into
        # the guard's decision from there, so that reading it costs no host read of its own.
        optimizer.norm_source = lambda: getattr(engine.optimizer, "_global_grad_norm", None)
    from fastrlhf.zero_master import share_master_weights

    share_master_weights(engine.optimizer)  # fp32 weights at ZeRO 1-2: no cloned master partition
    return engine


def build_frozen_engine(model, ds, actor_zero_stage: int | None = None):
    """A frozen model (reference, reward) for inference.

    ZeRO-3 inference when the actor is at stage 3 (the memory the actor saves would be wasted on a
    full replica); otherwise stage 0, since stages 1 and 2 only partition optimizer state.
    """
    import deepspeed

    model.requires_grad_(False)
    model.eval()
    stage = 3 if (actor_zero_stage if actor_zero_stage is not None else ds.zero_stage) == 3 else 0
    config = deepspeed_config(ds, zero_stage=stage, trainable=False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine
