"""What an RL step measures and how its metrics become one dict: the per-stage clock (wall time, and on
CUDA the allocator's peak per stage), the actor-vs-engine logprob mismatch and the rows it is probed on,
and the reduction over ranks. The metrics themselves are listed in ``fastrlhf/rl/step.py``'s docstring."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from fastrlhf.algorithms import masked_mean
from fastrlhf.distributed import comm
from fastrlhf.engine.device import host_read, to_device
from fastrlhf.engine.step_profile import STAGE_PREFIX

__all__ = ["METRICS_READ", "CountedMean", "StepClock", "logprob_mismatch", "probe_rows", "reduce_step_metrics"]

STAGES = ("generate", "score", "train", "sync")
METRICS_READ = "the step's metrics"
# Masked means over the batch's completion tokens: over the ranks, each rank's weighs by its tokens (the adaptive
# KL controller reads ``kl`` as the mean over every rank's tokens together), not the mean of the ranks' means. The
# update's too (each rank's sees each of its tokens ppo_epochs times): on-policy, ``entropy`` and ``loss_kl`` are
# ``rollout_entropy`` and ``kl``, and must read the same.
TOKEN_MEANS = ("kl", "rollout_entropy", "tis_weight_mean", "tis_outside_fraction", "advantage_mean", "entropy",
               "loss_kl", "clipfrac", "approx_kl", "vf_clipfrac", "off_policy_masked_fraction")
COUNT_PREFIX = "count:"  # the reduced vector's slot of a CountedMean's count (not a metric)


class CountedMean(float):
    """A rank's mean over ``count`` items (``reward/<name>``: the completions a reward applied to). Over the ranks it
    weighs by its count, as TRL's ``nanmean`` of the gathered rewards does: a rank where the reward applied to one
    completion does not count as much as one where it applied to all, and one where it applied to none not at all."""

    def __new__(cls, value: float, count: float):
        mean = super().__new__(cls, value)
        mean.count = float(count)
        return mean


def reduce_step_metrics(exp, local: dict[str, float | torch.Tensor], times: dict[str, float], step: int, *,
                        skipped: bool, skipped_total: int, world: int, generated: float | None = None
                        ) -> dict[str, float]:
    """Every rank's metrics summed and maxed over the ranks (times, ``memory/*`` and ``*_max`` take the largest
    rank's, :data:`TOKEN_MEANS` the mean over every rank's completion tokens, a :class:`CountedMean` the mean over
    every rank's counted items, the rest the mean), with the batch's
    score statistics. ``local`` holds floats and 0-dim device
    tensors (what the score stage measured, left on the device): all of them go to the host in one read after
    two collectives. ``generated``: the tokens this rank generated, where more than the batch's
    (``trainer.filter_groups``)."""
    scores = exp.scores.detach().double()
    finite = torch.isfinite(scores)
    kept = torch.where(finite, scores, 0.0)
    trained = exp.response_mask.sum().double()
    batch = {"score_sum": kept.sum(), "score_square_sum": kept.square().sum(), "finite": finite.sum().double(),
             "trained": trained, "generated": trained if generated is None else generated}
    local = {**local, **{f"time/{k}": v for k, v in times.items()}}
    local.update({k: local[k] * trained for k in TOKEN_MEANS if k in local})
    counted = [k for k, v in local.items() if isinstance(v, CountedMean)]
    local.update({COUNT_PREFIX + k: local[k].count for k in counted})
    local.update({k: local[k] * local[k].count for k in counted})
    keys = sorted(local)
    summed, maxed = _read_reduced([*batch.values(), *(local[k] for k in keys)], scores.device)
    total = dict(zip(batch, summed, strict=False))
    count = max(total["finite"], 1.0)
    # No finite reward at all: no mean either (NaN, written as a JSON number), not a made-up 0.
    mean = total["score_sum"] / count if total["finite"] else float("nan")
    var = (max(total["score_square_sum"] / count - mean * mean, 0.0) * (count / max(count - 1, 1))
           if total["finite"] else float("nan"))
    reduced = dict(zip(keys, summed[len(batch):], strict=True))
    metrics = {k: (mx if k.startswith(("time/", "memory/")) or k.endswith("_max") else
                   s / max(total["trained"], 1.0) if k in TOKEN_MEANS else
                   s / max(reduced[COUNT_PREFIX + k], 1.0) if k in counted else s / world)
               for k, s, mx in zip(keys, summed[len(batch):], maxed[len(batch):], strict=True)
               if not k.startswith(COUNT_PREFIX)}
    generate_time = metrics["time/generate"]
    metrics.update(step=step, reward_mean=mean, reward_std=var ** 0.5, generated_tokens=total["generated"],
                   reward_nonfinite=exp.batch_size * world - total["finite"],
                   tokens_per_second=total["generated"] / generate_time if generate_time > 0 else 0.0,
                   step_time=sum(metrics[f"time/{k}"] for k in STAGES),
                   skipped=float(skipped), skipped_steps=float(skipped_total),
                   mean_response_length=total["trained"] / max(1, exp.batch_size * world))
    return metrics


def _read_reduced(values: list, device: torch.device) -> tuple[list[float], list[float]]:
    """``(sums, maxima)`` over the ranks of ``values`` (floats and 0-dim tensors on ``device``): one vector on the
    device, two collectives, one host read, named ``the step's metrics``."""
    host = torch.tensor([float(v) if not isinstance(v, torch.Tensor) else 0.0 for v in values], dtype=torch.float64)
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    vector = to_device(host, device)
    if on_device:
        index = to_device(torch.tensor(on_device), device)
        vector = vector.index_copy(0, index, torch.stack([values[i].detach().reshape(()).double() for i in on_device]))
    summed, maxed = comm.all_reduce_(vector.clone(), "sum"), comm.all_reduce_(vector, "max")
    with host_read(METRICS_READ):
        both = torch.stack([summed, maxed]).tolist()
    return both[0], both[1]


