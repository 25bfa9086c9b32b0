"""Rewards of the arithmetic example, in TRL's signature for ``reward.functions``:

    fn(prompts, completions, completion_ids, answer, **columns) -> list[float | None]

The rows are chats (``messages``), so in the default ``reward.format: trl`` each prompt is the row's
messages and each completion TRL's ``[{"role": "assistant", "content": text}]``; a plain string (a text
prompt, ``reward.format: text``, or :mod:`examples.arithmetic.evaluate`) is read as well.
``answer`` is the prompt row's ``answer`` column (one value per completion); ``None`` means "not
applicable" (a row without an answer), which adds nothing to that completion's reward.

- :func:`correctness`: 1.0 when the completion states the answer (``The answer is <number>``, the
  last such statement) and it equals the row's ``answer``, else 0.0. A strict reader, as GSM8K's
  ``####`` convention and verl's GSM8K reward (``method="strict"``): ``"That makes 12 apples."`` is
  not an answer, because a grader cannot tell the result from any other number in free text;
- :func:`format_reward`: 1.0 when the completion ends with ``The answer is <number>.`` (and has
  nothing after it), else 0.0: a small second signal that keeps the worked format.
"""

from __future__ import annotations

import re

from fastrlhf.rl.rewards import completion_text

__all__ = ["NUMBER", "extract_answer", "to_number", "correctness", "format_reward"]

NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_ANSWER_IS = re.compile(r"answer is\s*:?\s*\$?\s*(" + NUMBER + r")", re.IGNORECASE)
_FORMAT = re.compile(r"The answer is (" + NUMBER + r")\.\s*$")


def to_number(text: str) -> float | None:
    """``"1,200"`` -> 1200.0; None where the text is not a number."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def extract_answer(completion: str) -> float | None:
    """The completion's stated answer: the number after its last "The answer is", else None.
    ``"7 + 5 = 12. The answer is 12."`` -> 12.0; ``"the answer is: 1,200"`` -> 1200.0;
    ``"7 + 5 = 12. That makes 12 apples."`` -> None."""
    if not isinstance(completion, str):
        return None
    stated = _ANSWER_IS.findall(completion)
    return to_number(stated[-1]) if stated else None


def answer_matches(completions, answer, extract=extract_answer) -> list[float | None]:
    """1.0 where ``extract`` finds in a completion (text or TRL's assistant turn) the number of the row's
    ``answer``, 0.0 where it finds another or none; None where the row has no answer that is a number."""
    out: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        target = None if expected is None else to_number(str(expected))
        if target is None:
            out.append(None)
            continue
        got = extract(completion_text(completion))
        out.append(float(got is not None and abs(got - target) < 1e-9))
    return out


def correctness(prompts, completions, completion_ids, answer, **kwargs) -> list[float | None]:
    """1.0 where the completion's stated answer equals ``answer``, 0.0 where it differs or is not stated;
    None where the row has no answer (or one that is not a number)."""
    return answer_matches(completions, answer)


def format_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]:
    """1.0 where the completion ends with "The answer is <number>." (nothing after), else 0.0."""
    texts = (completion_text(c) for c in completions)
    return [float(isinstance(t, str) and _FORMAT.search(t) is not None) for t in texts]
