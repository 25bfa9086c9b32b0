"""The optimisation part of a step: epochs x minibatches x accumulated micro-batches, NaN-guarded.

``run_updates`` is shared by the actor (policy loss) and the critic (value loss). Before each
backward the loss is checked on every rank together; a non-finite loss anywhere makes the learner
skip the current minibatch's optimizer step on all ranks (gradients dropped, parameters and
optimizer moments untouched) and stops the update there; the step is reported as skipped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from fastrlhf.comm import any_rank_true
from fastrlhf.rl.experience import Experience, split_batch

__all__ = ["UpdateResult", "minibatch_order", "run_updates"]


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
            if not aborted and any_rank_true(~torch.isfinite(loss.detach()).all()):
                # Decided by all ranks together: this minibatch's update is skipped everywhere.
                # Its remaining micro-batches still run (DeepSpeed's accumulation counters and
                # ZeRO's gradient reductions stay in step); later minibatches are not run.
                learner.note_bad_loss()
                aborted = True
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
        if aborted:
            break
    result = UpdateResult({k: v / (max(1, micro_count) if _is_loss(k) else max(1.0, tokens)) for k, v in sums.items()})
    result["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    result["optimizer_steps"] = float(optimizer_steps)
    result["aborted"] = aborted
    return result
