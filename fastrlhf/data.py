"""Training data: JSONL files or Hugging Face ``datasets`` folders -> validated token-id examples.

Every bad line is found before training starts and reported together, with its line number
(``data error: prompts.jsonl:17: empty prompt``). Sampling is a seeded, resumable epoch shuffle so
that a resumed run sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DataError",
    "PromptExample",
    "SFTExample",
    "PairExample",
    "ClassificationExample",
    "load_prompts",
    "load_sft_examples",
    "load_pairwise_examples",
    "load_classification_examples",
    "EpochSampler",
    "LazyTokenizer",
]

MAX_REPORTED = 10


class DataError(ValueError):
    """Bad training data; ``str()`` lists the first bad lines (file:line: problem) and the total count."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:MAX_REPORTED]
        text = "\n".join(shown)
        if len(problems) > len(shown):
            text += f"\n... and {len(problems) - len(shown)} more bad lines ({len(problems)} in all)"
        elif len(problems) > 1:
            text += f"\n({len(problems)} bad lines in all)"
        super().__init__(text)


class _BadLine(Exception):
    pass


@dataclass
class PromptExample:
    prompt_ids: list[int]
    meta: dict = field(default_factory=dict)


@dataclass
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]


@dataclass
class PairExample:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


@dataclass
class ClassificationExample:
    input_ids: list[int]
    label: int


class LazyTokenizer:
    """Loads the tokenizer of ``model_path`` only if a text field is met (token-id data needs none)."""

    def __init__(self, model_path: str | None):
        self.model_path = model_path
        self._tokenizer = None

    def get(self):
        if self._tokenizer is None:
            if self.model_path is None:
                raise _BadLine("text field given but no tokenizer is configured; give token ids instead")
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except Exception as exc:  # noqa: BLE001 -- any loading failure means "no usable tokenizer"
                raise _BadLine(f"text field given but {self.model_path} has no usable tokenizer "
                               f"({type(exc).__name__}); give token ids instead") from None
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.get()(text, add_special_tokens=add_special_tokens)["input_ids"])

    @property
    def eos_token_id(self) -> int | None:
        return self.get().eos_token_id


# --------------------------------------------------------------------------------------------
# Rows: JSONL lines or datasets rows, each with the label used in error messages
# --------------------------------------------------------------------------------------------


