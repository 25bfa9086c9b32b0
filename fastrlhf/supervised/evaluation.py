"""Held-out evaluation during ``fastrlhf sft`` and ``fastrlhf rm``: ``data.eval_path`` every ``trainer.eval_every``
optimizer steps and after the last, through the job's own loss (``SupervisedJob.loss_fn``), without gradients and
with dropout off.

Metrics, over every held-out example of every rank:

- SFT: ``eval/loss``, the negative log-likelihood summed over all held-out trained tokens, divided by their count
  (the token mean, as the training loss is over a step's tokens); ``eval/perplexity``, its exp.
- reward models: ``eval/loss`` (the mean over the pairs or rows) and ``eval/accuracy``; pairwise also
  ``eval/margin`` (the mean of chosen - rejected).

TRL's ``eval_loss`` (transformers' evaluation loop) is the mean over the examples of their eval batch's own token
mean, OpenRLHF's the mean over the batches and ranks of theirs: both move with the eval batch size and the number
of ranks where the examples' lengths differ. This one is the quantity they approximate, the same whatever the
micro-batches, packing or ranks.

Every rank evaluates its shard of the held-out examples, dealt as a step's batch is (``trainer.balance_ranks``),
in the training loop's micro-batches. Every rank runs as many forwards (ZeRO-3 gathers the parameters in each): a
rank with fewer micro-batches runs its extra ones on a filler whose results are dropped. The sums are reduced in
one collective and come to the host in one read per evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fastrlhf.data import balanced_shard, shard
from fastrlhf.distributed import comm
from fastrlhf.engine.device import host_read, model_device, to_device
from fastrlhf.modeling import unwrap

__all__ = ["EVAL_LINE_KEYS", "EVAL_READ", "Evaluator", "eval_shards", "even_passes", "is_eval_step"]

EVAL_READ = "the held-out evaluation's sums"
EVAL_LINE_KEYS = ("eval/loss", "eval/accuracy")  # on the step's text line, where it has them


def is_eval_step(step: int, eval_every: int, max_steps: int) -> bool:
    """Every ``trainer.eval_every`` optimizer steps, and after the last."""
    return step % eval_every == 0 or step == max_steps


def eval_shards(job, balance: bool, world: int) -> list[list[int]]:
    """Every rank's positions in ``job.examples``, dealt as a step's batch is (:func:`fastrlhf.data.shard`, or
    :func:`fastrlhf.data.balanced_shard` by real tokens): the list padded to a multiple of the ranks with fillers
    (no tokens), which are then left out, so that the ranks' shares differ by at most one example."""
    positions = list(range(len(job.examples))) + [-1] * (-len(job.examples) % world)
    if balance and job.token_parts is not None:
        lengths = [sum(job.token_parts(job.examples[j], True)) if j >= 0 else 0 for j in positions]
        shares = [balanced_shard(positions, lengths, r, world) for r in range(world)]
    else:
        shares = [shard(positions, r, world) for r in range(world)]
    return [[j for j in share if j >= 0] for share in shares]


def even_passes(shares: list[list], plan: Callable[[list], list[list[int]]], rank: int) -> list[list | None]:
    """This rank's micro-batches (lists of its items in ``shares[rank]``, grouped as ``plan(share)`` says), then a
    None for each pass another rank runs beyond them. Every rank runs as many forwards (ZeRO-3 gathers the
    parameters in each): a None is a filler forward whose results are dropped. Every rank plans every rank's share
    here: no collective."""
    plans = [plan(share) for share in shares]
    own = [[shares[rank][i] for i in group] for group in plans[rank]]
    return own + [None] * (max(len(p) for p in plans) - len(own))


class Evaluator:
    """``evaluator(engine) -> {"eval/loss": ..., ...}`` over ``job.examples`` (the held-out ones; a collective: call
    it on every rank). ``plan(examples)``: a rank's micro-batches of ``examples`` (positions), as the training loop
    plans them but without a collective (``fastrlhf.supervised.loop.micro_batches`` with ``agree`` false): every
    rank plans every rank's shard here, once, and the counts are evened with filler forwards."""

    def __init__(self, job, plan: Callable[[list], list[list[int]]], balance: bool, rank: int, world: int):
        self.job = job
        self.keys = ("loss", *job.mean_metrics)
        shares = [[job.examples[j] for j in share] for share in eval_shards(job, balance, world)]
        self.passes = even_passes(shares, plan, rank)
        self.weight = float(sum(job.weight_of(e) for e in job.examples))  # the loss's divisor, known to every rank

    @property
    def batches(self) -> list[list]:
        """This rank's own micro-batches."""
        return [batch for batch in self.passes if batch is not None]

    @property
    def fillers(self) -> int:
        """The filler forwards this rank runs so that it runs as many as the rank with the most micro-batches."""
        return self.passes.count(None)

    def _sums(self, engine) -> dict:
        """This rank's loss and metric sums (device values), its filler forwards run."""
        sums: dict = {}
        for batch in self.passes:
            if batch is None:
                self.job.loss_fn(engine, self.job.examples[:1], 1.0)
                continue
            loss, stats = self.job.loss_fn(engine, batch, 1.0)  # scale 1: sums over the micro-batch
            for key, value in {"loss": loss, **stats}.items():
                sums[key] = sums[key] + value if key in sums else value
        return sums

    def __call__(self, engine) -> dict[str, float]:
        module = unwrap(engine)
        training = module.training
        engine.eval()
        try:
            with torch.no_grad():
                sums = self._sums(engine)
        finally:
            engine.train(training)
        device = model_device(engine)
        # Host values (a count) go to the device values' device: the one read then waits for all of them.
        totals = torch.stack([to_device(torch.as_tensor(sums.get(key, 0.0)).detach().double().reshape(()), device)
                              for key in self.keys])
        comm.all_reduce_(totals, "sum")
        with host_read(EVAL_READ):
            values = dict(zip(self.keys, totals.tolist(), strict=True))
        metrics = {"eval/loss": values.pop("loss") / self.weight if self.weight else math.nan}
        metrics.update({f"eval/{key}": value / len(self.job.examples) for key, value in values.items()})
        if self.job.perplexity:
            loss = metrics["eval/loss"]
            metrics["eval/perplexity"] = math.inf if loss > 700 else math.exp(loss)  # exp overflows past 709
        return metrics
