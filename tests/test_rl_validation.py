"""Validation during RL (fastrlhf.rl.validation): greedy, one completion per prompt, this rank's shard,
scored by the validation reward and grouped by a meta key."""

import pytest

from fastrlhf.rl.validation import Validator
from fastrlhf.rollout import Completion


class RecordingEngine:
    """Answers each prompt with its own last token; records what it was asked."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        return [[Completion(token_ids=[p[-1]], logprobs=[0.0], finish_reason="stop")] for p in prompts]


def exact(prompt, completion, meta):
    return float(completion == [meta["answer"]])


def test_greedy_scores_per_group_of_this_ranks_shard():
    prompts = [[1, 7], [2, 8], [3, 9], [4, 5], [5, 6]]
    metas = [{"answer": 7, "kind": "a"}, {"answer": 0, "kind": "b"}, {"answer": 9, "kind": "a"},
             {"answer": 5, "kind": "b"}, {"answer": 6, "kind": "c"}]
    engine = RecordingEngine()
    # Rank 0 of 2 takes prompts 0, 2, 4 (all right); rank 1 would take 1 and 3.
    metrics = Validator(prompts, metas, exact, engine, max_new_tokens=4, stop_token_ids=[2], group_by="kind",
                        rank=0, world=2)()
    (asked, sampling), = engine.calls
    assert asked == [[1, 7], [3, 9], [5, 6]]
    assert sampling.n == 1 and sampling.temperature == 0.0 and sampling.max_new_tokens == 4
    assert sampling.stop_token_ids == (2,)
    # Group "b" has no prompt on this rank: 0 of 0 (the reduction over ranks fills it in a real run).
    assert metrics == {"eval_reward": 1.0, "eval_reward/a": 1.0, "eval_reward/b": 0.0, "eval_reward/c": 1.0}

    one_rank = Validator(prompts, metas, exact, RecordingEngine(), max_new_tokens=4, group_by="kind")()
    assert one_rank == {"eval_reward": 0.8, "eval_reward/a": 1.0, "eval_reward/b": 0.5, "eval_reward/c": 1.0}


def test_without_group_by_only_the_mean_is_reported():
    metrics = Validator([[1, 7], [2, 8]], [{"answer": 7}, {"answer": 7}], exact, RecordingEngine(),
                        max_new_tokens=1)()
    assert metrics == {"eval_reward": 0.5}


def test_no_prompts_is_an_error():
    with pytest.raises(ValueError, match="at least one prompt"):
        Validator([], [], exact, RecordingEngine(), max_new_tokens=1)
