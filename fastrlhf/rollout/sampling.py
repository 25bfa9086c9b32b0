"""What to sample (SamplingConfig) and what comes back (Completion), shared by every rollout engine."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = ["SamplingConfig", "Completion", "FINISH_REASONS", "prompt_seeds", "rollout_sampling"]

FINISH_REASONS = ("stop", "length")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample completions.

    ``temperature == 0`` means greedy decoding. ``top_k == -1``, ``top_p == 1`` and ``min_p == 0`` switch
    truncation off; ``min_p`` drops the tokens whose probability is below ``min_p`` times the top token's.
    ``repetition_penalty`` (1: off) divides the positive logits of the tokens in the prompt or generated so
    far by it and multiplies their negative ones (HF's and vLLM's). The engines apply vLLM's order: the
    penalty on the raw logits (greedy too), then temperature, min-p, top-k, top-p; the returned logprobs
    are of that distribution, renormalised over the kept tokens (:class:`Completion`).

    Generation stops at the model's eos token (unless ``ignore_eos``), at any of
    ``stop_token_ids`` (the stop token is kept in the completion, finish_reason "stop"), or after
    ``max_new_tokens`` (finish_reason "length"). ``stop`` strings end a completion at the first
    token whose text completes one of them (that token is kept, finish_reason "stop"); they need
    the engine to have a tokenizer. A given ``seed`` makes sampling reproducible on the same engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingConfig.n must be an int >= 1, got {self.n!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or isinstance(self.temperature, bool)
            or not (self.temperature >= 0 and self.temperature != float("inf"))
        ):
            raise ValueError(
                f"SamplingConfig.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if self.temperature == 0 and self.n > 1:  # else each engine fails at generate, in its own words
            raise ValueError(f"SamplingConfig.n must be 1 with temperature 0 (greedy): {self.n} greedy completions "
                             "of a prompt are one completion repeated")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not (0 < self.top_p <= 1):
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"SamplingConfig.top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        if not _is_number(self.min_p) or not (0 <= self.min_p < 1):
            raise ValueError(f"SamplingConfig.min_p must be in [0, 1) (0: off), got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not (0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"SamplingConfig.repetition_penalty must be a finite number > 0 (1: off), got "
                             f"{self.repetition_penalty!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(
                f"SamplingConfig.stop_token_ids must be a sequence of ints >= 0, got {self.stop_token_ids!r}"
            ) from None
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(
                f"SamplingConfig.stop_token_ids must be a sequence of ints >= 0, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", stop)
        if isinstance(self.stop, str) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"SamplingConfig.stop must be a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingConfig.seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the returned logprobs are computed at (greedy reports them at 1, after any penalty)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution the engine
    sampled from: ``log_softmax(logits / temperature)`` (temperature 1 when greedy), the logits first
    rescaled by the repetition penalty where one is set, renormalised over the kept tokens when
    top-k/top-p/min-p truncation is on. With neither (``fastrlhf.config.rollout_checks.reshaping_settings``
    empty) it equals
    ``fastrlhf.algorithms.logprobs_from_logits(logits, token_ids, temperature)`` recomputed by the trainer.

    A multi-turn episode (``fastrlhf.rollout.episodes``) is one completion: ``mask[i]`` is 1 where the
    policy generated ``token_ids[i]`` and 0 on the tokens between its turns (tool results, template
    markers; their logprob is 0), and ``prompt_ids`` is its own prompt where that differs from its
    row's (an environment's ``reset`` text). ``mask`` None: every token is the policy's.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    extra: dict = field(default_factory=dict, repr=False)
    mask: list[int] | None = None
    prompt_ids: list[int] | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion.logprobs must have one entry per token: {len(self.token_ids)} token_ids "
                f"but {len(self.logprobs)} logprobs"
            )
        if self.mask is not None and len(self.mask) != len(self.token_ids):
            raise ValueError(f"Completion.mask must have one entry per token: {len(self.token_ids)} token_ids "
                             f"but {len(self.mask)} mask entries")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


def rollout_sampling(ro, seed: int | None, n: int | None = None, temperature: float | None = None,
                     max_new_tokens: int | None = None) -> SamplingConfig:
    """The SamplingConfig of ``ro`` (a RolloutConfig), with ``n``, ``temperature`` and ``max_new_tokens`` where given
    (validation's). Greedy drops top-k, top-p and min-p, which cannot change an argmax, and keeps the repetition
    penalty, which can (vLLM applies it before its greedy pick too)."""
    temperature = ro.temperature if temperature is None else temperature
    sampled = temperature != 0
    return SamplingConfig(n=ro.n if n is None else n, temperature=temperature,
                          top_p=ro.top_p if sampled else 1.0, top_k=ro.top_k if sampled else -1,
                          min_p=ro.min_p if sampled else 0.0, repetition_penalty=ro.repetition_penalty,
                          max_new_tokens=max_new_tokens or ro.max_new_tokens,
                          stop_token_ids=tuple(ro.stop_token_ids), stop=tuple(ro.stop), seed=seed)


def prompt_seeds(seed: int, prompts: list[list[int]]) -> list[int]:
    """One seed per prompt, for an engine that seeds each request (vLLM): from ``seed``, the prompt's tokens and
    how many equal prompts came before it in the batch. One seed for every request would draw the same random
    numbers for sample k of every prompt (the samples of different prompts coupled, the batch worth fewer
    independent ones); an index into the batch would make a prompt's samples depend on where it stands in it.
    vLLM gives sample k of a request ``seed + k``: hashed seeds keep those runs apart."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for prompt in prompts:
        key = tuple(prompt)
        repeat = seen[key] = seen.get(key, -1) + 1
        digest = hashlib.blake2b(repr((seed, repeat, key)).encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") % (2**31 - 2**16))  # room for seed + k below 2**31
    return out