def probe_rows(token_parts: list[tuple[int, int]], k: int) -> list[int]:
    """The ``k`` rows that are cheapest to re-score (fewest prompt + completion tokens), in batch order.
    Rows with no completion token come last: they would show no mismatch at all."""
    cheapest = sorted(range(len(token_parts)), key=lambda i: (token_parts[i][1] == 0, sum(token_parts[i])))
    return sorted(cheapest[:k])


def logprob_mismatch(actor_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``logprob_mismatch_mean`` / ``_max``: |actor - engine| over the completion tokens, 0-dim on their device."""
    diff = torch.where(mask > 0, (actor_logprobs - engine_logprobs).abs(), 0.0)
    return {"logprob_mismatch_mean": masked_mean(diff, mask),
            "logprob_mismatch_max": diff.amax() if diff.numel() else diff.new_zeros(())}


# The caching allocator's counters a stage's churn is read from: retries (an allocation that failed, so the
# allocator synchronized the device, freed its cached blocks and tried again) and cudaMalloc calls.
ALLOCATOR_COUNTS = {"alloc_retries": "num_alloc_retries", "cuda_mallocs": "num_device_alloc"}


class StepClock:
    """``with clock("name"):`` adds the block's wall time to ``clock.times["name"]``; on CUDA it also
    keeps the most memory torch allocated, and the caching allocator reserved, in each of the step's stages,
    and how often the allocator retried or called cudaMalloc in each (allocator counters: no device read).

    ``uncounted()``: bytes those counters hold that the device does not (a rollout engine's sleeping pool,
    :meth:`fastrlhf.rollout.base.RolloutEngine.asleep_bytes`). A stage's peak leaves out the least of them at
    its two ends: an engine asleep through the stage (score, train) is left out; one that slept or woke
    inside it held its memory for real at one end, which the peak then rightly counts."""

    def __init__(self, device: torch.device | None = None, uncounted: Callable[[], int] = lambda: 0):
        self.times: dict[str, float] = {}
        self.device = device if device is not None and device.type == "cuda" else None
        self.uncounted = uncounted
        self.allocated: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.churn: dict[str, dict[str, int]] = {}
        self._uncounted_at_start: dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        tracked = self.device is not None and name in STAGES
        if tracked:
            self.restart_peak(name)
            counts = self._allocator_counts()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(STAGE_PREFIX + name):  # trainer.profile_step's stages
                yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
            if tracked:
                churn = self.churn.setdefault(name, dict.fromkeys(ALLOCATOR_COUNTS, 0))
                for key, n in self._allocator_counts().items():
                    churn[key] += n - counts[key]
                left_out = min(self._uncounted_at_start.pop(name), self.uncounted())
                self.allocated[name] = max(self.allocated.get(name, 0),
                                           torch.cuda.max_memory_allocated(self.device) - left_out)
                self.reserved[name] = max(self.reserved.get(name, 0),
                                          torch.cuda.max_memory_reserved(self.device) - left_out)

    def _allocator_counts(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.device)
        return {key: int(stats.get(name, 0)) for key, name in ALLOCATOR_COUNTS.items()}

    def restart_peak(self, name: str) -> None:
        """Stage ``name``'s peak counts from here. The sync calls it once it has freed the update's cached
        blocks and woken the engine's weights: before that its counters read the update's, with the sleeping
        engine's bytes as if held, which the train stage has already counted without them."""
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._uncounted_at_start[name] = self.uncounted()

    def memory(self) -> dict[str, float]:
        """The step's memory metrics (see ``fastrlhf/rl/step.py``'s docstring), in GiB."""
        gib = 2.0**30
        if self.device is None:
            import resource

            return {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
        free, total = torch.cuda.mem_get_info(self.device)
        held_by_allocator = torch.cuda.memory_reserved(self.device) - self.uncounted()
        return {**{f"memory/{name}_gib": n / gib for name, n in self.allocated.items()},
                # Which stage the allocator's peak comes from: a stage's caching can outlast it (its blocks stay
                # reserved until emptied), so a later stage's figure is at least the cache it inherited.
                **{f"memory/{name}_reserved_gib": n / gib for name, n in self.reserved.items()},
                "memory/peak_reserved_gib": max(self.reserved.values(), default=0) / gib,
                # Allocator churn: a retry synchronizes the device and frees the cache; a cudaMalloc costs the host.
                **{f"memory/{name}_{key}": float(n) for name, c in self.churn.items() for key, n in c.items()},
                "memory/context_gib": (total - free - held_by_allocator) / gib}


def setup_memory(device: torch.device) -> dict[str, float]:
    """What building the models and engines took of the caching allocator (its peaks so far), read once before the
    first step, which then starts from an emptied cache: blocks that only the set-up used (DeepSpeed's flattening
    and optimizer-state initialisation) would otherwise stay reserved for the whole run and read as the step's
    peak. Empty off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    gib = 2.0**30
    out = {"memory/setup_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
           "memory/setup_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
           "memory/setup_cached_gib": (torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)) / gib}
    torch.cuda.empty_cache()
    return out
