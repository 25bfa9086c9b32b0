"""Files of rows -> parsed rows, every bad line found before training and reported with its ``file:line``
(:class:`DataError`); JSONL (or one JSON array), Parquet and Hugging Face ``datasets`` folders; tokenizing a field;
the check that every rank loaded the same data (:func:`check_same_data`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "DataError", "CHAT_FIELD", "LazyTokenizer", "check_same_data"
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

    def __init__(self, model_path: str | None, tools: list[dict] | None = None, template_kwargs: dict | None = None):
        self.model_path = model_path
        self.tools = tools or None  # JSON schemas a chat's template lists (rollout.tools)
        self.template_kwargs = dict(template_kwargs or {})  # the template's own variables (data.chat_template_kwargs)
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
                    # Its message too: it often names the fix (a package to install, the file that is broken)
                    self._failure = f"{type(exc).__name__}: {_short_message(exc)}"
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
                                                **({"tools": self.tools} if self.tools else {}), **self.template_kwargs)
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


def _short_message(exc: Exception, limit: int = 300) -> str:
    """An exception's message on one line, cut to ``limit`` characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
            raise DataError([problem + _data_files_hint(path)]) from None
        # A DatasetDict (what load_dataset(...).save_to_disk writes) is a dict of splits; it has column_names too,
        # so only its type tells it from a Dataset (iterated, it gives the split names as rows)
        if isinstance(dataset, dict):
            if "train" not in dataset:
                raise DataError([f"{name}: a DatasetDict without a 'train' split (has {', '.join(dataset.keys())}); "
                                 f"give one split's folder, e.g. {os.path.join(path, next(iter(dataset), ''))}"])
            dataset = dataset["train"]
        for i, row in enumerate(dataset):
            yield f"{name}:row {i}", _plain(row)
        return
    yield from _json_rows(path, name)


def _data_files_hint(folder: str) -> str:
    """``; it holds data files (...): give one file's path`` for a folder of data files (a Hub download), or ''."""
    found = sorted(os.path.relpath(os.path.join(root, f), folder) for root, _, files in os.walk(folder)
                   for f in files if f.endswith((".parquet", ".jsonl", ".json")) and not f.startswith(".")
                   and f not in ("dataset_info.json", "state.json", "dataset_dict.json"))  # save_to_disk's own
    if not found:
        return ""
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return f"; it holds data files ({', '.join(found[:3])}{more}): give one file's path"


# Formats that are not JSON but would be read as JSONL, one "invalid JSON" per line: one line for the file instead
_NOT_JSON = {".csv": "CSV", ".tsv": "TSV", ".gz": "a compressed file", ".bz2": "a compressed file",
             ".xz": "a compressed file", ".zst": "a compressed file", ".zip": "a zip archive"}


