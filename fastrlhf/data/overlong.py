"""``data.overlong`` of SFT and reward-model data: what an example over ``data.max_len`` (or ``data.max_prompt_len``)
becomes: a bad line (``error``), left out (``skip``), or, for SFT, cut (``truncate``)."""

from __future__ import annotations

import os
import sys

__all__ = ["overlong_skips", "say_truncated", "truncated"]


def overlong_skips(overlong: str, choices: tuple[str, ...] = ("error", "skip")) -> bool:
    """Whether an overlong example is left out (``skip``); a ValueError for a choice this data does not offer."""
    if overlong not in choices:
        raise ValueError(f"overlong must be one of {', '.join(choices)}, got {overlong!r}")
    return overlong == "skip"


def truncated(prompt: list[int], response: list[int], mask: list[int] | None, max_len: int,
              max_prompt_len: int | None) -> tuple[list[int], list[int], list[int] | None] | None:
    """SFT's ``truncate``: a prompt over ``max_prompt_len`` keeps its end (as a prompt of ``fastrlhf train`` does);
    then the example keeps its first ``max_len`` tokens, as TRL's SFTTrainer truncates (``truncation_mode:
    keep_start``), the response losing its end and its EOS. ``None`` when no trained response token is left; the
    same lists when the example is within both limits."""
    if max_prompt_len is not None and len(prompt) > max_prompt_len:
        prompt = prompt[len(prompt) - max_prompt_len:]
    room = max(max_len - len(prompt), 0)
    if len(response) > room:
        response, mask = response[:room], mask[:room] if mask is not None else None
    if not response or (mask is not None and not any(mask)):
        return None
    return prompt, response, mask


def say_truncated(path: str, count: int, total: int, max_len: int, max_prompt_len: int | None) -> None:
    if count and os.environ.get("RANK", "0") == "0":
        limits = f"data.max_len ({max_len} tokens)" + (
            f" or data.max_prompt_len ({max_prompt_len})" if max_prompt_len is not None else "")
        print(f"data: truncated {count} of {total} examples of {path} to {limits}", file=sys.stderr, flush=True)
