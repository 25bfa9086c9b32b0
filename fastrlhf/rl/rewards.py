"""Rewards: reward functions (by registered name or ``module:function``) and reward-model scoring.

Two forms of reward function:

* per sample, on token ids (``reward.function``), for rule rewards that need ids:
  ``fn(prompt_ids: list[int], completion_ids: list[int], meta: dict) -> float | None``;
* per batch, on text (``reward.functions``, TRL's signature):
  ``fn(prompts, completions, completion_ids: list[list[int]], **columns) -> list[float | None]``, where
  each column of the prompt rows (``answer``...) comes as a list with one value per completion. Several
  are added up by their ``weight``; each is logged as ``reward/<name>``. ``prompts`` and ``completions``
  take the form of ``reward.format`` (:func:`trl_texts`, or the text the model saw).

``meta`` / the columns are the prompt's row in the data file (every column but the prompt itself).

Both forms go through one path (:mod:`fastrlhf.rl.reward_results`), and what they return is read as TRL
reads it. ``None`` means "no reward for this completion from this function": it adds nothing (a completion no
function scores gets 0, as TRL's ``nansum`` gives, with TRL's warning). NaN is not None here: it reaches the
scores, and the NaN guard skips the step (and counts it), as for any non-finite input of an update.

A failure is a :class:`RewardFunctionError`, agreed by every rank (:func:`agree_on_reward_failure`). A
function that raises ends the run with exit code 1 (``--resume`` retries the step); one whose result has the
wrong type or length is wrong as written: exit code 2.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastrlhf.engine.device import to_device
from fastrlhf.rl.reward_results import (
    RewardFunctionError,
    agree_on_reward_failure,
    batch_scores,
    environment_scores,
    sample_scores,
    user_frames,
)

__all__ = ["REWARD_FORMATS", "REWARD_FUNCTIONS", "RewardFunctionError", "RewardScorer", "TextReward",
           "agree_on_reward_failure", "completion_text", "register_reward", "required_columns",
           "resolve_reward_function", "reward_part_means", "resolve_text_rewards", "trl_texts", "user_frames"]

RewardFn = Callable[[list, list, dict], float | None]
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


def resolve_reward_function(spec: str, key: str = "reward.function") -> RewardFn:
    """A registered name or ``package.module:function``; raises a one-line ValueError naming ``key`` (the setting
    that gave ``spec``) otherwise."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key} must be a registered name or 'module:function', got {spec!r}")
    if ":" not in spec:
        if spec not in REWARD_FUNCTIONS:
            raise ValueError(f"unknown reward function {spec!r}; registered: {', '.join(sorted(REWARD_FUNCTIONS))} "
                             "(or give 'module:function')")
        return REWARD_FUNCTIONS[spec]
    from fastrlhf.config.loading import cwd_importable

    module_name, _, attr = spec.partition(":")
    cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key} {spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key} {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


@dataclass(frozen=True)
class TextReward:
    name: str
    fn: Callable
    weight: float = 1.0


def resolve_text_rewards(specs) -> list[TextReward]:
    """``reward.functions`` entries (``function``, ``weight``) -> resolved :class:`TextReward` s."""
    rewards = []
    for i, spec in enumerate(specs):
        fn = resolve_reward_function(spec.function, f"reward.functions[{i}].function")
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


def trl_texts(given: list, prompt_ids: list[list[int]], completion_text: list[str], tokenizer,
              conversations: list | None = None) -> tuple[list, list]:
    """``(prompts, completions)`` as TRL's GRPOTrainer passes them to a reward function, row by row (one
    per completion): a row given as messages -> its messages and ``[{"role": "assistant", "content":
    completion}]`` (an episode: every message it added, assistant and tool turns, ``conversations[i]``);
    given as text -> that text and the completion's text; given as token ids (``given`` None) -> the ids
    decoded, special tokens skipped, and the completion's text."""
    missing = [i for i, g in enumerate(given) if g is None]
    decoded = tokenizer.batch_decode([prompt_ids[i] for i in missing], skip_special_tokens=True) if missing else []
    decoded_at = dict(zip(missing, decoded, strict=True))
    prompts, completions = [], []
    for i, (prompt, text) in enumerate(zip(given, completion_text, strict=True)):
        if isinstance(prompt, list):
            # Each completion its own copy, as in TRL: a function that edits one (TRL's own trainer pops
            # from them) must edit neither the same row's other completions nor the data set.
            prompts.append(copy.deepcopy(prompt))
            conversation = conversations[i] if conversations is not None else None
            completions.append(copy.deepcopy(conversation) if conversation is not None
                               else [{"role": "assistant", "content": text}])
        else:
            prompts.append(decoded_at[i] if prompt is None else prompt)
            completions.append(text)
    return prompts, completions


def completion_text(completion) -> str:
    """A completion's text in either form a batch text reward receives: the string itself, or the content
    of the last assistant message of TRL's conversational form (``[{"role": "assistant", "content": text}]``;
    an episode's list of assistant and tool messages: its final answer)."""
    if isinstance(completion, list):
        said = [m for m in completion if m.get("role") == "assistant"]
        return (said[-1] if said else completion[-1]).get("content") or ""
    return completion


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
    # A completion that stopped at a special token (its EOS, dropped from the text) ends with the reward model's EOS,
    # where `fastrlhf rm` trains it to score (replies + EOS) and where a shared vocabulary reads it; a cut one does not
    eos, ends = reward_tokenizer.eos_token_id, set(tokenizer.all_special_ids)
    for row, completion in zip(rows, completions, strict=True):
        if eos is not None and len(completion) and int(completion[-1]) in ends and row[-1] != eos:
            row.append(eos)
    pad = reward_tokenizer.pad_token_id if reward_tokenizer.pad_token_id is not None else 0
    return build_experience(rows, [[Completion([], [], "stop")] for _ in rows], pad, device)


def reward_part_means(parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """``reward/<name>``: each named reward's mean over the rows it applied to (0 where none), from its per-row
    ``(values, applicable)`` (host tensors); each a :class:`CountedMean`, so that the ranks' means are reduced by
    their counts of such rows."""
    from fastrlhf.rl.step_metrics import CountedMean

    return {f"reward/{name}": CountedMean(float(values[applicable].sum()) / max(int(applicable.sum()), 1),
                                          int(applicable.sum()))
            for name, (values, applicable) in parts.items()}


def unscored(scored: torch.Tensor, prompts: list, completions: list, metas: list) -> None:
    """Warns, as TRL does, that every reward returned None for some completions: they get 0, which a user
    whose functions were meant to cover every row (a dataset with a kind of prompt none of them knows) must
    hear about."""
    missing = (~scored).nonzero().flatten().tolist()
    i = missing[0]
    row = {"prompt_ids": list(prompts[i]), "completion_ids": list(completions[i]), **dict(metas[i] or {})}
    shown = {k: v if len(repr(v)) <= 80 else repr(v)[:77] + "..." for k, v in row.items()}
    warnings.warn(f"every reward returned None for {len(missing)} of {len(scored)} completions (they get reward 0), "
                  f"the first ({i}): {shown}. Please make sure that some reward applies to every completion.",
                  stacklevel=3)


class RewardScorer:
    """Scores a batch: ``function`` on each (prompt, completion, meta), batch ``text_rewards`` on the
    decoded text (with ``tokenizer``), and/or a frozen reward model; the scores add up. A reward model
    with a vocabulary of its own (``reward_tokenizer``) reads the text re-tokenized (:func:`retokenized`).

    ``reward_format`` (``reward.format``), the form of the text rewards' ``prompts`` and ``completions``:
    ``trl`` (:func:`trl_texts`, from each row's prompt as given: ``meta.prompt`` of a
    :class:`fastrlhf.data.Columns`) or ``text`` (the prompt the model saw, special tokens included, and
    the completion's text, special tokens skipped).

    ``reward_model`` is a loaded module (frozen, eval mode); ``normalize`` (``reward.normalize``) ``stored``: its
    scores are normalised by the mean and std of its config (:func:`fastrlhf.rl.reward_norm.stored_moments`). After
    each call, :attr:`parts` holds each named
    reward's per-row ``(values, applicable)`` and :attr:`metrics` their ``reward/<name>``: each one's mean over
    the completions it applied to (0 if none), as :func:`reward_part_means` computes it.
    """

    def __init__(self, function: str | RewardFn | None = None, reward_model: torch.nn.Module | None = None,
                 model_kind: str = "classifier", label_index: int = 0, micro_batch: int | None = None,
                 text_rewards: list[TextReward] = (), tokenizer=None, reward_tokenizer=None,
                 max_tokens: int | None = None, packed: bool = False, reward_format: str = "trl",
                 environment_reward: str | None = None, normalize: bool | str = False):
        if reward_format not in REWARD_FORMATS:
            raise ValueError(f"reward_format must be one of {', '.join(REWARD_FORMATS)}, got {reward_format!r}")
        if function is None and reward_model is None and not text_rewards and environment_reward is None:
            raise ValueError("no reward: set reward.function, reward.functions or reward.model_path")
        # rollout.environment's class name when it has get_reward(): each episode's own score, logged under it
        self.environment_reward = environment_reward
        if (text_rewards or reward_tokenizer is not None) and tokenizer is None:
            raise ValueError("reward.functions and a reward model with its own tokenizer read text: they need the "
                             "policy's tokenizer")
        self.function = resolve_reward_function(function) if isinstance(function, str) else function
        self.function_name = getattr(self.function, "__name__", str(function))  # as reward.functions' are named
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
        self.parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # reward.normalize: stored, OpenRLHF's RewardModel.forward: (r - mean) / std of the model's scores alone
        self.stored_moments = None
        if normalize == "stored":
            from fastrlhf.rl.reward_norm import stored_moments

            self.stored_moments = stored_moments(reward_model)

    @property
    def metrics(self) -> dict[str, float]:
        return reward_part_means(self.parts)

    def __call__(self, exp, prompts: list[list[int]], completions: list[list[int]], metas: list[dict],
                 conversations: list[list[dict] | None] | None = None, environments: list | None = None
                 ) -> torch.Tensor:
        """[B] fp32 scores of the sequences of ``exp``; ``prompts[b]``/``completions[b]``/``metas[b]`` per row.
        ``exp`` may be None without a reward model (the scores are then on the host). Episodes
        (``fastrlhf.rollout.episodes``): ``conversations[b]``, the messages the episode added (what TRL's
        text rewards receive as the completion), and ``environments[b]``, its environment instance."""
        scores = torch.zeros(len(completions), dtype=torch.float32)
        self.parts = {}
        scored = torch.full((len(completions),), self.reward_model is not None)  # by some reward (host)
        if self.function is not None:
            values, applicable = sample_scores(self.function_name, self.function, prompts, completions, metas)
            scores += values
            scored |= applicable
        if self.environment_reward is not None and environments is not None:
            values, applicable = environment_scores(self.environment_reward, environments)
            scores += values
            scored |= applicable
            self.parts[self.environment_reward] = values, applicable
        if self.text_rewards:
            prompt_text, completion_text = self._texts(prompts, completions, metas, conversations)
            completion_ids = [list(c) for c in completions]
            columns = {k: [m.get(k) for m in metas] for k in sorted(set().union(*map(set, metas)))}
            for reward in self.text_rewards:
                values, applicable = batch_scores(reward, prompt_text, completion_text, completion_ids, columns)
                scores += reward.weight * values
                scored |= applicable
                self.parts[reward.name] = values, applicable
        if not scored.all():
            unscored(scored, prompts, completions, metas)
        if self.reward_model is not None:
            from fastrlhf.rl.forward import reward_model_scores

            batch = exp
            if self.reward_tokenizer is not None:
                batch = retokenized(prompts, completions, self.tokenizer, self.reward_tokenizer, exp.input_ids.device)
            groups = None
            if self.max_tokens is not None:  # a replica on each rank: no count to agree on
                from fastrlhf.sequences.packing import token_budget_groups

                groups = token_budget_groups(batch.token_parts(), self.max_tokens, self.packed)
            # Added on the device: bringing the model's scores to the host would wait for its forward passes.
            model_scores = reward_model_scores(self.reward_model, batch, self.model_kind, self.label_index,
                                               self.micro_batch, groups=groups, packed=self.packed)
            model_scores = model_scores.to(torch.float32)
            if self.stored_moments is not None:
                mean, std = self.stored_moments
                model_scores = (model_scores - mean) / std
            return to_device(scores, model_scores.device) + model_scores
        return scores if exp is None else to_device(scores, exp.input_ids.device)

    def _texts(self, prompts: list[list[int]], completions: list[list[int]], metas: list[dict],
               conversations=None) -> tuple[list, list]:
        """``(prompts, completions)`` for the text rewards, in ``reward_format``."""
        completion_text = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        if self.reward_format == "text":
            return self.tokenizer.batch_decode(prompts, skip_special_tokens=False), completion_text
        return trl_texts([getattr(m, "prompt", None) for m in metas], prompts, completion_text, self.tokenizer,
                         conversations)
