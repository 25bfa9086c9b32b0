"""The optimisation part of a step: epochs x minibatches x micro-batches, NaN-guarded.

A learner is "a model that learns": a DeepSpeed engine, or a plain module with a torch optimizer
(:class:`TorchLearner`, so the step runs unchanged single-process without DeepSpeed). Both take, per
micro-batch, ``backward(loss, boundary)`` then ``step()``: the loss is the micro-batch's SHARE of
its minibatch's loss (its tokens weighted by the minibatch's aggregation weights, see
``fastrlhf.algorithms.loss_weights``), so it is not divided by anything, and ``boundary`` marks the
minibatch's last micro-batch, whose ``step()`` clips and runs the optimizer. The caller says where
the boundary is because a minibatch's number of micro-batches is not fixed: with
``trainer.max_tokens_per_microbatch`` it depends on the lengths of its sequences.

:func:`run_updates` drives the actor (policy loss) and the critic (value loss) alike. Each loss
goes through the step's guard (``fastrlhf.engine.guards``): a non-finite loss on any rank makes the
minibatch's optimizer step drop its gradients on every rank, and the update stops there. A minibatch
that trains no token on any rank does not step either (``empty_minibatches``); the update goes on.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fastrlhf.algorithms import aggregation_count, aggregation_weights
from fastrlhf.distributed import comm
from fastrlhf.engine.device import host_read, to_device
from fastrlhf.engine.guards import StepGuard, grads_finite
from fastrlhf.rl.experience import Experience, split_batch

__all__ = ["DeepSpeedLearner", "Minibatch", "TorchLearner", "UpdateResult", "as_learner", "minibatch_order",
           "on_policy_update", "run_updates"]


class TorchLearner:
    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float = 0.0,
                 guard: StepGuard | None = None):
        self.module = module
        self.optimizer = optimizer
        self.max_grad_norm = float(max_grad_norm or 0.0)
        self.guard = guard if guard is not None else StepGuard()
        self.last_grad_norm: float | None = None
        self._boundary = True

    def backward(self, loss: torch.Tensor, boundary: bool = True) -> None:
        """Accumulate the gradient of ``loss`` (a micro-batch's share of its minibatch's loss, as it is)."""
        self._boundary = boundary
        loss.backward()

    def step(self) -> bool:
        """At the accumulation boundary (the last ``backward``'s): clip, step (unless the guard says
        skip) and zero the gradients. True if the optimizer stepped. The norm is carried into the
        guard's decision, the step's one host read."""
        if not self._boundary:
            return False
        params = [p for p in self.module.parameters() if p.grad is not None]
        if params:
            max_norm = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
            # Clipped before the decision, so that the norm comes to the host with it; a skipped step
            # drops the (clipped) gradients anyway.
            self.guard.carry({"grad_norm": torch.nn.utils.clip_grad_norm_(params, max_norm)})
        stepped = not self.guard.should_skip(grads_finite(params))
        self.last_grad_norm = self.guard.carried().get("grad_norm", 0.0) if stepped else None
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    def grad_norm(self) -> float | None:
        return self.last_grad_norm


class DeepSpeedLearner:
    """A DeepSpeed engine built by ``fastrlhf.distributed.build_train_engine(..., guard=guard)``: its
    GuardedAdamW asks the guard at every boundary, under every ZeRO stage.

    The engine would divide each loss by its ``gradient_accumulation_steps`` and find the boundary by
    counting micro-steps; both are taken over here: ``backward(loss, boundary)`` sets the boundary
    (``engine.set_gradient_accumulation_boundary``, before the backward, where ZeRO reduces the
    gradients) and backpropagates the loss unscaled (``scale_wrt_gas=False``). Its ranks' gradients are averaged
    (:attr:`averages_ranks`: :func:`run_updates` weighs each rank's loss for that)."""

    averages_ranks = True

    def __init__(self, engine, guard: StepGuard):
        self.engine = engine
        self.guard = guard
        self.module = engine.module

    def backward(self, loss: torch.Tensor, boundary: bool = True) -> None:
        # engine.forward() starts with this; the step calls the module's body and head, never
        # engine.forward, and without it ZeRO-3 never advances its micro-step, so each micro-batch's
        # gradient would replace the previous one's instead of adding to it.
        clear = getattr(getattr(self.engine, "optimizer", None), "clear_backward_seen_flag", None)
        if clear is not None:
            clear()
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> bool:
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        if boundary:  # DeepSpeed may have skipped our optimizer's step (and with it the guard's decision)
            self.guard.settle(not getattr(self.engine.optimizer, "overflow", False))
        return boundary and not self.guard.drops_step

    def grad_norm(self) -> float | None:
        """The last step's pre-clip norm: carried into the guard's decision by GuardedAdamW, else
        (an engine built without the guard) read from the engine."""
        norm = self.guard.carried().get("grad_norm")
        if norm is None:
            norm = self.engine.get_global_grad_norm()
            if isinstance(norm, torch.Tensor):
                with host_read("the engine's gradient norm (an optimizer without the guard)"):
                    norm = norm.item()
        return None if norm is None else float(norm)


def as_learner(obj, optimizer=None, max_grad_norm: float = 0.0, guard: StepGuard | None = None):
    """Wrap a DeepSpeed engine, or a module + optimizer, in the learner interface (learners pass through)."""
    if isinstance(obj, (TorchLearner, DeepSpeedLearner)):
        return obj
    if any(cls.__name__ == "DeepSpeedEngine" for cls in type(obj).__mro__):
        return DeepSpeedLearner(obj, guard if guard is not None else StepGuard())
    if optimizer is None:
        raise ValueError("a plain module needs an optimizer to learn")
    return TorchLearner(obj, optimizer, max_grad_norm, guard)


@dataclass
class Minibatch:
    """One optimizer step: ``rows`` of the step's batch, and its micro-batches as lists of positions
    in ``rows`` (every position exactly once)."""

    rows: torch.Tensor
    groups: list[list[int]]


class UpdateResult(dict):
    """Metrics of an update: losses (``loss`` and ``*_loss``) per minibatch (the sum of its micro-batches'
    shares: the loss the optimizer stepped on) averaged over minibatches; every other metric (a masked
    mean over a micro-batch's tokens) weighted by its micro-batch's kept tokens, i.e. the masked mean
    over all tokens the update saw. Plus ``grad_norm`` (mean over optimizer steps), ``optimizer_steps``,
    ``empty_minibatches`` (no token trained on any rank: not stepped, and left out of the other metrics)
    and ``aborted`` (a non-finite loss stopped the update)."""


def minibatch_order(batch_size: int, minibatch: int, epochs: int, generator: torch.Generator) -> list[torch.Tensor]:
    """For each optimizer step, the row indices of its minibatch (``minibatch`` rows, reshuffled each epoch)."""
    steps = []
    for _ in range(epochs):
        steps += split_batch(batch_size, batch_size // minibatch, generator, shuffle=True)
    return steps


def _is_loss(name: str) -> bool:
    return name == "loss" or name.endswith("_loss")


def _rank_counts(learner, exp: Experience, order: list[Minibatch], agg: str) -> torch.Tensor | None:
    """Each minibatch's aggregation denominator (tokens or sequences) summed over the ranks, at least 1, over
    their number: one collective on the device for the whole update, no host read. None where there is one rank
    or the learner does not average its ranks' gradients."""
    world = comm.world_size()
    if world == 1 or not getattr(learner, "averages_ranks", False):
        return None
    trained = exp.trained_mask
    local = torch.stack([aggregation_count(trained[to_device(m.rows, trained.device)], agg) for m in order])
    return comm.all_reduce_(local, "sum").clamp(min=1) / world


def run_updates(learner, exp: Experience, loss_fn: Callable, order: list[Minibatch], agg: str,
                length: int | None = None) -> UpdateResult:
    """``loss_fn(module, micro_exp) -> (loss, metrics)``; one optimizer step per entry of ``order``.

    Each minibatch's aggregation weights (``trainer.agg`` over all its rows) are computed once and
    handed to its micro-batches (``Experience.loss_weights``): their losses add up to the
    minibatch's loss in every aggregation mode, whatever the grouping. On several ranks each rank's
    weights divide by every rank's tokens (or sequences) together, so that the averaged gradients are those
    of the whole minibatch's aggregate, however the batch was split over the ranks (as verl's ``agg_loss``);
    per rank, a rank of short completions gave each of its tokens more weight than one of long ones.
    ``length``: ``seq-mean-token-sum-norm``'s constant divisor (``rollout.max_new_tokens``).

    Losses and metrics stay on the device while the micro-batches run; each minibatch's sums are
    carried into the guard's decision at its optimizer step, so the update reads the device once per
    optimizer step (``fastrlhf.engine.guards``).
    """
    sums: dict[str, float] = defaultdict(float)
    minibatches, tokens = 0, 0.0
    grad_norms = []
    optimizer_steps = empty = 0
    aborted = False
    counts = _rank_counts(learner, exp, order, agg)
    for position, minibatch in enumerate(order):
        mini = exp.select(minibatch.rows)
        trained = mini.trained_mask  # a product where rows are left out: made once
        count = None if counts is None else counts[position]
        mini = replace(mini, loss_weights=aggregation_weights(trained, agg, count, length))
        learner.guard.note_trained(trained.sum())
        device_sums: dict[str, torch.Tensor] = {}
        mini_tokens = 0.0
        for index, group in enumerate(minibatch.groups):
            mb = mini.select(group)
            loss, metrics = loss_fn(learner.module, mb)
            # A bad loss on any rank: this minibatch's remaining micro-batches still run (the
            # accumulation boundary must be reached everywhere), its optimizer step is dropped.
            learner.guard.note_loss(loss)
            mb_tokens = float(sum(mb.policy_token_counts()))
            for name, value in {"loss": loss.detach(), **metrics}.items():
                term = value if _is_loss(name) else value * mb_tokens
                device_sums[name] = device_sums[name] + term if name in device_sums else term
            mini_tokens += mb_tokens
            boundary = index == len(minibatch.groups) - 1
            if boundary:
                learner.guard.carry({f"update/{name}": value for name, value in device_sums.items()})
            learner.backward(loss, boundary=boundary)
            stepped = learner.step()
        values = learner.guard.carried()
        if learner.guard.update_skipped:  # later minibatches are not run
            aborted = True
            break
        if learner.guard.step_empty:
            empty += 1
            continue
        if stepped:
            optimizer_steps += 1
            norm = learner.grad_norm()
            if norm is not None:
                grad_norms.append(norm)
        minibatches += 1
        tokens += mini_tokens
        for key, value in values.items():
            if key.startswith("update/"):
                sums[key[len("update/"):]] += value
    result = UpdateResult({k: v / (max(1, minibatches) if _is_loss(k) else max(1.0, tokens)) for k, v in sums.items()})
    result["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    result["optimizer_steps"] = float(optimizer_steps)
    result["empty_minibatches"] = float(empty)
    result["aborted"] = aborted
    return result


def on_policy_update(exp: Experience, order: list[Minibatch]) -> Experience:
    """The batch the actor's update trains on. One optimizer step: it starts from the policy that scored the old
    logprobs, so its own logprobs, detached, are the old ones (ratio exactly 1, as verl's ``on_policy``); recomputed
    ones (``tis_cap``, ``kl_in_reward``, ``old_logprobs: recompute``) differ from them by the update's dropout and by
    rounding where the passes batch differently, which a tight clip (GSPO's 3e-4) turns into clipped tokens with no
    gradient. More steps need the recomputed ones: each later minibatch's own would hide the steps before it."""
    if len(order) == 1:
        return replace(exp, old_logprobs=None)
    if exp.old_logprobs is None:
        raise ValueError(f"the update takes {len(order)} optimizer steps (trainer.minibatch_size, trainer.ppo_epochs) "
                         "but the batch has no old logprobs: every step after the first would be unclipped")
    return exp
