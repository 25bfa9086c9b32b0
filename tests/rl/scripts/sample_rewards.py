"""Per-sample rewards (``reward.function``) for tests/rl/test_rl_text_rewards.py."""

import os

_calls = {"n": 0}


def _answer(completion_ids):
    if os.environ.get("RANK") == "1" and _calls["n"] == 3:
        raise ValueError("no answer in this completion")
    return 0.5


def raise_on_rank_1_at_step_2(prompt_ids, completion_ids, meta):
    """Fine on rank 0; raises on rank 1 at its first completion of step 2 (2 per rank and step), as a
    completion only that rank drew would."""
    _calls["n"] += 1
    return _answer(completion_ids)


def constant_logging_prompts(prompt_ids, completion_ids, meta):
    """0.5 for every completion (so every group's scores are equal), each call's prompt appended to the file
    ``FASTRLHF_TEST_PROMPT_LOG``: the prompts ``trainer.filter_groups`` drew."""
    import json

    with open(os.environ["FASTRLHF_TEST_PROMPT_LOG"], "a") as f:
        f.write(json.dumps(list(prompt_ids)) + "\n")
    return 0.5
