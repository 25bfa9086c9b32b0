"""NaN/inf step guard: a bad step is skipped (no optimizer update), counted and logged.

Usage in a training step (DeepSpeed engine built with ``build_train_engine(..., guard=guard)``)::

    guard.check_loss(loss)            # before backward, once per micro-batch
    engine.backward(loss)
    engine.step()                     # GuardedAdamW skips the update if loss or any grad is non-finite
    skipped = guard.end_step(step)    # raises TooManySkippedSteps after max_skipped_steps in a row

The decision is taken inside the optimizer because that is the one place that sees the final
(reduced, clipped, possibly partitioned) gradients under every ZeRO stage; all ranks agree on it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["StepGuard", "GuardedAdamW", "TooManySkippedSteps", "is_finite"]


class TooManySkippedSteps(RuntimeError):
    #: The metrics of the step that gave up, set by the step that raised it (the loop logs them).
    metrics: dict | None = None


def is_finite(value) -> bool:
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value.detach()).all())
    return math.isfinite(float(value))


class StepGuard:
    """Counts skipped steps; ``max_skipped_in_row`` consecutive ones stop the run."""

    def __init__(self, max_skipped_in_row: int = 3):
        self.max_skipped_in_row = max_skipped_in_row
        self.skipped_total = 0
        self.skipped_in_row = 0
        self._bad_loss = False
        self._skipped_this_step = False

    def check_loss(self, loss) -> bool:
        """Note a micro-batch loss; a non-finite one makes this step's update be skipped."""
        ok = is_finite(loss)
        if not ok:
            self._bad_loss = True
        return ok

    def should_skip(self, grads_finite) -> bool:
        """Called by the optimizer with the local finiteness of its grads (a bool, or a 0-dim tensor on
        the grads' device); the answer is the same on all ranks."""
        from fastrlhf.comm import all_ranks_true

        ok = all_ranks_true(False if self._bad_loss else grads_finite)
        if not ok:
            self._skipped_this_step = True
        return not ok

    def mark_skipped(self) -> None:
        """Skip this step's update without an optimizer call (e.g. a non-finite loss seen on every rank)."""
        self._skipped_this_step = True

    def end_step(self, step: int) -> bool:
        """Close a training step; returns True if its update was skipped."""
        skipped = self._skipped_this_step or self._bad_loss
        self._bad_loss = self._skipped_this_step = False
        if skipped:
            self.skipped_total += 1
            self.skipped_in_row += 1
            if self.skipped_in_row >= self.max_skipped_in_row:
                raise TooManySkippedSteps(
                    f"stopping at step {step}: {self.skipped_in_row} steps in a row had a non-finite loss or "
                    f"gradient (trainer.max_skipped_steps = {self.max_skipped_in_row}); lower trainer.lr or "
                    "check the data"
                )
        else:
            self.skipped_in_row = 0
        return skipped

    def state_dict(self) -> dict:
        return {"skipped_total": self.skipped_total, "skipped_in_row": self.skipped_in_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_total = state["skipped_total"]
        self.skipped_in_row = state["skipped_in_row"]


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that leaves parameters and moments untouched when the guard says the step is bad.

    With ``max_grad_norm`` set it also clips, and keeps the pre-clip norm in ``_global_grad_norm``,
    where DeepSpeed's engine looks for it (``get_global_grad_norm``); see ``build_train_engine``.
    """

    def __init__(self, params, guard: StepGuard | None = None, max_grad_norm: float | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.guard = guard
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        if self.max_grad_norm is not None:
            with_grad = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            self._global_grad_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, self.max_grad_norm))
        if self.guard is not None:
            # One device-side flag for all gradients: one host read per step, not one per parameter.
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else True
            if self.guard.should_skip(finite):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.grad = None
                return None
        return super().step(closure)
