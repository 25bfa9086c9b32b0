"""Validation during RL (fastrlhf.rl.validation): this rank's shard of the held-out prompts, scored,
reduced into eval/reward_mean, eval/accuracy, eval/pass@n and per-group means, written per step."""

import json

import pytest
import torch

from fastrlhf.rl.validation import Validator
from fastrlhf.rollout import Completion, SamplingConfig

GREEDY = SamplingConfig(n=1, temperature=0.0, max_new_tokens=4, stop_token_ids=(2,))


class RecordingEngine:
    """Answers each prompt with its own last token plus the sample index; records what it was asked."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        return [[Completion(token_ids=[p[-1] + j], logprobs=[0.0], finish_reason="stop") for j in range(sampling.n)]
                for p in prompts]


def exact(prompts, completions, metas):
    return torch.tensor([float(c.token_ids == [m["answer"]]) for m, samples in zip(metas, completions, strict=True)
                         for c in samples])


PROMPTS = [[1, 7], [2, 8], [3, 9], [4, 5], [5, 6]]
METAS = [{"answer": 7, "kind": "a"}, {"answer": 0, "kind": "b"}, {"answer": 9, "kind": "a"},
         {"answer": 5, "kind": "b"}, {"answer": 6, "kind": "c"}]


def test_greedy_scores_per_group_of_this_ranks_shard(tmp_path):
    engine = RecordingEngine()
    # Rank 0 of 2 takes prompts 0, 2, 4 (all right); rank 1 would take 1 and 3.
    metrics = Validator(PROMPTS, METAS, exact, engine, GREEDY, group_by="kind", rank=0, world=2)(step=3)
    (asked, sampling), = engine.calls
    assert asked == [[1, 7], [3, 9], [5, 6]] and sampling is GREEDY
    # Group "b" has no prompt on this rank: 0 of 0 (the reduction over ranks fills it in a real run).
    assert metrics == {"eval/reward_mean": 1.0, "eval/accuracy": 1.0, "eval/reward_mean/a": 1.0,
                       "eval/reward_mean/b": 0.0, "eval/reward_mean/c": 1.0}

    one_rank = Validator(PROMPTS, METAS, exact, RecordingEngine(), GREEDY, group_by="kind")(step=3)
    assert one_rank == {"eval/reward_mean": 0.8, "eval/accuracy": 0.8, "eval/reward_mean/a": 1.0,
                        "eval/reward_mean/b": 0.5, "eval/reward_mean/c": 1.0}


def test_accuracy_counts_rewards_at_the_maximum_and_pass_at_n_counts_prompts():
    def half_credit(prompts, completions, metas):  # 1.0 for the answer, 0.5 for anything else
        return 0.5 + 0.5 * exact(prompts, completions, metas)

    sampled = SamplingConfig(n=2, temperature=1.0, max_new_tokens=1)
    metrics = Validator(PROMPTS, METAS, half_credit, RecordingEngine(), sampled)(step=1)
    # Sample 0 answers p[-1], sample 1 answers p[-1] + 1: right for prompts 0, 2, 3, 4 (sample 0 only).
    assert metrics["eval/accuracy"] == pytest.approx(4 / 10)
    assert metrics["eval/reward_mean"] == pytest.approx((4 * 1.0 + 6 * 0.5) / 10)
    assert metrics["eval/pass@2"] == pytest.approx(4 / 5)
    strict = Validator(PROMPTS, METAS, half_credit, RecordingEngine(), sampled, max_reward=1.5)(step=1)
    assert strict["eval/accuracy"] == 0.0 and strict["eval/pass@2"] == 0.0


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_every_completion_is_written_per_step_in_prompt_order(tmp_path):
    validator = Validator(PROMPTS, METAS, exact, RecordingEngine(), GREEDY, output_dir=str(tmp_path))
    validator(step=0)
    validator(step=4)
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["step-0.jsonl", "step-4.jsonl"]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "step-4.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["correct"] for r in rows] == [True, False, True, True, True]
    assert rows[1] == {"index": 1, "reward": 0.0, "correct": False, "finish_reason": "stop", "completion_ids": [8],
                       "answer": 0, "kind": "b"}
    # With a tokenizer the prompt and completion are written as text.
    Validator(PROMPTS, METAS, exact, RecordingEngine(), GREEDY, output_dir=str(tmp_path),
              tokenizer=CharTokenizer())(step=5)
    first = json.loads((tmp_path / "eval" / "step-5.jsonl").read_text().splitlines()[0])
    assert (first["prompt"], first["completion"]) == ("bh", "h")


def test_no_prompts_is_an_error():
    with pytest.raises(ValueError, match="at least one prompt"):
        Validator([], [], exact, RecordingEngine(), GREEDY)


def test_a_shard_is_generated_in_calls_of_at_most_the_steps_sequences():
    """GSM8K's 1,319 prompts x eval.n 4 on 8 ranks asked the HF engine for 660 sequences in one call, a KV cache
    the memory plan (sized by the step's batch) never counted. The metrics are those of one call."""
    sampled = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4)
    engine = RecordingEngine()
    chunked = Validator(PROMPTS, METAS, exact, engine, sampled, group_by="kind", max_sequences_per_call=5)(step=1)
    assert [len(prompts) for prompts, _ in engine.calls] == [2, 2, 1]  # 5 sequences fit 2 prompts of n = 2
    whole = Validator(PROMPTS, METAS, exact, RecordingEngine(), sampled, group_by="kind")(step=1)
    assert chunked == whole


@pytest.mark.parametrize("kind, per_call", [("hf", 6), ("vllm", None)])
def test_the_run_caps_an_hf_engines_calls_at_the_steps_sequences_per_rank(kind, per_call):
    """prompts_per_step 3 on one rank, rollout.n 2: 6 sequences a step, so 6 // eval.n eval prompts a call."""
    from types import SimpleNamespace

    from fastrlhf.rl.trainer import build_validator
    from tests.helpers.rl_case import make_config

    config = make_config(n=2, prompts_per_step=3)
    eval_examples = [SimpleNamespace(prompt_ids=p, meta=m) for p, m in zip(PROMPTS, METAS, strict=True)]
    rl_step = SimpleNamespace(rollout=SimpleNamespace(kind=kind), episodes=None, score_rollout=exact)
    validator = build_validator(config, eval_examples, rl_step, tokenizer=None)
    assert validator.prompts_per_call == (per_call and per_call // config.eval.n)
