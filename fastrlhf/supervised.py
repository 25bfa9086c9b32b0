"""The training loop shared by ``fastrlhf sft`` and ``fastrlhf rm``: DeepSpeed engine, guarded steps,
metrics, atomic checkpoints with exact resume, and a final Hugging Face export.

The command-specific parts (data, model, loss) come in as a :class:`Task`.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastrlhf import distributed as D
from fastrlhf.checkpoint import load_latest, save_checkpoint
from fastrlhf.config import ConfigError, config_to_dict
from fastrlhf.data import EpochSampler, shard
from fastrlhf.distributed import build_train_engine
from fastrlhf.guards import StepGuard, TooManySkippedSteps
from fastrlhf.metrics import MetricsLogger
from fastrlhf.modeling import export_hf

__all__ = ["Task", "run_supervised", "seed_everything", "engine_config", "micro_batch_size"]


@dataclass
class Task:
    examples: list
    model: torch.nn.Module
    # (engine, examples of one micro-batch) -> (loss tensor, {metric: float}) -- metrics averaged over micro-batches
    loss_fn: Callable
    bar_keys: tuple = ("loss",)


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _mean_over_ranks(values: dict) -> dict:
    if D.world_size() == 1 or not values:
        return values
    import torch.distributed as dist

    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: (t[i] / D.world_size()).item() for i, k in enumerate(keys)}


def micro_batch_size(config) -> int:
    """Examples per rank per micro-step; the global batch must split evenly over ranks x grad_accum."""
    t, world = config.trainer, D.world_size()
    if t.batch_size % (world * t.grad_accum):
        raise ConfigError("trainer.batch_size", f"{t.batch_size} does not split over {world} ranks x "
                          f"trainer.grad_accum {t.grad_accum}")
    return t.batch_size // (world * t.grad_accum)


def engine_config(config) -> dict:
    """The DeepSpeed config the training engine will get (models load partitioned from it under ZeRO-3)."""
    t = config.trainer
    return D.deepspeed_config(config.deepspeed, micro_batch_size(config), t.grad_accum, t.max_grad_norm)


def _write_run_config(config) -> None:
    """The fully resolved config (defaults and --set applied) beside the run's outputs."""
    import yaml

    os.makedirs(config.output_dir, exist_ok=True)
    path = os.path.join(config.output_dir, "config.yaml")
    with open(f"{path}.tmp", "w") as f:
        yaml.safe_dump(config_to_dict(config), f, sort_keys=False)
    os.replace(f"{path}.tmp", path)


def run_supervised(config, task: Task, resume: bool = False) -> dict:
    """Train ``task`` for ``config.trainer.max_steps`` optimizer steps; returns the last step's metrics."""
    t = config.trainer
    world = D.world_size()
    micro = micro_batch_size(config)

    guard = StepGuard(t.max_skipped_steps)
    engine = build_train_engine(task.model, config.deepspeed, lr=t.lr, weight_decay=t.weight_decay,
                                warmup_steps=t.warmup_steps, micro_batch_size=micro, grad_accum=t.grad_accum,
                                max_grad_norm=t.max_grad_norm, guard=guard)
    sampler = EpochSampler(len(task.examples), seed=config.seed)
    stateful = {"model": engine, "sampler": sampler, "guard": guard}

    start_step = 0
    if resume:
        restored = load_latest(config.output_dir, stateful)
        if restored is None:
            print(f"note: --resume given but {config.output_dir} has no checkpoint; starting at step 0")
        else:
            start_step = restored["step"]
    if D.is_main():
        _write_run_config(config)
    logger = MetricsLogger(config.output_dir, t.max_steps, start_step, bar_keys=task.bar_keys,
                           tensorboard=t.tensorboard, wandb=t.wandb, run_config=config_to_dict(config),
                           resume=resume)
    engine.train()
    metrics: dict = {}
    try:
        for step in range(start_step + 1, t.max_steps + 1):
            started = time.perf_counter()
            local = shard(sampler.next_indices(t.batch_size), D.rank(), world)
            sums: dict = {}
            for i in range(0, len(local), micro):
                loss, stats = task.loss_fn(engine, [task.examples[j] for j in local[i:i + micro]])
                guard.check_loss(loss)
                engine.backward(loss)
                engine.step()
                for key, value in {"loss": loss.item(), **stats}.items():
                    sums[key] = sums.get(key, 0.0) + value / t.grad_accum
            try:
                skipped, stop = guard.end_step(step), None
            except TooManySkippedSteps as exc:  # log this step first, then stop
                skipped, stop = True, exc
            metrics = _mean_over_ranks(sums)
            grad_norm = engine.get_global_grad_norm()
            metrics.update(lr=engine.get_lr()[0], skipped=int(skipped), skipped_total=guard.skipped_total,
                           step_time_s=time.perf_counter() - started)
            if grad_norm is not None and not skipped:
                metrics["grad_norm"] = float(grad_norm)
            if step % t.log_every == 0 or step == t.max_steps:
                logger.log(step, metrics)
            if skipped:
                logger.message(f"step {step}: non-finite loss or gradient, update skipped "
                               f"({guard.skipped_in_row} in a row, {guard.skipped_total} in all)")
            if stop is not None:
                raise stop
            if t.save_every and step % t.save_every == 0 and step < t.max_steps:
                save_checkpoint(config.output_dir, step, stateful, keep_last=t.keep_checkpoints)
    except TooManySkippedSteps:
        save_checkpoint(config.output_dir, step, stateful, keep_last=t.keep_checkpoints)
        logger.close()
        raise
    logger.close()
    save_checkpoint(config.output_dir, t.max_steps, stateful, keep_last=t.keep_checkpoints)
    export_hf(engine, os.path.join(config.output_dir, "final"), zero_stage=config.deepspeed.zero_stage,
              tokenizer_from=config.model.path)
    return metrics
