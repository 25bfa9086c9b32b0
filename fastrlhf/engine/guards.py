"""NaN/inf step guard: one object decides, the same way on every rank, that a step's update is bad.

The protocol, shared by the RL step and the supervised (SFT, RM) loop::

    guard.inputs_ok(*tensors)    # RL, before the update: anything non-finite it would consume skips the step
                                 # (one host read, with the values the step checks before training)
    guard.note_loss(loss)        # each micro-batch, before backward: a device flag, no host read
    guard.note_trained(tokens)   # RL, each minibatch: its trained-token count, a device value
    guard.carry(metrics)         # device values the host wants after this optimizer step
    optimizer.step()             # GuardedAdamW (or TorchLearner) asks guard.should_skip(grads_finite), once:
                                 # ZeRO-3's further sub-group steps follow that decision until note_loss/carry
    guard.carried()              # the carried values, as floats
    skipped = guard.end_step()   # closes the step: counted, reported in the metrics (a step whose update stopped
                                 # after some optimizer step moved weights is not skipped: :attr:`stopped_part_way`)
    guard.check_budget(step)     # the loop, after logging: raises TooManySkippedSteps after too many

Every question is answered for all ranks together (one tiny collective), so ranks never take
different branches. The final decision is taken inside the optimizer because that is the one place
that sees the reduced, clipped, possibly partitioned gradients under every ZeRO stage: a skipped
update leaves parameters and optimizer moments untouched and drops the gradients.

An optimizer step that trains no token on any rank (every completion of its minibatch cut by
``trainer.mask_truncated_completions``, say) is dropped the same way, but it is not a bad step: its
gradients are zeros, and AdamW would still move every weight by its momentum and weight decay.

That decision is the update's one host read per optimizer step (on a GPU each read waits for the
queued kernels): the losses' flags, the gradients' flag, the gradient norm and whatever metrics were
carried come to the host in one transfer (:func:`fastrlhf.engine.device.host_read`).
"""

from __future__ import annotations

import torch

from fastrlhf.distributed import comm
from fastrlhf.engine.device import host_read, to_device

__all__ = ["INPUTS_READ", "StepGuard", "GuardedAdamW", "GuardedLambdaLR", "StepFailed", "TooManySkippedSteps",
           "all_finite"]

INPUTS_READ = "the update's inputs checked (finite; the engine's logprob mismatch)"


class StepFailed(RuntimeError):
    """A step failed on every rank before any parameter moved (e.g. a reward function raised).

    The loop keeps what the previous steps did (a checkpoint of the last good step) and re-raises;
    the caller has rewound whatever the failed step consumed (its prompts), so ``--resume`` retries it.
    """


class AgreedStepFailure(StepFailed):
    """A step failure every rank ends with alike (:func:`fastrlhf.distributed.comm.agree_on_failure`), said in one
    line prefixed ``said_as``. ``summary``: that line; ``str(exc)`` adds ``user_traceback`` (the frames of the
    user's own code) below it. ``exit_code``: 1, ``--resume`` retries the step; 2, wrong as written. ``local``: it
    failed on this rank (else on another, and this rank stops with it)."""

    said_as = "error"

    def __init__(self, message: str, local: bool = True, exit_code: int = 1, user_traceback: str = ""):
        self.summary, self.user_traceback = message, user_traceback.rstrip("\n")
        super().__init__(message + (f"\n{self.user_traceback}" if self.user_traceback else ""))
        self.local, self.exit_code = local, exit_code


class TooManySkippedSteps(RuntimeError):
    pass


