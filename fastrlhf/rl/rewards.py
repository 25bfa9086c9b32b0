"""Rewards: registered reward functions (by name or ``module:function``) and reward-model scoring.

A reward function is ``fn(prompt_ids: list[int], completion_ids: list[int], meta: dict) -> float``,
where ``meta`` is the prompt's record from the data file (e.g. a reference answer).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

__all__ = ["REWARD_FUNCTIONS", "RewardScorer", "register_reward", "resolve_reward_function"]

RewardFn = Callable[[list, list, dict], float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register_reward(name: str):
    """Decorator: make ``fn`` available as ``reward.function: <name>`` in a config."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARD_FUNCTIONS and REWARD_FUNCTIONS[name] is not fn:
            raise ValueError(f"a reward function named {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorator


@register_reward("target_token")
def target_token_reward(prompt_ids, completion_ids, meta) -> float:
    """Fraction of completion tokens equal to ``meta['target_token']`` (default 3): a toy task a tiny
    random model learns in a few dozen steps, for examples and smoke tests."""
    target = int(meta.get("target_token", 3)) if meta else 3
    return sum(t == target for t in completion_ids) / max(1, len(completion_ids))


@register_reward("length")
def length_reward(prompt_ids, completion_ids, meta) -> float:
    """Completion length over ``meta['max_len']`` (default 64), capped at 1."""
    limit = int(meta.get("max_len", 64)) if meta else 64
    return min(1.0, len(completion_ids) / limit)


@register_reward("match_answer")
def match_answer_reward(prompt_ids, completion_ids, meta) -> float:
    """1.0 when the completion starts with ``meta['answer_ids']`` (a token-id list), else 0.0."""
    answer = list(meta.get("answer_ids", [])) if meta else []
    return float(bool(answer) and list(completion_ids[: len(answer)]) == answer)


def resolve_reward_function(spec: str) -> RewardFn:
    """A registered name or ``package.module:function``; raises a one-line ValueError otherwise."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward.function must be a registered name or 'module:function', got {spec!r}")
    if ":" not in spec:
        if spec not in REWARD_FUNCTIONS:
            raise ValueError(f"unknown reward function {spec!r}; registered: {', '.join(sorted(REWARD_FUNCTIONS))} "
                             "(or give 'module:function')")
        return REWARD_FUNCTIONS[spec]
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward.function {spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.function {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


class RewardScorer:
    """Scores a batch: ``function`` on each (prompt, completion, meta), and/or a frozen reward model.

    With both, the scores add up. ``reward_model`` is a loaded module (frozen, eval mode).
    """

    def __init__(self, function: str | RewardFn | None = None, reward_model: torch.nn.Module | None = None,
                 model_kind: str = "classifier", label_index: int = 0, micro_batch: int | None = None):
        if function is None and reward_model is None:
            raise ValueError("no reward: set reward.function or reward.model_path")
        self.function = resolve_reward_function(function) if isinstance(function, str) else function
        self.reward_model = reward_model
        self.model_kind = model_kind
        self.label_index = label_index
        self.micro_batch = micro_batch

    def __call__(self, exp, prompts: list[list[int]], completions: list[list[int]], metas: list[dict]) -> torch.Tensor:
        """[B] fp32 scores of the sequences of ``exp``; ``prompts[b]``/``completions[b]``/``metas[b]`` per row."""
        scores = torch.zeros(exp.batch_size, dtype=torch.float32)
        if self.function is not None:
            values = [float(self.function(p, c, m)) for p, c, m in zip(prompts, completions, metas, strict=True)]
            scores += torch.tensor(values, dtype=torch.float32)
        if self.reward_model is not None:
            from fastrlhf.rl.forward import reward_model_scores

            scores += reward_model_scores(self.reward_model, exp, self.model_kind, self.label_index,
                                          self.micro_batch).cpu()
        return scores.to(exp.input_ids.device)
