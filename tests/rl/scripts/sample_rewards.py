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