def _json_rows(path: str, name: str) -> Iterator[tuple[str, Any]]:
    """JSONL rows, or the elements of a file that is one JSON array of objects (as ``datasets``' json reader
    takes both), each at the line it starts on."""
    kind = _NOT_JSON.get(os.path.splitext(path)[1].lower())
    if kind is not None:
        raise DataError([f"{name}: {kind} is not read as data: give JSONL (one JSON object per line), a JSON array "
                         "of objects, a .parquet file or a datasets folder"])
    try:
        # surrogateescape: a byte that is not UTF-8 becomes a bad line of its own, not a traceback for the file;
        # utf-8-sig: a byte order mark (files saved on Windows) is not part of the first row
        f = open(path, encoding="utf-8-sig", errors="surrogateescape")
    except OSError as exc:
        raise DataError([f"{name}: cannot read: {exc.strerror}"]) from None
    with f:
        first = True
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are not examples
            if first and line.lstrip().startswith("["):
                yield from _json_array_rows(line + f.read(), lineno, name)
                return
            first = False
            if (bad := _not_utf8(line)) is not None:
                yield f"{name}:{lineno}", _BadLine(bad)
                continue
            try:
                row = _STRICT.decode(line.rstrip("\r\n"))  # a cut line's error at its own end, not the next line's
            except json.JSONDecodeError as exc:
                yield f"{name}:{lineno}", _BadLine(f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            except _DuplicateKey as exc:
                yield f"{name}:{lineno}", _BadLine(str(exc))
                continue
            if not isinstance(row, dict):
                yield f"{name}:{lineno}", _BadLine(f"expected a JSON object, got {type(row).__name__}")
                continue
            yield f"{name}:{lineno}", row


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    """An object's dict; a key given twice is a bad line (json keeps the last silently)."""
    row = dict(pairs)
    if len(row) < len(pairs):
        key = next(k for i, (k, _) in enumerate(pairs) if any(k == other for other, _ in pairs[:i]))
        raise _DuplicateKey(f"key {key!r} appears twice in one object")
    return row


_STRICT = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)
_LENIENT = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _json_array_rows(text: str, lineno: int, name: str) -> Iterator[tuple[str, Any]]:
    """The elements of one JSON array (``text``, starting on line ``lineno``), each at the line it starts on. A
    syntax error ends the file (no element boundary to resume from): one bad line, at the error's own line."""
    lines = _Lines(text, lineno)
    if (bad := _first_not_utf8(text)) is not None:
        yield f"{name}:{lines.at(bad)}", _BadLine(_not_utf8_at(text, bad, lines.column(bad)))
        return
    pos, comma = _SPACE.match(text, text.index("[") + 1).end(), False
    while comma or not text.startswith("]", pos):  # after a comma an element, not the end
        where = f"{name}:{lines.at(pos)}"
        try:
            row, end = _STRICT.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            yield f"{name}:{lines.at(exc.pos)}", _BadLine(f"invalid JSON ({exc.msg} at column {lines.column(exc.pos)})")
            return
        except _DuplicateKey as exc:
            row, end = _BadLine(str(exc)), _LENIENT.raw_decode(text, pos)[1]
        if not isinstance(row, (dict, _BadLine)):
            row = _BadLine(f"expected a JSON object, got {type(row).__name__}")
        yield where, row
        pos = _SPACE.match(text, end).end()
        comma = text.startswith(",", pos)
        if comma:
            pos = _SPACE.match(text, pos + 1).end()
        elif not text.startswith("]", pos):
            yield f"{name}:{lines.at(pos)}", _BadLine(f"invalid JSON (expected ',' or ']' after an element, at column "
                                                      f"{lines.column(pos)})")
            return
    if (rest := _SPACE.match(text, pos + 1).end()) < len(text):
        yield f"{name}:{lines.at(rest)}", _BadLine("invalid JSON (more after the array's closing ']')")


class _Lines:
    """Line numbers of positions in ``text`` (which starts on line ``first``), asked for in increasing order."""

    def __init__(self, text: str, first: int):
        self.text, self.line, self.pos = text, first, 0

    def at(self, pos: int) -> int:
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line

    def column(self, pos: int) -> int:
        return pos - self.text.rfind("\n", 0, pos)


def _first_not_utf8(text: str) -> int | None:
    """Where the first byte that is not UTF-8 sits in ``text`` read with ``surrogateescape``, or None."""
    try:
        text.encode("utf-8")  # in C: the escaped bytes are the only lone surrogates a UTF-8 read can give
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _not_utf8_at(text: str, pos: int, column: int) -> str:
    return f"not valid UTF-8 (byte 0x{ord(text[pos]) - 0xDC00:02x} at column {column})"


def _not_utf8(line: str) -> str | None:
    """Why a line read with ``surrogateescape`` is not valid UTF-8 (its first bad byte), or None."""
    pos = _first_not_utf8(line)
    return None if pos is None else _not_utf8_at(line, pos, pos + 1)


