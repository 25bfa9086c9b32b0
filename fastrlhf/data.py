"""Training data: JSONL files, Parquet files or Hugging Face ``datasets`` folders -> validated token-id examples.

Every bad line is found before training starts and reported together, with its line number
(``data error: prompts.jsonl:17: empty prompt``). Sampling is a seeded, resumable epoch shuffle so
that a resumed run sees exactly the batches an uninterrupted run would have seen.

A prompt is token ids (``prompt_ids``), text (``prompt``) or a chat (``messages``: a list of
``{"role", "content"}`` objects), which the tokenizer's chat template turns into ids with the generation
prompt (``data.chat_template``: auto | true | false, see :func:`load_prompts`). The prompt as the row
gives it (text or messages) travels beside its columns (:class:`Columns`), for rewards in TRL's format.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DataError",
    "Columns",
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
    "check_columns",
    "uneven_columns",
    "report_uneven_columns",
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


class _Skip(Exception):
    """A valid row left out on purpose (``data.overlong: skip``)."""


CHAT_FIELD = "messages"
CHAT_TEMPLATE_CHOICES = (True, False, "auto")
OVERLONG_CHOICES = ("error", "truncate", "skip")


class Columns(dict):
    """A prompt row's columns (every field but the prompt): what reward functions receive as ``meta`` or
    keyword arguments and what validation files record. :attr:`prompt` is the row's prompt as given: its
    text, its messages, or None for token ids. It rides beside the columns, not among them, so that a
    reward in TRL's format can read it while every reader of the columns sees only the columns."""

    def __init__(self, columns=(), prompt: str | list[dict] | None = None):
        super().__init__(columns)
        self.prompt = prompt


@dataclass
class PromptExample:
    prompt_ids: list[int]
    meta: dict = field(default_factory=Columns)  # a Columns from load_prompts
    source: str = ""  # where the row is: "file:line" or "folder:row N" (for messages naming it)


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
        self._failure: str | None = None  # why loading failed (tried once, not once per row)

    def get(self):
        if self._tokenizer is None:
            if self.model_path is None:
                raise _BadLine("text field given but no tokenizer is configured; give token ids instead")
            if self._failure is None:
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                except Exception as exc:  # noqa: BLE001 -- any loading failure means "no usable tokenizer"
                    self._failure = type(exc).__name__
            if self._tokenizer is None:
                raise _BadLine(f"text field given but {self.model_path} has no usable tokenizer "
                               f"({self._failure}); give token ids instead")
        return self._tokenizer

    def chat_ids(self, messages: list[dict], field_name: str, why: str = "") -> list[int]:
        """``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` as a list of ints."""
        try:
            tokenizer = self.get()
        except _BadLine:
            tokenizer = None
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            if self.model_path is None:
                reason = "no tokenizer is configured"
            elif tokenizer is None:
                reason = f"{self.model_path} has no usable tokenizer ({self._failure})"
            else:
                reason = f"the tokenizer of {self.model_path} has none"
            raise _BadLine(f"field {field_name!r} needs a tokenizer with a chat template{why} ({reason})")
        try:
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 -- a template that raises (roles must alternate...) is a bad line
            detail = " ".join(str(exc).split())
            raise _BadLine(f"the chat template failed on field {field_name!r} "
                           f"({type(exc).__name__}: {detail})") from None
        if hasattr(out, "keys"):  # transformers 5: a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.get()(text, add_special_tokens=add_special_tokens)["input_ids"])

    @property
    def eos_token_id(self) -> int | None:
        return self.get().eos_token_id


# --------------------------------------------------------------------------------------------
# Rows: JSONL lines or datasets rows, each with the label used in error messages
# --------------------------------------------------------------------------------------------


def _plain(value):
    """numpy / arrow values (``datasets`` rows, Parquet) -> Python lists, dicts and scalars."""
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars
    return _plain(tolist()) if callable(tolist) else value


