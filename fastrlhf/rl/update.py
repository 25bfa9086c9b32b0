"""The optimisation part of a step: epochs x minibatches x accumulated micro-batches, NaN-guarded.

A learner is "a model that learns": a DeepSpeed engine, or a plain module with a torch optimizer
(:class:`TorchLearner`, so the step runs unchanged single-process without DeepSpeed). Both follow
DeepSpeed's contract, per micro-batch ``backward(loss)`` then ``step()``: the loss is divided by the
accumulation count, and only every ``grad_accum``-th ``step()`` runs the optimizer, after clipping.

:func:`run_updates` drives the actor (policy loss) and the critic (value loss) alike. Each loss
goes through the step's guard (``fastrlhf.guards``): a non-finite loss on any rank makes the
minibatch's optimizer step drop its gradients on every rank, and the update stops there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch

from fastrlhf.guards import StepGuard, grads_finite
from fastrlhf.rl.experience import Experience, split_batch

__all__ = ["DeepSpeedLearner", "TorchLearner", "UpdateResult", "as_learner", "minibatch_order", "run_updates"]


class TorchLearner:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_accum: int = 1,
                 max_grad_norm: float = 0.0, guard: StepGuard | None = None):
        self.module = module
        self.optimizer = optimizer
        self.grad_accum = int(grad_accum)
        self.max_grad_norm = float(max_grad_norm or 0.0)
        self.guard = guard if guard is not None else StepGuard()
        self.micro_steps = 0
        self.last_grad_norm: float | None = None

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> bool:
        """Count a micro-batch; at the accumulation boundary clip, step (unless the guard says skip) and
        zero the gradients. True if the optimizer stepped."""
        self.micro_steps += 1
        if self.micro_steps % self.grad_accum:
            return False
        params = [p for p in self.module.parameters() if p.grad is not None]
        stepped = not self.guard.should_skip(grads_finite(params))
        self.last_grad_norm = None
        if stepped:
            max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    def grad_norm(self) -> float | None:
        return self.last_grad_norm


class DeepSpeedLearner:
    """A DeepSpeed engine built by ``fastrlhf.distributed.build_train_engine(..., guard=guard)``: its
    GuardedAdamW asks the guard at every boundary, under every ZeRO stage."""

    def __init__(self, engine, guard: StepGuard):
        self.engine = engine
        self.guard = guard
        self.module = engine.module
        self.grad_accum = engine.gradient_accumulation_steps()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> bool:
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        return boundary and not self.guard.update_skipped

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)


def as_learner(obj, optimizer=None, grad_accum: int = 1, max_grad_norm: float = 0.0, guard: StepGuard | None = None):
    """Wrap a DeepSpeed engine, or a module + optimizer, in the learner interface (learners pass through)."""
    if isinstance(obj, (TorchLearner, DeepSpeedLearner)):
        return obj
    if any(cls.__name__ == "DeepSpeedEngine" for cls in type(obj).__mro__):
        return DeepSpeedLearner(obj, guard if guard is not None else StepGuard())
    if optimizer is None:
        raise ValueError("a plain module needs an optimizer to learn")
    return TorchLearner(obj, optimizer, grad_accum, max_grad_norm, guard)


class UpdateResult(dict):
    """Metrics of an update: losses (``loss`` and ``*_loss``) averaged over micro-batches, as the
    optimizer saw them; every other metric (a masked mean over a micro-batch's tokens) weighted by
    its micro-batch's kept tokens, i.e. the masked mean over all tokens the update saw. Plus
    ``grad_norm`` (mean over optimizer steps), ``optimizer_steps`` and ``aborted`` (a non-finite loss
    stopped the update)."""


def minibatch_order(batch_size: int, micro_batch: int, grad_accum: int, epochs: int,
                    generator: torch.Generator) -> list[list[torch.Tensor]]:
    """For each optimizer step, the row indices of its ``grad_accum`` micro-batches (reshuffled each epoch)."""
    minibatch = micro_batch * grad_accum
    steps = []
    for _ in range(epochs):
        for rows in split_batch(batch_size, batch_size // minibatch, generator, shuffle=True):
            steps.append(list(rows.view(grad_accum, micro_batch)))
    return steps


def _is_loss(name: str) -> bool:
    return name == "loss" or name.endswith("_loss")


def run_updates(learner, exp: Experience, loss_fn: Callable, order: list[list[torch.Tensor]]) -> UpdateResult:
    """``loss_fn(module, micro_exp) -> (loss, metrics)``; one optimizer step per entry of ``order``."""
    sums: dict[str, float] = defaultdict(float)
    micro_count, tokens = 0, 0.0
    grad_norms = []
    optimizer_steps = 0
    aborted = False
    for micro_rows in order:
        for rows in micro_rows:
            mb = exp.select(rows)
            loss, metrics = loss_fn(learner.module, mb)
            # A bad loss on any rank: this minibatch's remaining micro-batches still run (the
            # accumulation boundary must be reached everywhere), its optimizer step is dropped.
            aborted = not learner.guard.loss_ok(loss) or aborted
            learner.backward(loss)
            stepped = learner.step()
            if aborted:
                continue
            sums["loss"] += float(loss.detach())
            mb_tokens = float((mb.response_mask > 0).sum())
            for name, value in metrics.items():
                sums[name] += float(value) * (1.0 if _is_loss(name) else mb_tokens)
            micro_count += 1
            tokens += mb_tokens
            if stepped:
                optimizer_steps += 1
                norm = learner.grad_norm()
                if norm is not None:
                    grad_norms.append(norm)
        if aborted or learner.guard.update_skipped:  # later minibatches are not run
            aborted = True
            break
    result = UpdateResult({k: v / (max(1, micro_count) if _is_loss(k) else max(1.0, tokens)) for k, v in sums.items()})
    result["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    result["optimizer_steps"] = float(optimizer_steps)
    result["aborted"] = aborted
    return result
