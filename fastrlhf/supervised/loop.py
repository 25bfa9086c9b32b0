"""The training loop shared by ``fastrlhf sft`` and ``fastrlhf rm``: DeepSpeed engine, guarded steps,
metrics, atomic checkpoints with exact resume, and a final Hugging Face export.

The command-specific parts (data, model, loss) come in as a :class:`SupervisedJob`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fastrlhf import distributed as D
from fastrlhf.config import check_world_size, config_to_dict
from fastrlhf.config.precision import apply_matmul_precision
from fastrlhf.data import EpochSampler, balanced_shard, shard
from fastrlhf.distributed import comm
from fastrlhf.engine.deepspeed import build_train_engine, deepspeed_config
from fastrlhf.engine.guards import StepGuard
from fastrlhf.engine.loop import resume_step, run_steps
from fastrlhf.engine.metrics import MetricsLogger
from fastrlhf.rl.update import DeepSpeedLearner
from fastrlhf.sequences.packing import fixed_count_groups, micro_batch_plan, token_budget_groups
from fastrlhf.supervised.evaluation import EVAL_LINE_KEYS, Evaluator, is_eval_step

__all__ = ["SupervisedJob", "build_evaluator", "run_supervised", "seed_everything", "engine_config", "micro_batch_size",
           "micro_batches", "rank_examples", "rank_weight", "train_on_batch"]


@dataclass
class SupervisedJob:
    """A command's data, model and loss for :func:`run_supervised`.

    ``loss_fn(engine, examples, scale) -> (loss, {metric: float})``: ``scale`` x the SUM of the loss over
    the micro-batch's ``examples`` (``scale`` is 1 / :func:`rank_weight`, the step's total ``weight_of`` over
    the ranks, so that the micro-batches' losses, averaged over the ranks, add up to the step's mean whatever
    the split), and metrics summed over those examples (those named in ``mean_metrics`` are then divided by the
    batch's examples; every ``loss_fn`` result has each of them).
    ``eval_examples``: held-out examples (``data.eval_path``) evaluated every ``trainer.eval_every`` steps
    (:mod:`fastrlhf.supervised.evaluation`); ``perplexity``: the loss is a token-mean negative log-likelihood, whose
    exp is logged too.
    ``token_parts(example, packed)``: the token counts a micro-batch pays for the example (see
    ``fastrlhf.sequences.packing.group_cost``; ``rows_per_item`` rows per example when padded), for
    ``trainer.max_tokens_per_microbatch``.
    """

    examples: list
    model: torch.nn.Module
    loss_fn: Callable
    bar_keys: tuple = ("loss",)
    weight_of: Callable = lambda example: 1.0
    token_parts: Callable | None = None
    rows_per_item: int = 1
    mean_metrics: tuple = ()
    eval_examples: list | None = None
    perplexity: bool = False
    # fn(engine) on every rank once the last step is done, before the export (with trainer.save_final): what the
    # exported config.json records of the final weights (fastrlhf rm: its scores' mean and std)
    before_export: Callable | None = None


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def micro_batch_size(config) -> int:
    """Examples per rank per micro-step; the global batch must split evenly over ranks x grad_accum."""
    t, world = config.trainer, D.world_size()
    check_world_size(config, world)
    return t.batch_size // (world * t.grad_accum)


def engine_config(config) -> dict:
    """The DeepSpeed config the training engine will get (models load partitioned from it under ZeRO-3)."""
    t = config.trainer
    return deepspeed_config(config.deepspeed, micro_batch_size(config), t.grad_accum, t.max_grad_norm)


def micro_batches(job: SupervisedJob, batch: list, micro: int, max_tokens: int | None, packed: bool,
                  agree: bool = True) -> list[list[int]]:
    """The micro-batches of a rank's step batch (positions in it): ``micro`` examples at a time, or by
    the token budget, as many on every rank (ZeRO's collectives run once per micro-batch). ``agree`` false: the
    batch's own plan, no collective (for a caller that knows every rank's batch and evens the counts itself)."""
    if max_tokens is None:
        return fixed_count_groups(len(batch), micro)
    if job.token_parts is None:
        raise ValueError("trainer.max_tokens_per_microbatch: this command cannot count its examples' tokens")
    parts = [tuple(job.token_parts(e, packed)) for e in batch]
    if not agree:
        return token_budget_groups(parts, max_tokens, packed, job.rows_per_item)
    return micro_batch_plan([parts], micro, max_tokens, packed, job.rows_per_item)[0]


def rank_examples(job: SupervisedJob, indices: list[int], balance: bool, rank: int, world: int) -> list:
    """This rank's examples of a step's sampled ``indices``: dealt by their real tokens
    (``trainer.balance_ranks``; :func:`fastrlhf.data.balanced_shard`), else a contiguous slice."""
    if balance and job.token_parts is not None:
        lengths = [sum(job.token_parts(job.examples[j], True)) for j in indices]
        indices = balanced_shard(indices, lengths, rank, world)
    else:
        indices = shard(indices, rank, world)
    return [job.examples[j] for j in indices]


def rank_weight(job: SupervisedJob, indices: list[int], world: int) -> float:
    """What a rank's losses divide by: the total ``weight_of`` the step's sampled ``indices`` (every rank's
    examples: all ranks sample the same ones, so no collective) over the ranks. The engine averages the ranks'
    gradients, which are then those of the step's mean over all its examples (SFT: over every rank's trained
    tokens, as TRL's ``average_tokens_across_devices``). A rank's own weight would give the mean of the ranks'
    means instead, where a token of a rank that drew short responses weighs more than one of a rank of long ones."""
    return sum(job.weight_of(job.examples[j]) for j in indices) / max(world, 1)


def train_on_batch(job: SupervisedJob, learner, batch: list, micro: int, max_tokens: int | None,
                   packed: bool, weight: float | None = None) -> dict[str, float]:
    """One optimizer step on a rank's ``batch``: its micro-batches' losses, backward, the guarded step.
    ``weight``: what the losses divide by (:func:`rank_weight`; None: the batch's own, one rank).
    Returns the step's metrics summed over the batch (``job.mean_metrics`` averaged over its examples).

    Losses and metrics stay on the model's device until the optimizer step, whose guard decision
    brings them to the host in its one read (``fastrlhf.engine.guards``)."""
    guard, model = learner.guard, getattr(learner, "engine", learner.module)
    scale = 1.0 / max(sum(job.weight_of(e) for e in batch) if weight is None else weight, 1e-12)
    groups = micro_batches(job, batch, micro, max_tokens, packed)
    sums: dict = {}
    for index, group in enumerate(groups):
        loss, stats = job.loss_fn(model, [batch[i] for i in group], scale)
        guard.note_loss(loss)  # a bad loss on any rank: the optimizer drops this step's gradients
        for key, value in {"loss": loss.detach(), **stats}.items():
            sums[key] = sums[key] + value if key in sums else value
        boundary = index == len(groups) - 1
        if boundary:
            guard.carry({f"step/{key}": value for key, value in sums.items()})
        learner.backward(loss, boundary=boundary)
        learner.step()
    sums = {key[len("step/"):]: value for key, value in guard.carried().items() if key.startswith("step/")}
    for key in job.mean_metrics:
        if key in sums:
            sums[key] /= max(len(batch), 1)
    return sums


def build_evaluator(job: SupervisedJob, trainer, micro: int, rank: int, world: int) -> Evaluator | None:
    """The evaluation of ``job.eval_examples`` (None without them) in the micro-batches ``trainer`` plans a step's
    batch in, dealt to the ranks as a step's batch is."""
    if not job.eval_examples:
        return None
    held_out = replace(job, examples=job.eval_examples)

    def plan(batch: list) -> list[list[int]]:
        return micro_batches(held_out, batch, micro, trainer.max_tokens_per_microbatch, trainer.packing, agree=False)

    return Evaluator(held_out, plan, trainer.balance_ranks, rank, world)


def run_supervised(config, job: SupervisedJob, resume: bool = False) -> dict:
    """Train ``job`` for ``config.trainer.max_steps`` optimizer steps; returns the last step's metrics."""
    t = config.trainer
    world = D.world_size()
    micro = micro_batch_size(config)

    guard = StepGuard(t.max_skipped_steps)
    apply_matmul_precision(config)
    engine = build_train_engine(job.model, config.deepspeed, lr=t.lr, weight_decay=t.weight_decay,
                                warmup_steps=t.warmup_steps, micro_batch_size=micro, grad_accum=t.grad_accum,
                                max_grad_norm=t.max_grad_norm, guard=guard, lr_schedule=t.lr_schedule,
                                total_steps=t.max_steps, min_lr_ratio=t.min_lr_ratio, betas=tuple(t.adam_betas),
                                eps=t.adam_eps)
    sampler = EpochSampler(len(job.examples), seed=config.seed)
    stateful = {"model": engine, "sampler": sampler, "guard": guard}

    start_step = resume_step(config.output_dir, stateful, resume, config)
    logger = MetricsLogger(config.output_dir, t.max_steps, start_step, bar_keys=job.bar_keys,
                           line_keys=[*((k, k) for k in job.bar_keys), ("tokens/s", "tokens_per_second"),
                                      ("s/step", "step_time_s"), *((k, k) for k in EVAL_LINE_KEYS)],
                           tensorboard=t.tensorboard, wandb=t.wandb, wandb_project=t.wandb_project,
                           wandb_run_name=t.wandb_run_name, run_config=config_to_dict(config), resume=resume)
    engine.train()

    learner = DeepSpeedLearner(engine, guard)
    evaluate = build_evaluator(job, t, micro, D.rank(), world)

    def one_step(step: int) -> dict:
        started = time.perf_counter()
        indices = sampler.next_indices(t.batch_size)
        batch = rank_examples(job, indices, t.balance_ranks, D.rank(), world)
        sums = train_on_batch(job, learner, batch, micro, t.max_tokens_per_microbatch, t.packing,
                              weight=rank_weight(job, indices, world))
        skipped = guard.end_step()
        grad_norm = learner.grad_norm() if not skipped else None
        metrics = comm.mean_over_ranks(sums)
        step_time = time.perf_counter() - started
        metrics.update(lr=engine.get_lr()[0], skipped=int(skipped), skipped_total=guard.skipped_total,
                       step_time_s=step_time)
        if "response_tokens" in metrics:  # SFT: the mean over ranks of each rank's tokens
            metrics["tokens_per_second"] = float(metrics["response_tokens"]) * world / max(step_time, 1e-9)
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        if evaluate is not None and is_eval_step(step, t.eval_every, t.max_steps):
            # Inside the step, before its checkpoint: a run resumed from that checkpoint does not evaluate it again.
            started = time.perf_counter()
            metrics.update(evaluate(engine))
            metrics["time/eval"] = time.perf_counter() - started  # run_steps logs a step with eval/* figures
        if step == t.max_steps and t.save_final and job.before_export is not None:
            job.before_export(engine)
        return metrics

    if start_step >= t.max_steps and t.save_final and job.before_export is not None:  # resumed to export only
        job.before_export(engine)
    return run_steps(config, one_step, start_step=start_step, stateful=stateful, logger=logger, guard=guard,
                     skip_reason="non-finite loss or gradient", export_engine=engine)