def all_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the tensors' device: no host read, so no stall on a GPU. A NaN or an
    infinity shows in a tensor's extremes, so this reads each tensor once and allocates no tensor of
    its size (``isfinite(t).all()`` would: 1.4 GiB of bools for a 1.5B model's flat fp32 gradient)."""
    flags = [torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all() for t in tensors
             if t.is_floating_point() and t.numel()]
    if not flags:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    return torch.stack(flags).all()


class StepGuard:
    """Skips bad updates and counts them; ``max_skipped_in_row`` consecutive skipped steps stop the run."""

    def __init__(self, max_skipped_in_row: int = 3):
        self.max_skipped_in_row = max_skipped_in_row
        self.skipped_total = 0
        self.skipped_in_row = 0
        # Steps whose update a bad value stopped after an optimizer step had moved weights (PPO: the critic's, after
        # the actor's whole update), counted apart: the weights changed, so the step is not a skipped one.
        self.stopped_total = 0
        self.stopped_in_row = 0
        self.stopped_part_way = False  # the step end_step just closed was one of them
        self.moved_steps = 0  # optimizer steps of the step end_step just closed that moved weights
        self._moved = 0  # those of this training step so far (decided on every rank alike)
        self.update_skipped = False  # this step's update is (being) skipped, on every rank
        # This optimizer step is decided: ZeRO-3 steps its sub-groups (sub_group_size, 1e9 parameters)
        # one optimizer.step() each, and the first one decides for all (see GuardedAdamW.step).
        self.decided = False
        self.step_empty = False  # this optimizer step trains no token on any rank: dropped, not counted
        self._losses_finite: torch.Tensor | None = None  # the losses noted since the last decision
        self._trains: torch.Tensor | None = None  # whether what was noted since then trains a token here
        self._carry: dict[str, torch.Tensor | float] = {}
        self._carried: dict[str, float] = {}
        self.largest: dict[str, float] = {}  # what the last inputs_ok read besides its decision

    def inputs_ok(self, *tensors: torch.Tensor, largest: dict[str, torch.Tensor] | None = None) -> bool:
        """Whether every tensor is finite on every rank; if not, this step's update is skipped. ``largest``: 0-dim
        device values the host needs before the update too; their maxima over the ranks land in
        :attr:`largest`, read in the same collective and host read as the decision."""
        largest = largest or {}
        flag = all_finite(*tensors)
        parts = torch.stack([(~flag).double()] + [to_device(v.detach().reshape(()), flag.device).double()
                                                   for v in largest.values()])
        with host_read(INPUTS_READ):
            values = comm.all_reduce_(parts, "max").tolist()
        ok = values[0] == 0.0
        self.largest = dict(zip(largest, values[1:], strict=True))
        self.update_skipped |= not ok
        return ok

    def note_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, judged at the optimizer step that closes its minibatch: a non-finite
        one on any rank makes that step drop its gradients (backward and step still run, so
        DeepSpeed's accumulation counters and ZeRO's reductions stay in step on every rank). Kept as
        a flag on the loss's device: no host read here."""
        ok = torch.isfinite(loss.detach()).all()
        self._losses_finite = ok if self._losses_finite is None else self._losses_finite & ok
        self.decided = False

    def note_trained(self, tokens: torch.Tensor) -> None:
        """The tokens a minibatch trains (a device count: no host read), judged at its optimizer step: none on
        every rank drops that step without counting it as skipped (:attr:`step_empty`)."""
        trains = tokens.detach().reshape(()) > 0
        self._trains = trains if self._trains is None else self._trains | trains
        self.decided = False

    @property
    def drops_step(self) -> bool:
        """Whether the optimizer step just decided leaves the parameters as they are (bad, or empty)."""
        return self.update_skipped or self.step_empty

    def carry(self, values: dict) -> None:
        """Values (device tensors or floats) the host needs once this optimizer step is decided: they
        come to the host with the decision, in its one read; :meth:`carried` gives them as floats."""
        self._carry.update(values)
        self.decided = False

    def carried(self) -> dict[str, float]:
        """The values carried into the last decision, as floats. Carried values that no decision has
        read yet (a step that never reached the guard) are read now, in one named read."""
        if self._carry:
            self._carried = self._read([], "the step's metrics (no guard decision read them)")[1]
        return dict(self._carried)

    def should_skip(self, grads_finite) -> bool:
        """The optimizer's question at a step boundary (``grads_finite``: a bool or a 0-dim tensor): True
        unless the gradients and every loss noted since the last decision are finite on every rank, and
        some rank trains a token (when :meth:`note_trained` was told; an empty step sets :attr:`step_empty`)."""
        flag = grads_finite if isinstance(grads_finite, torch.Tensor) else torch.tensor(bool(grads_finite))
        if self._losses_finite is not None:
            flag = self._losses_finite & flag
        trains, self._losses_finite, self._trains = self._trains, None, None
        # One collective for both: AND over ranks of "finite" and of "trains nothing here", where a device
        # value is (a host flag goes there; the other way would be a read).
        device = flag.device if trains is None or flag.device.type != "cpu" else trains.device
        empty = ~to_device(trains, device) if trains is not None else torch.zeros((), dtype=torch.bool, device=device)
        flags = comm.all_ranks_flag(torch.stack([to_device(flag.reshape(()), device), empty]))
        decision = self._read(list(flags), "the optimizer step's skip decision and metrics")
        (ok, empty_everywhere), self._carried = decision
        skip = not ok or self.update_skipped
        self.update_skipped, self.decided = skip, True
        self.step_empty = not skip and empty_everywhere
        self._moved += not (skip or self.step_empty)
        return skip or self.step_empty

    def settle(self, grads_finite=True) -> None:
        """Decide now if a loss or carried values wait for a decision that no optimizer step asked for
        (DeepSpeed skips its optimizer itself on a non-finite gradient norm): a noted non-finite loss
        is never dropped unseen."""
        if self._losses_finite is not None or self._trains is not None or self._carry:
            self.should_skip(grads_finite)

    def _read(self, flags: list[torch.Tensor], name: str) -> tuple[list[bool], dict[str, float]]:
        """``flags`` (as bools) and the carried values in one device-to-host transfer."""
        carry, self._carry = self._carry, {}
        tensors = {k: v for k, v in carry.items() if isinstance(v, torch.Tensor)}
        parts = list(flags) + list(tensors.values())
        values = []
        if parts:
            # Gathered where the device values are (host scalars go there), so that the one read waits for
            # them; never copied to the host first without waiting (a non-blocking device-to-host copy).
            device = next((t.device for t in parts if t.device.type != "cpu"), parts[0].device)
            with host_read(name):
                values = torch.stack([to_device(t.detach().reshape(()), device).double() for t in parts]).tolist()
        read = dict(zip(tensors, values[len(flags):], strict=True))
        return [bool(v) for v in values[:len(flags)]], {k: read[k] if k in read else float(v) for k, v in carry.items()}

    def end_step(self) -> bool:
        """Close a training step; returns True if its update was skipped: no weight moved. One that a bad value
        stopped after an optimizer step had moved weights returns False and sets :attr:`stopped_part_way`."""
        self.settle()
        bad, self.moved_steps = self.update_skipped, self._moved
        self.update_skipped, self.decided, self.step_empty, self._moved = False, False, False, 0
        skipped, self.stopped_part_way = bad and not self.moved_steps, bad and self.moved_steps > 0
        if skipped:
            self.skipped_total += 1
            self.skipped_in_row += 1
        else:
            self.skipped_in_row = 0
        if self.stopped_part_way:
            self.stopped_total += 1
            self.stopped_in_row += 1
        elif not skipped:
            self.stopped_in_row = 0
        return skipped

    def check_budget(self, step: int, reason: str = "non-finite loss or gradient") -> None:
        """Raise :class:`TooManySkippedSteps` once ``max_skipped_in_row`` steps in a row were skipped."""
        if self.skipped_in_row >= self.max_skipped_in_row:
            raise TooManySkippedSteps(
                f"stopping at step {step}: {self.skipped_in_row} steps in a row had a {reason} "
                f"(trainer.max_skipped_steps = {self.max_skipped_in_row}); lower trainer.lr or check the data"
            )
        if self.stopped_in_row >= self.max_skipped_in_row:
            raise TooManySkippedSteps(
                f"stopping at step {step}: {self.stopped_in_row} steps in a row had a {reason} part-way through "
                f"their update (trainer.max_skipped_steps = {self.max_skipped_in_row}); lower trainer.lr (critic.lr "
                "where the critic's update stops) or check the data"
            )

    def state_dict(self) -> dict:
        state = {"skipped_total": self.skipped_total, "skipped_in_row": self.skipped_in_row}
        if self.stopped_total:  # a run without such a step keeps the checkpoint's earlier form
            state.update(stopped_total=self.stopped_total, stopped_in_row=self.stopped_in_row)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.skipped_total = state["skipped_total"]
        self.skipped_in_row = state["skipped_in_row"]
        self.stopped_total = state.get("stopped_total", 0)
        self.stopped_in_row = state.get("stopped_in_row", 0)


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
    Otherwise ``norm_source()`` (set by ``build_train_engine``) gives the norm DeepSpeed computed
    before calling this step. The norm is carried into the guard's decision (a device tensor, read
    with it), never read on its own.

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
        self.norm_source = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        if self.guard is not None and self.guard.decided:
            # A later ZeRO-3 sub-group (or parameter group) of an optimizer step the first one decided, on
            # the whole step's losses and DeepSpeed's global norm: asking again would read the device
            # again and lose the metrics the first read brought.
            if self.guard.drops_step:
                for p in params:
                    p.grad = None
                return None
            return super().step(closure)
        norm = None
        if self.max_grad_norm is not None:
            with_grad = [p for p in params if p.grad is not None]
            norm = self._global_grad_norm = torch.nn.utils.clip_grad_norm_(with_grad, self.max_grad_norm)
        elif self.norm_source is not None:
            norm = self.norm_source()
        if self.guard is None:
            return super().step(closure)
        ok = grads_finite(params)
        if norm is not None:
            self.guard.carry({"grad_norm": norm})
        if isinstance(norm, torch.Tensor):
            # The global norm covers every ZeRO-3 sub-group and rank, where these gradients are one sub-group's
            # partition: an invalid one (DeepSpeed's -1 sentinel too) drops the whole step. DeepSpeed's own
            # check of it, a host read, is off inside this step (fastrlhf.engine.deepspeed_reads).
            ok = (torch.isfinite(norm) & (norm >= 0)) & ok
        if self.guard.should_skip(ok):
            for p in params:
                p.grad = None
            return None
        return super().step(closure)


class GuardedLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR that stays where it is after an optimizer step the guard dropped (bad, or empty), as the weights
    do: DeepSpeed steps the scheduler after every optimizer step it does not itself see overflow, so a skipped
    update would otherwise still use up a step of the warm-up."""

    def __init__(self, optimizer, lr_lambda, guard: StepGuard | None):
        self.guard = guard
        super().__init__(optimizer, lr_lambda)

    def step(self, *args, **kwargs):
        if self.guard is not None and self.guard.decided and self.guard.drops_step:
            return None
        return super().step(*args, **kwargs)

    def state_dict(self):  # a checkpoint holds the schedule's position, not the guard (saved on its own)
        return {k: v for k, v in super().state_dict().items() if k != "guard"}

    def load_state_dict(self, state_dict):
        """The checkpoint's position in the schedule, on this run's peak rate: a run resumed with another
        ``trainer.lr`` (the advice after too many skipped steps) trains at that one, not at the checkpoint's."""
        base_lrs = self.base_lrs
        super().load_state_dict(state_dict)
        self.base_lrs = base_lrs
        self.apply_lr()

    def apply_lr(self) -> None:
        """The optimizer's rates from the schedule at its position; again after DeepSpeed loads a ZeRO optimizer's
        state (after the scheduler's), whose saved param groups hold the checkpoint's rates."""
        self._last_lr = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr
