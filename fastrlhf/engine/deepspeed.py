"""DeepSpeed engines built from a run config: the trained ones (a guarded AdamW, warmup) and frozen ones.

The CPU-only memory measures (a heap trim after each backward, the fp32 master partition shared with
the weights) come through the one switch :func:`fastrlhf.engine.platform.cpu_tools`.
"""

from __future__ import annotations

import copy
import functools
import math

from fastrlhf.config.precision import fp32_grad_accumulation, refuse_fp16, trained_zero_stage

__all__ = ["build_frozen_engine", "build_train_engine", "deep_merge", "deepspeed_config"]


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
    stage = (trained_zero_stage(ds) if trainable else ds.zero_stage) if zero_stage is None else zero_stage
    zero: dict = {"stage": stage}
    if trainable and ds.offload_optimizer and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_param and stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum if trainable else 1,
        "zero_optimization": zero,
        # True only when resolved so (fastrlhf.config.precision); an unresolved "auto" is off. Non-finite gradients
        # are the guard's to find (GuardedAdamW, in the step's one host read): DeepSpeed's own bf16 check
        # would read the device twice more per optimizer step (ZeRO 1-2).
        "bf16": {"enabled": ds.bf16 is True, "check_grad_overflow": False},
        # Our optimizer is a torch AdamW (no 30-45 s C++ compile); DeepSpeed refuses it under offload unless told.
        "zero_force_ds_cpu_optimizer": False,
        # GuardedAdamW is torch AdamW plus a skip check; DeepSpeed only whitelists the exact AdamW class.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer is on by default and, from the third optimizer step, synchronizes the
        # device at every forward and step it times; the trainer times its own phases.
        "timers": {"throughput": {"enabled": False}},
    }
    if trainable:
        # Always explicit: DeepSpeed's own default is to clip at 1.0, so leaving the key out would
        # clip a run that asked for no clipping.
        config["gradient_clipping"] = float(max_grad_norm or 0.0)
        if stage == 2 and fp32_grad_accumulation(ds):
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    refuse_fp16(ds.extra)  # also checked with the config: a config built in code comes here
    return deep_merge(config, ds.extra or {})


def lr_factor(step: int, warmup_steps: int = 0, schedule: str = "constant", total_steps: int | None = None,
              min_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (from 0) over the peak: linear warmup to 1 over ``warmup_steps``
    (the first step at ``1 / warmup_steps``), then ``trainer.lr_schedule`` over the rest of ``total_steps``: 1
    (constant), or from 1 down towards ``min_ratio`` at ``total_steps``, linearly (transformers' linear schedule,
    TRL's) or on a half cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps is None or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_train_engine(model, ds, lr: float, weight_decay: float = 0.0, warmup_steps: int = 0,
                       micro_batch_size: int = 1, grad_accum: int = 1, max_grad_norm: float | None = None,
                       guard=None, lr_schedule: str = "constant", total_steps: int | None = None,
                       min_lr_ratio: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
    """A trainable DeepSpeed engine (ZeRO ``ds.zero_stage``) with a guarded torch AdamW, linear warmup and the
    decay of :func:`lr_factor` over ``total_steps`` optimizer steps."""
    import deepspeed
    import torch

    from fastrlhf.engine.guards import GuardedAdamW, GuardedLambdaLR

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    half = {p.dtype for p in params} & {torch.bfloat16, torch.float16}
    if half and ds.bf16 is not True and not ds.pure_bf16:
        # The config check, again where the engine is built, for models and configs made in code.
        raise ValueError(f"the model's trainable weights are {half.pop()} and deepspeed.bf16 is off: that trains "
                         "without fp32 master weights; enable deepspeed.bf16 or set deepspeed.pure_bf16")
    # At stage 0 (in fp32: see trained_zero_stage) DeepSpeed clips with clip_grad_norm_ and throws the norm away, so
    # get_global_grad_norm() would report nothing; there the optimizer clips instead and keeps the
    # norm where the engine reads it. (Stages 1-3 and bf16 compute the norm themselves.)
    clip_in_optimizer = trained_zero_stage(ds) == 0
    optimizer = GuardedAdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, guard=guard,
                             max_grad_norm=(max_grad_norm or float("inf")) if clip_in_optimizer else None)
    scheduler = GuardedLambdaLR(optimizer, functools.partial(
        lr_factor, warmup_steps=warmup_steps, schedule=lr_schedule, total_steps=total_steps, min_ratio=min_lr_ratio),
        guard)
    config = deepspeed_config(ds, micro_batch_size, grad_accum, None if clip_in_optimizer else max_grad_norm,
                              trainable=True)
    from fastrlhf.engine.platform import cpu_tools

    cpu = cpu_tools()
    if cpu is not None:
        cpu.hostmem.trim_heap_after_backward(model)  # before the update's large buffers: see fastrlhf.cpu.hostmem
    from fastrlhf.engine.deepspeed_reads import remove_zero_step_reads

    remove_zero_step_reads()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if not clip_in_optimizer:
        # The norm DeepSpeed's wrapper computed before it calls our step (ZeRO 1-3, bf16): carried into
        # the guard's decision from there, so that reading it costs no host read of its own.
        optimizer.norm_source = lambda: getattr(engine.optimizer, "_global_grad_norm", None)
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if guard is not None and isinstance(engine.optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        from fastrlhf.engine.deepspeed_reads import guard_checks_the_norm

        guard_checks_the_norm(engine.optimizer)  # the guard judges the global norm, not DeepSpeed's own read
    if cpu is not None:
        cpu.zero_master.share_master_weights(engine.optimizer)  # fp32 weights at ZeRO 1-2: no cloned master partition
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