def _parquet_rows(path: str, name: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError([f"{name}: reading Parquet needs pyarrow (pip install pyarrow)"]) from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 -- missing, unreadable or not Parquet
        raise DataError([f"{name}: not a readable Parquet file ({type(exc).__name__}: {exc})"]) from None
    columns = parquet.schema_arrow.names
    if twice := sorted({c for c in columns if columns.count(c) > 1}):
        # A row is a dict: the last of the columns of one name would win without a word
        raise DataError([f"{name}: column {c!r} appears {columns.count(c)} times" for c in twice])
    i = 0
    batches = parquet.iter_batches()
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # noqa: BLE001 -- a damaged page (a cut or corrupt copy) past the footer
            detail = " ".join(str(exc).split())
            problem = f"{name}: not readable Parquet from row {i} on ({type(exc).__name__}: {detail})"
            raise DataError([problem]) from None
        if batch is None:
            return
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
    _LOADED.append((name, len(examples), _fingerprint(examples)))
    return examples


# (file name, examples, fingerprint) of each file loaded since the last check_same_data, in load order
_LOADED: list[tuple[str, int, str]] = []


def _fingerprint(examples: list) -> str:
    """A digest of what the examples train on (token ids, columns, the prompt as given): the rows and the
    tokenizer that made them, not where they sit in the file."""
    digest = hashlib.sha256()
    for example in examples:
        for key, value in vars(example).items():
            if key != "source":
                digest.update(json.dumps([key, value, getattr(value, "prompt", None)], default=repr).encode())
    return digest.hexdigest()[:16]


def check_same_data() -> None:
    """Collective once the process group exists: every rank must have loaded the same examples. Each node
    reads its own copy of a data file and every rank draws the same indices from it (``EpochSampler``), so a
    copy that differs (another version, a partial copy, another tokenizer) would train on mismatched rows
    without a word. A DataError on every rank names each file that differs and which ranks read what."""
    from fastrlhf.distributed import comm
    from fastrlhf.distributed.multinode import where

    loaded = list(_LOADED)
    _LOADED.clear()  # each load is checked once, at the start of the run
    if not comm.is_distributed():
        return
    mine = json.dumps({"loaded": loaded, "where": where()}).encode()
    seen = [json.loads(part) for part in comm.gather_bytes(mine)]
    if all(s["loaded"] == seen[0]["loaded"] for s in seen):
        return
    problems = []
    for i in range(max(len(s["loaded"]) for s in seen)):
        versions: dict[str, list[int]] = {}
        for rank, s in enumerate(seen):
            entry = s["loaded"][i] if i < len(s["loaded"]) else None
            text = "nothing" if entry is None else f"{entry[1]} examples (digest {entry[2]})"
            versions.setdefault(text, []).append(rank)
        if len(versions) > 1:
            name = next(s["loaded"][i][0] for s in seen if i < len(s["loaded"]))
            parts = [f"{text} on rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} (first: {seen[ranks[0]]['where']})"
                     for text, ranks in versions.items()]
            problems.append(f"{name}: the ranks loaded different data: {'; '.join(parts)}; every node must read "
                            "the same copy of the file (and the same tokenizer)")
    raise comm.agreed(DataError(problems))  # every rank saw every rank's digests: said once


def _ranks(ranks: list[int]) -> str:
    """``0-3,6``: rank numbers as runs."""
    runs, start = [], ranks[0]
    for prev, rank in zip(ranks, [*ranks[1:], None], strict=True):
        if rank is None or rank != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = rank
    return ",".join(runs)


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
        _check_text(value, repr(name))
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


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(text: str, what: str) -> None:
    """A bad line for text holding half of a UTF-16 surrogate pair (a JSON ``\\ud83d`` escape whose other half was
    cut off, as scraped text has): no tokenizer reads it, and a fast one raises a TypeError naming no row."""
    if (found := _SURROGATE.search(text)) is not None:
        raise _BadLine(f"field {what} holds an unpaired surrogate \\u{ord(found.group()):04x} at character "
                       f"{found.start()}, which is not text a tokenizer reads (half of an emoji cut off?)")


def _short(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_len(ids: list[int], limit: int | None, what: str, skip: bool = False):
    """A bad line where ``ids`` pass ``limit``; with ``skip`` (``data.overlong: skip``) the row is left out."""
    if limit is not None and len(ids) > limit:
        if skip:
            raise _Skip
        raise _BadLine(f"{what} of {len(ids)} tokens is longer than the limit of {limit}")


def _check_vocab(ids: list[int], vocab_size: int | None, what: str):
    if vocab_size is not None:
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise _BadLine(f"token id {bad[0]} in {what} is outside the vocabulary [0, {vocab_size})")
