"""Batch text rewards for tests/rl/test_rl_text_rewards.py (TRL's signature, dataset columns as kwargs)."""


def mentions_answer(prompts, completions, completion_ids, answer, **columns):
    """1.0 where the decoded completion contains the row's ``answer`` column, else 0.0."""
    return [float(a in c) for c, a in zip(completions, answer, strict=True)]


def chat_mentions_answer(prompts, completions, answer, **kwargs):
    """Written the TRL way for conversational rows: 1.0 where the assistant turn's content contains the
    row's ``answer``. Raises unless each prompt is the row's messages, ending with the user's turn."""
    if not all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts):
        raise TypeError(f"expected each prompt as the row's messages, got {prompts[0]!r}")
    return [float(a in c[0]["content"]) for c, a in zip(completions, answer, strict=True)]


def only_short(prompts, completions, completion_ids, **columns):
    """Applies to completions of at most 2 tokens; None (not applicable) for the others."""
    return [1.0 if len(ids) <= 2 else None for ids in completion_ids]


def boom(prompts, completions, completion_ids, **columns):
    raise KeyError("no column 'missing' in this batch")


_calls = {"n": 0}


def boom_on_rank_1_at_step_2(prompts, completions, completion_ids, **columns):
    """Fine on rank 0; raises on rank 1 at its second batch (step 2), as a row only that rank drew would."""
    import os

    _calls["n"] += 1
    if os.environ.get("RANK") == "1" and _calls["n"] == 2:
        raise ValueError("could not parse the answer of row 7")
    return [0.5] * len(completions)
