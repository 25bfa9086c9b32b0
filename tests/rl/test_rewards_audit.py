"""Audit of the rewards area: ``reward/<name>`` reduced over ranks by count, and TRL's warning for a completion
no reward applies to."""

import warnings
from types import SimpleNamespace

import pytest
import torch

from fastrlhf.rl import step_metrics
from fastrlhf.rl.rewards import RewardScorer, TextReward, reward_part_means


def _batch(b):
    return SimpleNamespace(scores=torch.zeros(b), response_mask=torch.ones(b, 2), batch_size=b)


def _reduce_two_ranks(monkeypatch, mine: dict, other: dict, b: int = 8) -> dict:
    """``reduce_step_metrics`` on this rank, with the collectives adding (or maxing) the other rank's vector."""
    times = dict.fromkeys(step_metrics.STAGES, 0.0)
    seen = []
    monkeypatch.setattr(step_metrics.comm, "all_reduce_", lambda t, op="sum": seen.append(t.clone()) or t)
    step_metrics.reduce_step_metrics(_batch(b), other, times, 1, skipped=False, skipped_total=0, world=2)
    theirs = seen[0]
    monkeypatch.setattr(
        step_metrics.comm, "all_reduce_", lambda t, op="sum": t + theirs if op == "sum" else torch.maximum(t, theirs)
    )
    return step_metrics.reduce_step_metrics(_batch(b), mine, times, 1, skipped=False, skipped_total=0, world=2)


def test_reward_part_means_are_reduced_over_ranks_by_the_completions_each_applied_to(monkeypatch):
    # Rank 0: the reward applied to 1 completion (1.0); rank 1: to 7 (0.0 each). TRL's nanmean over the
    # gathered rewards: 1/8, not the mean of the ranks' means (0.5).
    mine = reward_part_means({"acc": (torch.tensor([1.0] + [0.0] * 7), torch.tensor([True] + [False] * 7))})
    other = reward_part_means({"acc": (torch.zeros(8), torch.tensor([True] * 7 + [False]))})
    assert mine == {"reward/acc": 1.0} and other == {"reward/acc": 0.0}  # each rank's own mean is unchanged
    metrics = _reduce_two_ranks(monkeypatch, mine, other)
    assert metrics["reward/acc"] == pytest.approx(1 / 8)
    assert not any(k.startswith(step_metrics.COUNT_PREFIX) for k in metrics)  # counts are no metric


def test_a_rank_where_a_reward_never_applied_does_not_pull_its_mean_down(monkeypatch):
    mine = reward_part_means({"acc": (torch.zeros(4), torch.zeros(4, dtype=torch.bool))})
    other = reward_part_means({"acc": (torch.full((4,), 0.5), torch.ones(4, dtype=torch.bool))})
    metrics = _reduce_two_ranks(monkeypatch, mine, other, b=4)
    assert metrics["reward/acc"] == pytest.approx(0.5)
    # Plain means keep the mean of the ranks' means.
    assert _reduce_two_ranks(monkeypatch, {"x": 1.0}, {"x": 0.0}, b=4)["x"] == pytest.approx(0.5)


class _Chars:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(ord("a") + t) for t in row) for row in rows]


def test_a_completion_no_reward_applies_to_scores_0_with_trls_warning():
    def math_only(prompts, completions, completion_ids, kind, **_):
        return [1.0 if k == "math" else None for k in kind]

    scorer = RewardScorer(text_rewards=[TextReward("math_only", math_only, 2.0)], tokenizer=_Chars())
    metas = [{"kind": "math"}, {"kind": "code"}]
    with pytest.warns(UserWarning, match=r"None for 1 of 2 completions.*'kind': 'code'"):
        scores = scorer(None, [[0], [1]], [[2], [3]], metas)
    assert scores.tolist() == [2.0, 0.0]  # nansum: the unscored completion gets 0, as in TRL
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every completion scored: no warning
        scorer(None, [[0], [1]], [[2], [3]], [{"kind": "math"}, {"kind": "math"}])