def _rows(path: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, row_or_BadLine)``; ``where`` is ``file:line`` (JSONL) or ``folder:row N``."""
    name = os.path.basename(os.path.normpath(path))
    if os.path.isdir(path):
        try:
            from datasets import load_from_disk

            dataset = load_from_disk(path)
        except Exception as exc:  # noqa: BLE001
            problem = f"{name}: not a datasets folder saved with save_to_disk ({type(exc).__name__}: {exc})"
            raise DataError([problem]) from None
        if hasattr(dataset, "keys") and not hasattr(dataset, "column_names"):  # DatasetDict
            if "train" not in dataset:
                raise DataError([f"{name}: a DatasetDict without a 'train' split (has {', '.join(dataset.keys())})"])
            dataset = dataset["train"]
        for i, row in enumerate(dataset):
            yield f"{name}:row {i}", row
        return
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataError([f"{name}: cannot read: {exc.strerror}"]) from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are not examples
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{name}:{lineno}", _BadLine(f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(row, dict):
                yield f"{name}:{lineno}", _BadLine(f"expected a JSON object, got {type(row).__name__}")
                continue
            yield f"{name}:{lineno}", row


def _collect(path: str, parse: Callable[[dict], Any]) -> list:
    examples, problems = [], []
    for where, row in _rows(path):
        if isinstance(row, _BadLine):
            problems.append(f"{where}: {row}")
            continue
        try:
            examples.append(parse(row))
        except _BadLine as exc:
            problems.append(f"{where}: {exc}")
    if problems:
        raise DataError(problems)
    if not examples:
        raise DataError([f"{os.path.basename(os.path.normpath(path))}: no examples"])
    return examples


def _tokens(row: dict, names: tuple[str, ...], what: str, tokenizer: LazyTokenizer, vocab_size: int | None,
            special: bool, required: bool = True, append_eos: bool = False) -> list[int]:
    """Token ids from the first present field of ``names``: a list of ints, or text to tokenize."""
    for name in names:
        if name in row and row[name] is not None:
            value = row[name]
            break
    else:
        if not required:
            return []
        raise _BadLine(f"missing field {' or '.join(repr(n) for n in names)}")
    if isinstance(value, str):
        ids = tokenizer.encode(value, add_special_tokens=special) if value else []
        if append_eos and ids and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    elif isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        ids = list(value)
    else:
        raise _BadLine(f"field {name!r} must be text or a list of token ids, got {_short(value)}")
    if required and not ids:
        raise _BadLine(f"empty {what}")
    if vocab_size is not None:
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise _BadLine(f"token id {bad[0]} in {what} is outside the vocabulary [0, {vocab_size})")
    return ids


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_len(ids: list[int], limit: int | None, what: str):
    if limit is not None and len(ids) > limit:
        raise _BadLine(f"{what} of {len(ids)} tokens is longer than the limit of {limit}")


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------


def _id_and_text_names(field_name: str) -> tuple[str, ...]:
    """``prompt_ids`` also accepts ``prompt`` (text) and vice versa."""
    if field_name.endswith("_ids"):
        return field_name, field_name[: -len("_ids")]
    return field_name, f"{field_name}_ids"


def load_prompts(path: str, prompt_field: str = "prompt_ids", max_prompt_len: int | None = None,
                 vocab_size: int | None = None, tokenizer_path: str | None = None) -> list[PromptExample]:
    """RL prompts: ``{"prompt_ids": [...], "meta": {...}}`` or ``{"prompt": "text"}`` lines (meta optional).

    Every other column of a row (``answer``, ``data_source``...) travels in the example's ``meta``, so
    reward functions receive it; a key in ``meta`` itself wins over a column of the same name.
    """
    tokenizer = LazyTokenizer(tokenizer_path)
    names = _id_and_text_names(prompt_field)

    def parse(row: dict) -> PromptExample:
        ids = _tokens(row, names, "prompt", tokenizer, vocab_size, special=True)
        _check_len(ids, max_prompt_len, "prompt")
        meta = row.get("meta", {})
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise _BadLine(f"field 'meta' must be an object, got {_short(meta)}")
        columns = {k: v for k, v in row.items() if k not in names and k != "meta"}
        return PromptExample(ids, {**columns, **meta})

    return _collect(path, parse)


def load_sft_examples(path: str, max_len: int, max_prompt_len: int | None = None,
                      vocab_size: int | None = None, tokenizer_path: str | None = None) -> list[SFTExample]:
    """SFT pairs: ``{"prompt_ids"/"prompt", "response_ids"/"response"}`` lines."""
    tokenizer = LazyTokenizer(tokenizer_path)

    def parse(row: dict) -> SFTExample:
        prompt = _tokens(row, ("prompt_ids", "prompt"), "prompt", tokenizer, vocab_size, special=True)
        response = _tokens(row, ("response_ids", "response"), "response", tokenizer, vocab_size, special=False,
                           append_eos=True)
        _check_len(prompt, max_prompt_len, "prompt")
        _check_len(prompt + response, max_len, "prompt + response")
        return SFTExample(prompt, response)

    return _collect(path, parse)


def load_pairwise_examples(path: str, max_len: int, vocab_size: int | None = None,
                           tokenizer_path: str | None = None) -> list[PairExample]:
    """Preference pairs: ``{"prompt", "chosen", "rejected"}`` (text or ``*_ids`` token lists; prompt optional)."""
    tokenizer = LazyTokenizer(tokenizer_path)

    def parse(row: dict) -> PairExample:
        prompt = _tokens(row, ("prompt_ids", "prompt"), "prompt", tokenizer, vocab_size, special=True,
                         required=False)
        chosen = _tokens(row, ("chosen_ids", "chosen"), "chosen", tokenizer, vocab_size, special=not prompt)
        rejected = _tokens(row, ("rejected_ids", "rejected"), "rejected", tokenizer, vocab_size, special=not prompt)
        _check_len(prompt + chosen, max_len, "prompt + chosen")
        _check_len(prompt + rejected, max_len, "prompt + rejected")
        return PairExample(prompt, chosen, rejected)

    return _collect(path, parse)


def load_classification_examples(path: str, max_len: int, num_labels: int, vocab_size: int | None = None,
                                 tokenizer_path: str | None = None) -> list[ClassificationExample]:
    """Labelled sequences: ``{"text"/"input_ids", "label"}`` lines, label in [0, num_labels)."""
    tokenizer = LazyTokenizer(tokenizer_path)

    def parse(row: dict) -> ClassificationExample:
        ids = _tokens(row, ("input_ids", "text"), "text", tokenizer, vocab_size, special=True)
        _check_len(ids, max_len, "text")
        if "label" not in row:
            raise _BadLine("missing field 'label'")
        label = row["label"]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_labels:
            raise _BadLine(f"label must be an integer in [0, {num_labels}), got {_short(label)}")
        return ClassificationExample(ids, label)

    return _collect(path, parse)


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


class EpochSampler:
    """Endless seeded shuffles of ``range(n)``; ``state_dict`` makes the position part of a checkpoint.

    Every rank builds the same sampler and draws the same global batch, then takes its own slice,
    so no communication is needed to agree on the data.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        if n <= 0:
            raise ValueError(f"EpochSampler needs at least one example, got {n}")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        """The next ``k`` example indices (crossing into the next epoch's shuffle when needed)."""
        out = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(k - len(out), self.n - self.position)
            out.extend(self._order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"the checkpoint's sampler covered {state['n']} examples but the data now has {self.n}; "
                             "resume with the same data")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._make_order()


def shard(items: list, rank: int, world_size: int) -> list:
    """This rank's contiguous slice of a global batch (the batch size must divide evenly)."""
    if len(items) % world_size:
        raise ValueError(f"a batch of {len(items)} does not split evenly over {world_size} ranks")
    per = len(items) // world_size
    return items[rank * per:(rank + 1) * per]
