"""Rewards: reward functions (by registered name or ``module:function``) and reward-model scoring.

Two forms of reward function:

* per sample, on token ids (``reward.function``), for rule rewards that need ids:
  ``fn(prompt_ids: list[int], completion_ids: list[int], meta: dict) -> float``;
* per batch, on text (``reward.functions``, TRL's signature):
  ``fn(prompts, completions, completion_ids: list[list[int]], **columns) -> list[float | None]``, where
  each column of the prompt rows (``answer``...) comes as a list with one value per completion. ``None``
  means "not applicable": that function adds nothing for that completion. Several are added up by their
  ``weight``; each is logged as ``reward/<name>``. ``prompts`` and ``completions`` take the form of
  ``reward.format`` (:func:`trl_texts`, or the text the model saw).

``meta`` / the columns are the prompt's row in the data file (every column but the prompt itself).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastrlhf.engine.device import to_device
from fastrlhf.engine.guards import StepFailed

__all__ = ["REWARD_FORMATS", "REWARD_FUNCTIONS", "RewardFunctionError", "RewardScorer", "TextReward",
           "completion_text", "register_reward", "required_columns", "resolve_reward_function",
           "resolve_text_rewards", "trl_texts"]

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
    # The current directory is importable under `python -m` and the deepspeed launcher but not under
    # the `fastrlhf` console script: make it so for both (last, so it never shadows an installed module).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward.function {spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.function {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


class RewardFunctionError(StepFailed):
    """A reward function raised or returned something unusable; the message is one line naming it.

    ``local``: it failed on this rank (else: on another rank, and this rank stops with it).
    """

    def __init__(self, message: str, local: bool = True):
        super().__init__(message)
        self.local = local


@dataclass(frozen=True)
class TextReward:
    name: str
    fn: Callable
    weight: float = 1.0


def resolve_text_rewards(specs) -> list[TextReward]:
    """``reward.functions`` entries (``function``, ``weight``) -> resolved :class:`TextReward` s."""
    rewards = []
    for spec in specs:
        fn = resolve_reward_function(spec.function)
        rewards.append(TextReward(getattr(fn, "__name__", spec.function), fn, float(spec.weight)))
    return rewards


TEXT_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids")


def required_columns(fn: Callable) -> list[str]:
    """The prompt-row columns a batch text reward ``fn(prompts, completions, completion_ids, **columns)``
    cannot do without: its named parameters with no default, other than those three (``*args`` and
    ``**kwargs`` need none). A callable whose signature cannot be read needs none."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters
            if p.kind in keyword and p.default is inspect.Parameter.empty and p.name not in TEXT_REWARD_ARGUMENTS]


REWARD_FORMATS = ("trl", "text")


def trl_texts(given: list, prompt_ids: list[list[int]], completion_text: list[str], tokenizer) -> tuple[list, list]:
    """``(prompts, completions)`` as TRL's GRPOTrainer passes them to a reward function, row by row (one
    per completion): a row given as messages -> its messages and ``[{"role": "assistant", "content":
    completion}]``; given as text -> that text and the completion's text; given as token ids (``given``
    None) -> the ids decoded, special tokens skipped, and the completion's text."""
    missing = [i for i, g in enumerate(given) if g is None]
    decoded = tokenizer.batch_decode([prompt_ids[i] for i in missing], skip_special_tokens=True) if missing else []
    decoded_at = dict(zip(missing, decoded, strict=True))
    prompts, completions = [], []
    for i, (prompt, text) in enumerate(zip(given, completion_text, strict=True)):
        if isinstance(prompt, list):
            # Each completion its own copy, as in TRL: a function that edits one (TRL's own trainer pops
            # from them) must edit neither the same row's other completions nor the data set.
            prompts.append(copy.deepcopy(prompt))
            completions.append([{"role": "assistant", "content": text}])
        else:
            prompts.append(decoded_at[i] if prompt is None else prompt)
            completions.append(text)
    return prompts, completions


def completion_text(completion) -> str:
    """A completion's text in either form a batch text reward receives: the string itself, or the content
    of TRL's conversational ``[{"role": "assistant", "content": text}]``."""
    if isinstance(completion, list):
        return completion[0]["content"]
    return completion


