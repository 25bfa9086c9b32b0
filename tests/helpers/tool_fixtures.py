"""Tools, an environment and a scripted policy for the episode tests (importable as ``module:name`` specs)."""

from __future__ import annotations

import time

from fastrlhf.rollout import Completion


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


def explode(x: int) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("boom")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def number(x: int) -> str:
    """Returns a number, not a string.

    Args:
        x: anything
    """
    return x  # type: ignore[return-value]


class Counter:
    """A TRL-style environment: ``reset(**row)``, public methods as tools, ``get_reward()``."""

    def reset(self, start: int = 0, **row) -> str:
        self.value = int(start)
        return f" (the counter starts at {self.value})"

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.value += by
        return str(self.value)

    def get_reward(self) -> float:
        return float(self.value)


class ScriptedEngine:
    """A rollout engine whose "policy" follows a script: ``script[question][k]`` is the text of assistant turn
    k of the episode of the prompt whose user message is ``question`` (found in the decoded prompt).

    Each turn's tokens are the text's ids plus eos (unless the text ends with ``<cut>``: then none, and
    finish_reason "length"); logprob -0.25 per token. Records each call's batch size, n and limits.
    """

    kind = "scripted"

    def __init__(self, tokenizer, script: dict[str, list[str]], max_model_len: int = 1024):
        self.tokenizer, self.script = tokenizer, script
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.max_model_len, self.vocab_size = max_model_len, len(tokenizer)
        self.calls: list[dict] = []

    def _turn(self, prompt: list[int], cap: int) -> Completion:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        question = next(q for q in self.script if q in text)
        k = text.count("<|im_start|>assistant") - 1
        turns = self.script[question]
        said = turns[min(k, len(turns) - 1)]
        cut = said.endswith("<cut>")
        ids = list(self.tokenizer(said.removesuffix("<cut>"), add_special_tokens=False)["input_ids"])
        ids = ids if cut else ids + self.eos_token_ids
        reason = "length" if cut or len(ids) > cap else "stop"
        ids = ids[:cap]
        return Completion(ids, [-0.25] * len(ids), reason)

    def generate(self, prompts, sampling, limits=None, seeds=None):
        self.calls.append({"batch": len(prompts), "n": sampling.n, "limits": limits, "seeds": seeds,
                           "lengths": [len(p) for p in prompts]})
        caps = limits or [sampling.max_new_tokens] * len(prompts)
        return [[self._turn(p, min(c, sampling.max_new_tokens)) for _ in range(sampling.n)]
                for p, c in zip(prompts, caps, strict=True)]