def _rows(path: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, row_or_BadLine)``; ``where`` is ``file:line`` (JSONL) or ``name:row N`` (a ``datasets``
    folder or a ``.parquet`` file, rows counted from 0)."""
    name = os.path.basename(os.path.normpath(path))
    if path.endswith(".parquet") and not os.path.isdir(path):
        yield from _parquet_rows(path, name)
        return
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
            yield f"{name}:row {i}", _plain(row)
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


def _parquet_rows(path: str, name: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError([f"{name}: reading Parquet needs pyarrow (pip install pyarrow)"]) from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 -- missing, unreadable or not Parquet
        raise DataError([f"{name}: not a readable Parquet file ({type(exc).__name__}: {exc})"]) from None
    i = 0
    for batch in parquet.iter_batches():
        for row in batch.to_pylist():
            yield f"{name}:row {i}", row
            i += 1


def _collect(path: str, parse: Callable[[dict, str], Any], skipped_as: str = "") -> list:
    """Parse every row (``parse(row, where)``); bad lines -> one DataError. A row whose ``parse`` raises
    ``_Skip`` is left out; rank 0 prints how many were, ``skipped_as`` saying why."""
    examples, problems, skipped = [], [], 0
    for where, row in _rows(path):
        if isinstance(row, _BadLine):
            problems.append(f"{where}: {row}")
            continue
        try:
            examples.append(parse(row, where))
        except _BadLine as exc:
            problems.append(f"{where}: {exc}")
        except _Skip:
            skipped += 1
    if problems:
        raise DataError(problems)
    name = os.path.basename(os.path.normpath(path))
    if not examples:
        if skipped:
            raise DataError([f"{name}: no examples: all {skipped} rows were skipped as {skipped_as}"])
        raise DataError([f"{name}: no examples"])
    if skipped and os.environ.get("RANK", "0") == "0":
        print(f"data: skipped {skipped} of {skipped + len(examples)} rows of {path} as {skipped_as}",
              file=sys.stderr, flush=True)
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
    _check_vocab(ids, vocab_size, what)
    return ids


def _short(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
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


def _is_chat(value) -> bool:
    return isinstance(value, list) and any(isinstance(m, dict) for m in value)


def _chat(value, field_name: str) -> list[dict]:
    """A validated chat: a non-empty list of objects with text ``role`` and ``content``. Keys that are null
    (a column of a Parquet/``datasets`` struct that another row has) are left out, as if absent."""
    if not isinstance(value, list) or not value:
        raise _BadLine(f"field {field_name!r} must be a non-empty list of {{\"role\": text, \"content\": text}} "
                       f"objects, got {_short(value)}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise _BadLine(f"field {field_name!r}: message {i} must be an object with text 'role' and 'content', "
                           f"got {_short(message)}")
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def _prompt(row: dict, names: tuple[str, ...], tokenizer: LazyTokenizer, vocab_size: int | None,
            chat_template: bool | str) -> tuple[list[int], str | list[dict] | None]:
    """``(ids, given)`` of a row's prompt: the first present field of ``names`` + ``messages``; ids as given,
    text tokenized (``chat_template: true``: as one user message through the template), a chat through the
    template. ``given``: the text or the validated messages (None for token ids)."""
    fields = tuple(dict.fromkeys((*names, CHAT_FIELD)))
    for name in fields:
        if name in row and row[name] is not None:
            value = row[name]
            break
    else:
        raise _BadLine(f"missing field {' or '.join(repr(n) for n in fields)}")
    if name == CHAT_FIELD or _is_chat(value):
        messages = _chat(value, name)
        if chat_template is False:
            raise _BadLine(f"field {name!r} is a chat but data.chat_template is false; "
                           "set data.chat_template to true or auto")
        ids, given = tokenizer.chat_ids(messages, name), messages
    elif isinstance(value, str) and chat_template is True:
        ids = tokenizer.chat_ids([{"role": "user", "content": value}], name, why=" (data.chat_template is true)") \
            if value else []
        given = value
    else:
        ids = _tokens({name: value}, (name,), "prompt", tokenizer, vocab_size, special=True)
        return ids, value if isinstance(value, str) else None
    if not ids:
        raise _BadLine("empty prompt")
    _check_vocab(ids, vocab_size, "prompt")
    return ids, given


def _check_vocab(ids: list[int], vocab_size: int | None, what: str):
    if vocab_size is not None:
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise _BadLine(f"token id {bad[0]} in {what} is outside the vocabulary [0, {vocab_size})")


def _check_choices(chat_template, overlong=None):
    if chat_template not in CHAT_TEMPLATE_CHOICES or type(chat_template) not in (bool, str):
        raise ValueError(f"chat_template must be true, false or 'auto', got {chat_template!r}")
    if overlong is not None and overlong not in OVERLONG_CHOICES:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG_CHOICES)}, got {overlong!r}")


def load_prompts(path: str, prompt_field: str = "prompt_ids", max_prompt_len: int | None = None,
                 vocab_size: int | None = None, tokenizer_path: str | None = None, *,
                 chat_template: bool | str = "auto", overlong: str = "error") -> list[PromptExample]:
    """RL prompts, one per row: ``{"prompt_ids": [...]}``, ``{"prompt": "text"}`` or ``{"messages": [{"role",
    "content"}, ...]}`` (the prompt field's names come from ``prompt_field``; a chat in it works too).

    ``chat_template`` (``data.chat_template``): a chat is always put through the tokenizer's chat template
    with the generation prompt (``auto``: a bad line when the tokenizer has no template; ``false``: a chat
    is a bad line); ``true`` also puts text through it as one user message, ``auto``/``false`` tokenize
    text as it is. Token ids are used as given.

    ``overlong`` (``data.overlong``), for a prompt longer than ``max_prompt_len`` tokens: ``error`` (a bad
    line), ``truncate`` (keep its last ``max_prompt_len`` tokens, so a template's generation prompt stays) or
    ``skip`` (leave the row out; rank 0 prints how many; all left out is an error).

    Every other column of a row (``answer``, ``data_source``...) travels in the example's ``meta`` (a
    :class:`Columns`, which also holds the prompt as given), so reward functions receive it; a key in
    ``meta`` itself wins over a column of the same name. ``source`` is the row's ``file:line``.
    """
    _check_choices(chat_template, overlong)
    tokenizer = LazyTokenizer(tokenizer_path)
    names = _id_and_text_names(prompt_field)

    def parse(row: dict, where: str) -> PromptExample:
        ids, given = _prompt(row, names, tokenizer, vocab_size, chat_template)
        meta = row.get("meta", {})
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise _BadLine(f"field 'meta' must be an object, got {_short(meta)}")
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            if overlong == "truncate":
                ids = ids[-max_prompt_len:]
            elif overlong == "skip":
                raise _Skip
            else:
                _check_len(ids, max_prompt_len, "prompt")
        columns = {k: v for k, v in row.items() if k not in names and k not in ("meta", CHAT_FIELD)}
        return PromptExample(ids, Columns({**columns, **meta}, given), where)

    return _collect(path, parse, skipped_as=f"longer than max_prompt_len ({max_prompt_len} tokens)")


def load_sft_examples(path: str, max_len: int, max_prompt_len: int | None = None,
                      vocab_size: int | None = None, tokenizer_path: str | None = None, *,
                      chat_template: bool | str = "auto") -> list[SFTExample]:
    """SFT pairs: ``{"prompt_ids"/"prompt", "response_ids"/"response"}`` or ``{"messages": [..., {"role":
    "assistant", "content": ...}]}`` rows.

    A chat's prompt is the template of all its messages but the last, with the generation prompt; its
    response is the last (assistant) message's text, tokenized without special tokens, plus EOS (as a text
    response). ``chat_template`` as in :func:`load_prompts`.
    """
    _check_choices(chat_template)
    tokenizer = LazyTokenizer(tokenizer_path)
    pair_fields = ("prompt_ids", "prompt", "response_ids", "response")

    def parse(row: dict, where: str) -> SFTExample:
        if row.get(CHAT_FIELD) is not None and all(row.get(k) is None for k in pair_fields):
            messages = _chat(row[CHAT_FIELD], CHAT_FIELD)
            if chat_template is False:
                raise _BadLine(f"field {CHAT_FIELD!r} is a chat but data.chat_template is false; "
                               "set data.chat_template to true or auto")
            if len(messages) < 2 or messages[-1]["role"] != "assistant":
                raise _BadLine(f"field {CHAT_FIELD!r} must end with an assistant message (the response) after at "
                               f"least one other message, got roles {[m['role'] for m in messages]}")
            prompt = tokenizer.chat_ids(messages[:-1], CHAT_FIELD)
            _check_vocab(prompt, vocab_size, "prompt")
            response = _tokens({"response": messages[-1]["content"]}, ("response",), "response", tokenizer,
                               vocab_size, special=False, append_eos=True)
        else:
            prompt, _ = _prompt(row, ("prompt_ids", "prompt"), tokenizer, vocab_size, chat_template)
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

    def parse(row: dict, where: str) -> PairExample:
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

    def parse(row: dict, where: str) -> ClassificationExample:
        ids = _tokens(row, ("input_ids", "text"), "text", tokenizer, vocab_size, special=True)
        _check_len(ids, max_len, "text")
        if "label" not in row:
            raise _BadLine("missing field 'label'")
        label = row["label"]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_labels:
            raise _BadLine(f"label must be an integer in [0, {num_labels}), got {_short(label)}")
        return ClassificationExample(ids, label)

    return _collect(path, parse)


def check_columns(examples: list[PromptExample], required: dict[str, list[str]]) -> None:
    """Every column that a reward function needs (``{function name: [column, ...]}``, from
    ``fastrlhf.rl.rewards.required_columns``) is a key of every prompt's ``meta`` (a null value counts as
    present: the function is then called with None for that row); else a DataError naming each row."""
    problems = []
    for example in examples:
        for name, columns in required.items():
            for column in columns:
                if column not in example.meta:
                    problems.append(f"{example.source or '(unknown row)'}: reward function {name!r} needs column "
                                    f"{column!r}, which this row lacks")
    if problems:
        raise DataError(problems)


def uneven_columns(examples: list[PromptExample]) -> list[str]:
    """One line per column that some rows have and others lack, naming it, how many rows lack it and the
    first of them. Such a row reaches a reward function as None for that column, as a ``datasets``
    column filled with nulls would: a column name mistyped in some rows shows only as a flat reward curve.
    (In Parquet and ``datasets`` folders every row has every column, null or not: none is uneven there.)"""
    have = Counter(column for example in examples for column in example.meta)
    lines = []
    for column, count in have.items():
        if count < len(examples):
            first = next(e.source or "(unknown row)" for e in examples if column not in e.meta)
            lines.append(f"column {column!r} is missing from {len(examples) - count} of {len(examples)} rows, "
                         f"first at {first}")
    return lines


def report_uneven_columns(examples: list[PromptExample], strict: bool = False) -> None:
    """:func:`uneven_columns` as one warning line each on rank 0, or with ``strict`` (``data.strict_columns``)
    as a DataError."""
    uneven = uneven_columns(examples)
    if uneven and strict:
        raise DataError([f"{line} (data.strict_columns is true)" for line in uneven])
    if os.environ.get("RANK", "0") == "0":
        for line in uneven:
            print(f"warning: data: {line} (data.strict_columns: true makes this an error)", file=sys.stderr,
                  flush=True)


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


def balanced_shard(items: list, lengths: list[int], rank: int, world_size: int) -> list:
    """This rank's share of a global batch, as many items as every other rank's, dealt so that the
    ranks' token counts (``lengths``, one per item) are even: longest first, each to the rank with the
    fewest tokens so far among those with room. The step's collectives wait for the rank with the most
    tokens, and a contiguous slice can hand one rank all the long prompts. Where the deal would not
    lower the largest rank's tokens (equal lengths, or slices already even) the contiguous slices are
    kept: a different split changes which rank's engine samples which prompt, and nothing else.
    Every rank computes the same result from the same batch; a rank's items keep their sampled order."""
    if len(lengths) != len(items):
        raise ValueError(f"{len(lengths)} lengths for a batch of {len(items)}")
    sliced = max(sum(shard(lengths, r, world_size)) for r in range(world_size))  # also checks the split
    per = len(items) // world_size
    tokens, dealt = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(items)), key=lambda i: (-lengths[i], i)):
        to = min((r for r in range(world_size) if len(dealt[r]) < per), key=lambda r: (tokens[r], r))
        tokens[to] += lengths[i]
        dealt[to].append(i)
    if max(tokens) >= sliced:
        return shard(items, rank, world_size)
    return [items[i] for i in sorted(dealt[rank])]
