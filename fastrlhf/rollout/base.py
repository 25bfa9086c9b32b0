"""The interface every rollout engine implements, and the prompt checks they share."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

import torch

from fastrlhf.rollout.sampling import Completion, SamplingConfig

__all__ = ["RolloutEngine", "cut_at_stop_strings", "eos_token_ids_with", "new_token_limits", "stop_token_ids_for",
           "validate_prompts"]


def validate_prompts(prompt_token_ids, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """Check a batch of token-id prompts before any work starts; return it as a list of int lists.

    Raises a ValueError naming the prompt index for: an empty batch, an empty prompt, a token id
    outside ``[0, vocab_size)``, or a prompt that leaves no room for a new token within
    ``max_model_len``.
    """
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
        raise ValueError(f"prompt_token_ids must be a list of token-id lists, got {type(prompt_token_ids).__name__}")
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids is empty: expected at least one prompt")
    prompts = []
    for i, prompt in enumerate(prompt_token_ids):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise ValueError(f"prompt_token_ids[{i}] must be a list of ints, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"prompt_token_ids[{i}] is empty: expected at least one token id")
        prompt = [int(t) for t in prompt]
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids[{i}] has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if len(prompt) >= max_model_len:
            raise ValueError(
                f"prompt_token_ids[{i}] has {len(prompt)} tokens: expected fewer than max_model_len={max_model_len} "
                "to leave room for at least one new token"
            )
        prompts.append(prompt)
    return prompts


def new_token_limits(prompts: list[list[int]], sampling: SamplingConfig, max_model_len: int,
                     limits: Sequence[int] | None = None) -> list[int]:
    """New tokens each prompt may take: ``sampling.max_new_tokens``, the context left, and ``limits[i]``."""
    caps = [min(sampling.max_new_tokens, max_model_len - len(p)) for p in prompts]
    if limits is None:
        return caps
    if len(limits) != len(prompts) or any(int(m) < 1 for m in limits):
        raise ValueError(f"limits must hold one int >= 1 per prompt ({len(prompts)}), got {list(limits)}")
    return [min(c, int(m)) for c, m in zip(caps, limits, strict=True)]


def stop_token_ids_for(sampling: SamplingConfig, eos_token_ids: Sequence[int]) -> list[int]:
    """The model's eos ids (unless ``ignore_eos``) then ``sampling.stop_token_ids``, without repeats."""
    eos = [] if sampling.ignore_eos else list(eos_token_ids)
    return list(dict.fromkeys(eos + list(sampling.stop_token_ids)))


def eos_token_ids_with(eos_token_ids: Sequence[int], tokenizer) -> list[int]:
    """The model's eos ids plus the tokenizer's eos (a chat model's end-of-turn token is often only there)."""
    ids = list(eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is not None and int(eos) not in ids:
        ids.append(int(eos))
    return ids


def _stop_end(token_ids: list[int], stop: Sequence[str], tokenizer) -> int | None:
    """The length of the shortest prefix of ``token_ids`` whose text contains a stop string, or None."""

    def hit(k: int) -> bool:
        text = tokenizer.decode(token_ids[:k], skip_special_tokens=False)
        return any(s in text for s in stop)

    if not token_ids or not hit(len(token_ids)):
        return None
    lo, hi = 1, len(token_ids)  # hit(hi) holds; a longer prefix's text extends a shorter one's
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hit(mid) else (mid + 1, hi)
    return lo


def cut_at_stop_strings(results: list[list[Completion]], stop: Sequence[str], tokenizer) -> list[list[Completion]]:
    """Each completion ends at the token that completes its first stop string (kept, like a stop token).

    Token ids, not text, are what the trainer learns from, so the cut falls on a token boundary: the
    completing token stays and its finish_reason becomes "stop". Completions without a stop string
    are returned unchanged.
    """
    if not stop:
        return results
    if tokenizer is None:
        raise ValueError("stop strings need the engine's tokenizer (rollout engines take tokenizer=...)")
    out = []
    for samples in results:
        row = []
        for c in samples:
            end = _stop_end(c.token_ids, stop, tokenizer)
            if end is None:
                row.append(c)
            else:
                row.append(Completion(c.token_ids[:end], c.logprobs[:end], "stop"))
        out.append(row)
    return out


class RolloutEngine(abc.ABC):
    """Generates completions from token-id prompts and takes new weights from the trainer.

    Subclasses set ``_vocab_size`` and ``_max_model_len`` (prompt + completion tokens) when built.
    """

    #: "vllm" or "hf", the name ``choose_engine_kind`` returns.
    kind: str = ""
    #: decodes completions for stop strings (None: token-id stops only)
    tokenizer = None
    _vocab_size: int
    _max_model_len: int

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype the engine holds weights in (what a weight sync converts to)."""
        return None

    @abc.abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 limits: Sequence[int] | None = None, seeds: Sequence[int] | None = None) -> list[list[Completion]]:
        """One list per prompt (in order) of ``sampling.n`` completions (in sample order). ``limits[i]``: at
        most this many new tokens for prompt i (below ``sampling.max_new_tokens``: an episode's remaining
        budget). ``seeds[i]``: prompt i's own seed instead of ``sampling.seed`` (an engine that seeds each
        request, vLLM, would otherwise draw the same random numbers for every prompt; one that samples the
        batch from one stream, HF, seeds it with ``seeds[0]``)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors; the next ``generate`` uses only the new weights (no stale cache)."""

    needs_sync = False  # True while the engine waits for update_weights before it may generate (see sleep)
    sync_at_start = False  # whether the trainer should sync once before the first step (VLLMEngine on CPU)
    # Whether sleep() gives device memory back (vLLM's sleep mode on CUDA). Only then does the trainer empty its
    # allocator's cache around the update, for the engine to take the memory back at wake: for an engine that keeps
    # its memory the emptied blocks serve nobody, and the next update pays for its cudaMallocs again.
    sleep_frees_device = False

    def sleep(self) -> None:  # noqa: B027 (engines without a sleep mode stay awake)
        """Free the engine's device memory (weights to host, KV cache dropped) until the next use; an
        engine that drops its weights instead sets ``needs_sync`` until ``update_weights``."""

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:  # noqa: B027
        """Bring back what :meth:`sleep` freed; ``generate`` and ``update_weights`` wake what they need."""

    def asleep_bytes(self) -> int:
        """Device memory that :meth:`sleep` released but torch's allocator counters still count (vLLM's
        sleep pool); the step's memory metrics leave it out. 0 for engines whose sleep frees nothing so."""
        return 0

    def close(self) -> None:  # noqa: B027 (engines without resources need nothing here)
        """Release the engine's resources (the trainer's process group survives)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