def _text_scores(reward: TextReward, prompts: list, completions: list, completion_ids: list[list[int]],
                 columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, applicable)`` ``[B]`` of one batch reward; None -> not applicable (value 0)."""
    n = len(completions)
    # Each function its own copy of the batch: what one edits never reaches the next.
    prompts, completions, completion_ids, columns = copy.deepcopy((prompts, completions, completion_ids, columns))
    try:
        values = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as exc:  # noqa: BLE001 -- any failure is reported as this function's, in one line
        detail = " ".join(str(exc).split())
        raise RewardFunctionError(f"reward function {reward.name!r} raised {type(exc).__name__} on a batch of {n} "
                                  f"completions: {detail}") from exc
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardFunctionError(f"reward function {reward.name!r} returned {got} for a batch of {n} completions; "
                                  "expected a list with one float (or None) per completion")
    applicable = torch.tensor([v is not None for v in values], dtype=torch.bool)
    return torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32), applicable


def retokenized(prompts: list[list[int]], completions: list[list[int]], tokenizer, reward_tokenizer, device):
    """The batch as a reward model with another vocabulary reads it: each prompt + completion decoded by
    the policy's tokenizer (special tokens dropped: the two vocabularies need not share them) and
    tokenized by the reward model's; an Experience whose "prompts" are those whole sequences (and
    whose completions are empty), so that the reward model reads each at its last token."""
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rollout import Completion

    texts = [tokenizer.decode(list(p) + list(c), skip_special_tokens=True) for p, c in zip(prompts, completions,
                                                                                            strict=True)]
    rows = [list(reward_tokenizer(t, add_special_tokens=True)["input_ids"]) or [0] for t in texts]
    pad = reward_tokenizer.pad_token_id if reward_tokenizer.pad_token_id is not None else 0
    return build_experience(rows, [[Completion([], [], "stop")] for _ in rows], pad, device)


class RewardScorer:
    """Scores a batch: ``function`` on each (prompt, completion, meta), batch ``text_rewards`` on the
    decoded text (with ``tokenizer``), and/or a frozen reward model; the scores add up. A reward model
    with a vocabulary of its own (``reward_tokenizer``) reads the text re-tokenized (:func:`retokenized`).

    ``reward_format`` (``reward.format``), the form of the text rewards' ``prompts`` and ``completions``:
    ``trl`` (:func:`trl_texts`, from each row's prompt as given: ``meta.prompt`` of a
    :class:`fastrlhf.data.Columns`) or ``text`` (the prompt the model saw, special tokens included, and
    the completion's text, special tokens skipped).

    ``reward_model`` is a loaded module (frozen, eval mode). After each call, :attr:`metrics` holds
    ``reward/<name>``: each text reward's mean over the completions it applied to (0 if none).
    """

    def __init__(self, function: str | RewardFn | None = None, reward_model: torch.nn.Module | None = None,
                 model_kind: str = "classifier", label_index: int = 0, micro_batch: int | None = None,
                 text_rewards: list[TextReward] = (), tokenizer=None, reward_tokenizer=None,
                 max_tokens: int | None = None, packed: bool = False, reward_format: str = "trl"):
        if reward_format not in REWARD_FORMATS:
            raise ValueError(f"reward_format must be one of {', '.join(REWARD_FORMATS)}, got {reward_format!r}")
        if function is None and reward_model is None and not text_rewards:
            raise ValueError("no reward: set reward.function, reward.functions or reward.model_path")
        if (text_rewards or reward_tokenizer is not None) and tokenizer is None:
            raise ValueError("reward.functions and a reward model with its own tokenizer read text: they need the "
                             "policy's tokenizer")
        self.function = resolve_reward_function(function) if isinstance(function, str) else function
        self.text_rewards = list(text_rewards)
        self.reward_format = reward_format
        self.tokenizer = tokenizer
        self.reward_model = reward_model
        self.reward_tokenizer = reward_tokenizer
        self.model_kind = model_kind
        self.label_index = label_index
        self.micro_batch = micro_batch
        # trainer.max_tokens_per_microbatch and trainer.packing, for the reward model's forward passes
        self.max_tokens, self.packed = max_tokens, packed
        self.metrics: dict[str, float] = {}

    def __call__(self, exp, prompts: list[list[int]], completions: list[list[int]], metas: list[dict]) -> torch.Tensor:
        """[B] fp32 scores of the sequences of ``exp``; ``prompts[b]``/``completions[b]``/``metas[b]`` per row."""
        scores = torch.zeros(exp.batch_size, dtype=torch.float32)
        if self.function is not None:
            values = [float(self.function(p, c, m)) for p, c, m in zip(prompts, completions, metas, strict=True)]
            scores += torch.tensor(values, dtype=torch.float32)
        if self.text_rewards:
            prompt_text, completion_text = self._texts(prompts, completions, metas)
            completion_ids = [list(c) for c in completions]
            columns = {k: [m.get(k) for m in metas] for k in sorted(set().union(*map(set, metas)))}
            for reward in self.text_rewards:
                values, applicable = _text_scores(reward, prompt_text, completion_text, completion_ids, columns)
                scores += reward.weight * values
                count = int(applicable.sum())
                self.metrics[f"reward/{reward.name}"] = float(values[applicable].sum()) / count if count else 0.0
        if self.reward_model is not None:
            from fastrlhf.rl.forward import reward_model_scores

            batch = exp
            if self.reward_tokenizer is not None:
                batch = retokenized(prompts, completions, self.tokenizer, self.reward_tokenizer, exp.input_ids.device)
            groups = None
            if self.max_tokens is not None:  # a replica on each rank: no count to agree on
                from fastrlhf.sequences.packing import token_budget_groups

                groups = token_budget_groups(batch.token_parts(), self.max_tokens, self.packed)
            scores += reward_model_scores(self.reward_model, batch, self.model_kind, self.label_index,
                                          self.micro_batch, groups=groups, packed=self.packed).cpu()
        return to_device(scores, exp.input_ids.device)

    def _texts(self, prompts: list[list[int]], completions: list[list[int]], metas: list[dict]) -> tuple[list, list]:
        """``(prompts, completions)`` for the text rewards, in ``reward_format``."""
        completion_text = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        if self.reward_format == "text":
            return self.tokenizer.batch_decode(prompts, skip_special_tokens=False), completion_text
        return trl_texts([getattr(m, "prompt", None) for m in metas], prompts, completion_text, self.tokenizer)
