"""Files of rows -> parsed rows, every bad line found before training and reported with its ``file:line``
(:class:`DataError`); JSONL, Parquet and Hugging Face ``datasets`` folders; tokenizing a field.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "DataError", "CHAT_FIELD", "LazyTokenizer"
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


class LazyTokenizer:
    """Loads the tokenizer of ``model_path`` only if a text field is met (token-id data needs none)."""

    def __init__(self, model_path: str | None, tools: list[dict] | None = None):
        self.model_path = model_path
        self.tools = tools or None  # JSON schemas a chat's template lists (rollout.tools)
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

    def chat_ids(self, messages: list[dict], field_name: str, why: str = "",
                 generation_prompt: bool = True) -> list[int]:
        """``apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)`` as a list of
        ints."""
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
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                **({"tools": self.tools} if self.tools else {}))
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
        # surrogateescape: a byte that is not UTF-8 becomes a bad line of its own, not a traceback for the file
        f = open(path, encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise DataError([f"{name}: cannot read: {exc.strerror}"]) from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are not examples
            if (bad := _not_utf8(line)) is not None:
                yield f"{name}:{lineno}", _BadLine(bad)
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # a cut line's error at its own end, not the next line's
            except json.JSONDecodeError as exc:
                yield f"{name}:{lineno}", _BadLine(f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(row, dict):
                yield f"{name}:{lineno}", _BadLine(f"expected a JSON object, got {type(row).__name__}")
                continue
            yield f"{name}:{lineno}", row


def _not_utf8(line: str) -> str | None:
    """Why a line read with ``surrogateescape`` is not valid UTF-8 (its first bad byte), or None."""
    try:
        line.encode("utf-8")  # in C: the escaped bytes are the only lone surrogates a UTF-8 read can give
    except UnicodeEncodeError as exc:
        return f"not valid UTF-8 (byte 0x{ord(line[exc.start]) - 0xDC00:02x} at column {exc.start + 1})"
    return None


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
        # Not a second EOS after text that ends with it (TRL's add_eos): the pair would train EOS -> EOS
        if append_eos and ids and tokenizer.eos_token_id is not None and ids[-1] != tokenizer.eos_token_id:
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


def _check_vocab(ids: list[int], vocab_size: int | None, what: str):
    if vocab_size is not None:
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise _BadLine(f"token id {bad[0]} in {what} is outside the vocabulary [0, {vocab_size})")
