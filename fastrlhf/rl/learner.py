"""One interface over "a model that learns": a DeepSpeed engine, or a plain module + torch optimizer.

The update loop calls, per micro-batch, ``backward(loss)`` then ``step()`` (DeepSpeed's contract:
the loss is divided by the accumulation count, and only every ``grad_accum``-th ``step()`` runs the
optimizer, after gradient clipping). :class:`TorchLearner` implements the same contract for plain
modules, so the RL step runs unchanged single-process without DeepSpeed (tests, debugging).
"""

from __future__ import annotations

import math

import torch

__all__ = ["TorchLearner", "DeepSpeedLearner", "as_learner"]


class TorchLearner:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_accum: int = 1,
                 max_grad_norm: float = 0.0, scheduler=None):
        self.module = module
        self.optimizer = optimizer
        self.grad_accum = int(grad_accum)
        self.max_grad_norm = float(max_grad_norm or 0.0)
        self.scheduler = scheduler
        self.micro_steps = 0
        self.last_grad_norm: float | None = None
        self._poisoned = False

    def is_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> bool:
        """Count a micro-batch; at the accumulation boundary clip, step and zero. True if it stepped."""
        stepped = self.is_boundary()
        if stepped and self._poisoned:
            # A non-finite loss in this minibatch: drop its gradients, leave the parameters alone.
            self.optimizer.zero_grad(set_to_none=True)
            self._poisoned = False
            self.last_grad_norm = None
            stepped = False
        elif stepped:
            params = [p for p in self.module.parameters() if p.grad is not None]
            max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.micro_steps += 1
        return stepped

    def note_bad_loss(self) -> None:
        """A micro-batch of the current minibatch had a non-finite loss (on some rank): skip its update."""
        self._poisoned = True

    def grad_norm(self) -> float | None:
        return self.last_grad_norm


class DeepSpeedLearner:
    """A DeepSpeed engine configured with ``gradient_accumulation_steps = grad_accum``."""

    def __init__(self, engine, guard=None):
        self.engine = engine
        self.guard = guard if guard is not None else getattr(engine.optimizer, "guard", None)
        self.module = engine.module
        self.grad_accum = engine.gradient_accumulation_steps()

    def is_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> bool:
        stepped = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        return stepped

    def note_bad_loss(self) -> None:
        # The engine's optimizer must be a GuardedAdamW with ``guard`` (fastrlhf.distributed
        # builds it so): it then skips the update at the boundary on every rank and drops the
        # gradients, under every ZeRO stage.
        if self.guard is None:
            raise RuntimeError("a non-finite loss reached a DeepSpeed engine built without a StepGuard; "
                               "build it with fastrlhf.distributed.build_train_engine(..., guard=...)")
        self.guard.check_loss(float("nan"))  # the guard's public way to say "this step's loss was bad"

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)


def as_learner(obj, optimizer=None, grad_accum: int = 1, max_grad_norm: float = 0.0, guard=None):
    """Wrap a DeepSpeed engine, or a module + optimizer, in the learner interface (learners pass through)."""
    if isinstance(obj, (TorchLearner, DeepSpeedLearner)):
        return obj
    if any(cls.__name__ == "DeepSpeedEngine" for cls in type(obj).__mro__):
        return DeepSpeedLearner(obj, guard)
    if optimizer is None:
        raise ValueError("a plain module needs an optimizer to learn")
    return TorchLearner(obj, optimizer, grad_accum, max_grad_norm)
