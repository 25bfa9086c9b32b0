"""NaN/inf step guard: one object decides, the same way on every rank, that a step's update is bad.

The protocol, shared by the RL step and the supervised (SFT, RM) loop::

    guard.inputs_ok(*tensors)    # RL, before the update: anything non-finite it would consume skips the step
    guard.loss_ok(loss)          # each micro-batch, before backward
    optimizer.step()             # GuardedAdamW (or TorchLearner) asks guard.should_skip(grads_finite)
    skipped = guard.end_step()   # closes the step: counted, reported in the metrics
    guard.check_budget(step)     # the loop, after logging: raises TooManySkippedSteps after too many

Every question is answered for all ranks together (one tiny collective), so ranks never take
different branches. The final decision is taken inside the optimizer because that is the one place
that sees the reduced, clipped, possibly partitioned gradients under every ZeRO stage: a skipped
update leaves parameters and optimizer moments untouched and drops the gradients.
"""

from __future__ import annotations

import torch

from fastrlhf import comm

__all__ = ["StepGuard", "GuardedAdamW", "StepFailed", "TooManySkippedSteps", "all_finite"]


class StepFailed(RuntimeError):
    """A step failed on every rank before any parameter moved (e.g. a reward function raised).

    The loop keeps what the previous steps did (a checkpoint of the last good step) and re-raises;
    the caller has rewound whatever the failed step consumed (its prompts), so ``--resume`` retries it.
    """


class TooManySkippedSteps(RuntimeError):
    pass


def all_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the tensors' device: no host read, so no stall on a GPU."""
    return torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all()


class StepGuard:
    """Skips bad updates and counts them; ``max_skipped_in_row`` consecutive skipped steps stop the run."""

    def __init__(self, max_skipped_in_row: int = 3):
        self.max_skipped_in_row = max_skipped_in_row
        self.skipped_total = 0
        self.skipped_in_row = 0
        self.update_skipped = False  # this step's update is (being) skipped, on every rank

    def inputs_ok(self, *tensors: torch.Tensor) -> bool:
        """Whether every tensor is finite on every rank; if not, this step's update is skipped."""
        ok = comm.all_ranks_true(all_finite(*tensors))
        self.update_skipped |= not ok
        return ok

    def loss_ok(self, loss: torch.Tensor) -> bool:
        """Whether this micro-batch's loss is finite on every rank; if not, the optimizer step that
        closes the minibatch drops its gradients (backward and step still run, so DeepSpeed's
        accumulation counters and ZeRO's reductions stay in step on every rank)."""
        return self.inputs_ok(loss)

    def should_skip(self, grads_finite) -> bool:
        """The optimizer's question at a step boundary (``grads_finite``: a bool or a 0-dim tensor)."""
        skip = not comm.all_ranks_true(grads_finite) or self.update_skipped
        self.update_skipped = skip
        return skip

    def end_step(self) -> bool:
        """Close a training step; returns True if its update was skipped."""
        skipped, self.update_skipped = self.update_skipped, False
        if skipped:
            self.skipped_total += 1
            self.skipped_in_row += 1
        else:
            self.skipped_in_row = 0
        return skipped

    def check_budget(self, step: int, reason: str = "non-finite loss or gradient") -> None:
        """Raise :class:`TooManySkippedSteps` once ``max_skipped_in_row`` steps in a row were skipped."""
        if self.skipped_in_row >= self.max_skipped_in_row:
            raise TooManySkippedSteps(
                f"stopping at step {step}: {self.skipped_in_row} steps in a row had a {reason} "
                f"(trainer.max_skipped_steps = {self.max_skipped_in_row}); lower trainer.lr or check the data"
            )

    def state_dict(self) -> dict:
        return {"skipped_total": self.skipped_total, "skipped_in_row": self.skipped_in_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_total = state["skipped_total"]
        self.skipped_in_row = state["skipped_in_row"]


def grads_finite(params) -> torch.Tensor | bool:
    """One device-side flag for all gradients: one host read per step, not one per parameter."""
    grads = [p.grad for p in params if p.grad is not None]
    return all_finite(*grads) if grads else True


def _has_fused_step(params) -> bool:
    """Whether torch's fused AdamW kernel exists for every parameter (device and floating dtype);
    ``params``: tensors or param-group dicts. torch itself only checks at the first step."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # an older torch without the list: take the default step
        return False
    devices = set(_get_fused_kernels_supported_devices())
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return bool(tensors) and all(t.device.type in devices and t.is_floating_point() for t in tensors)


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that leaves parameters and moments untouched when the guard says the step is bad.

    With ``max_grad_norm`` set it also clips, and keeps the pre-clip norm in ``_global_grad_norm``,
    where DeepSpeed's engine looks for it (``get_global_grad_norm``); see ``build_train_engine``.

    It steps with torch's fused kernel (``fused=True``) wherever torch has one for the parameters'
    device (CPU and CUDA): one pass over each parameter, gradient and moment, where the default
    single-tensor step makes a dozen full-size passes and temporaries (measured in
    ``benchmarks/results/history/2026-11-25-workload-c-fused-adamw.md``). Elsewhere (e.g. ``meta``
    tensors) it takes the default step. ``fused=`` or ``foreach=`` given explicitly is kept.
    """

    def __init__(self, params, guard: StepGuard | None = None, max_grad_norm: float | None = None, **kwargs):
        if "fused" not in kwargs and "foreach" not in kwargs:
            params = list(params)
            kwargs["fused"] = _has_fused_step(params)
        super().__init__(params, **kwargs)
        self.guard = guard
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        if self.max_grad_norm is not None:
            with_grad = [p for p in params if p.grad is not None]
            self._global_grad_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, self.max_grad_norm))
        if self.guard is not None and self.guard.should_skip(grads_finite(params)):
            for p in params:
                p.grad = None
            return None
        return super().step(closure)
