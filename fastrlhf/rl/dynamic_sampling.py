"""DAPO's dynamic sampling (``trainer.filter_groups``): train only on groups whose completions scored differently.

A group whose ``rollout.n`` completions all got the same score has zero group-relative advantage: it adds
nothing to the policy gradient but the KL term, while it still costs its share of every pass. Late in a run,
when most prompts are always solved (or never), most of a batch is such groups and the effective batch shrinks.
DAPO (Yu et al., 2025) sets them aside and samples more prompts until the batch is full of groups that differ.

Here every rank needs its own share (``prompts_per_step / world`` groups), as the update splits its minibatches
evenly over ranks. A round generates and scores one more batch of prompts on every rank; the ranks then agree
(one collective) whether any of them still lacks groups that differ, so that all run the same number of rounds
(generation under ZeRO-3 is a collective). After ``trainer.max_sampling_rounds`` rounds the share is filled
with all-equal groups, in the order they were drawn, and ``sampling/filled_fraction`` says how many.

Groups with a non-finite score always count as differing: they reach the step's guard, which skips the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastrlhf.distributed import comm
from fastrlhf.engine.device import host_read, to_device

__all__ = ["FILTER_READ", "SampledGroups", "differing_groups", "kept_reward_means", "pick_groups", "sample_groups"]

FILTER_READ = "which groups' scores differ (trainer.filter_groups)"


def differing_groups(scores: list[float], n: int) -> list[bool]:
    """For each group of ``n`` consecutive scores: whether they differ (or one is not finite)."""
    if len(scores) % n:
        raise ValueError(f"{len(scores)} scores do not split into groups of {n}")
    groups = [scores[i:i + n] for i in range(0, len(scores), n)]
    return [not all(map(math.isfinite, g)) or max(g) > min(g) for g in groups]


def pick_groups(differs: list[bool], share: int) -> tuple[list[int], int]:
    """The first ``share`` groups that differ, in draw order, topped up with the first all-equal ones where too few
    differ. Returns the kept group indices (in draw order) and how many of them are all-equal fillers."""
    kept = [i for i, d in enumerate(differs) if d][:share]
    fillers = [i for i, d in enumerate(differs) if not d][:share - len(kept)]
    if len(kept) + len(fillers) < share:
        raise ValueError(f"{len(differs)} groups cannot fill a share of {share}")
    return sorted(kept + fillers), len(fillers)


@dataclass
class SampledGroups:
    """The groups a step trains on (as many as the rank's share of prompts), their scores, and the rounds'
    metrics; ``generated_tokens``: the completion tokens of every round, kept or not; ``rows``: the kept
    completions' positions among all the rounds' completions, in the order scored."""

    prompts: list
    metas: list
    completions: list
    scores: torch.Tensor
    generated_tokens: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)


# generate_and_score(prompts, metas, round) -> (completions per prompt, [len(prompts) * n] scores, policy tokens)
GenerateAndScore = Callable[[list, list, int], tuple[list, torch.Tensor, int]]


def sample_groups(generate_and_score: GenerateAndScore, prompts: list, metas: list,
                  more_prompts: Callable[[], tuple[list, list]], n: int, max_rounds: int) -> SampledGroups:
    """Rounds of generation on this rank's prompts, then on ``more_prompts()``, until every rank holds its share
    of groups that differ or ``max_rounds`` rounds ran (a collective per round: call it on every rank)."""
    share = len(prompts)
    pool_prompts, pool_metas, pool_completions, pool_scores, differs = [], [], [], [], []
    generated, finite_sum, finite_count = 0, 0.0, 0
    for round_ in range(max_rounds):
        if round_:
            prompts, metas = more_prompts()
        completions, scores, tokens = generate_and_score(prompts, metas, round_)
        with host_read(FILTER_READ):  # one read per round: which groups differ is decided on the host
            host = scores.tolist()
        differs += differing_groups(host, n)
        pool_prompts += prompts
        pool_metas += metas
        pool_completions += completions
        pool_scores.append(scores)
        generated += tokens
        finite = [s for s in host if math.isfinite(s)]
        finite_sum, finite_count = finite_sum + sum(finite), finite_count + len(finite)
        lacking = sum(differs) < share
        if round_ + 1 == max_rounds or not comm.reduce_floats([float(lacking)], "max")[0]:
            break
    kept, filled = pick_groups(differs, share)
    all_scores = torch.cat(pool_scores)
    rows = [g * n + j for g in kept for j in range(n)]
    scores = all_scores.index_select(0, to_device(torch.tensor(rows, dtype=torch.long), all_scores.device))
    metrics = {"sampling/rounds": float(round_ + 1), "sampling/differing_fraction": sum(differs) / len(differs),
               "sampling/filled_fraction": filled / share,
               # the reward of every completion sampled, kept or not: the run's learning curve, unbiased by the filter
               "sampling/reward_mean": finite_sum / finite_count if finite_count else float("nan")}
    return SampledGroups([pool_prompts[g] for g in kept], [pool_metas[g] for g in kept],
                         [pool_completions[g] for g in kept], scores, float(generated), metrics, rows)


def kept_reward_means(parts: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], rows: list[int]) -> dict[str, float]:
    """``reward/<name>`` over the kept completions, as ``reward_mean`` is (``sampling/reward_mean`` covers every
    round): ``parts``, each round's named rewards per row (``RewardScorer.parts``), ``rows`` the kept positions
    among all rounds' rows (:attr:`SampledGroups.rows`)."""
    from fastrlhf.rl.rewards import reward_part_means

    kept = torch.tensor(rows, dtype=torch.long)
    pooled = {}
    for name in parts[0] if parts else {}:
        values, applicable = (torch.cat([round_parts[name][i] for round_parts in parts]) for i in (0, 1))
        pooled[name] = values[kept], applicable[kept]
    return reward_part_means(pooled)
