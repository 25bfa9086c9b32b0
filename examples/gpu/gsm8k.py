"""GSM8K for the GPU examples: a converter from GSM8K's public layout to prompt rows, and its reward.

GSM8K (``openai/gsm8k``, config ``main``) has two columns: ``question``, and ``answer``, a worked
solution whose last line is ``#### <number>``. :func:`convert` turns each row into a chat prompt with
that number as its ``answer`` column, the rows ``data.chat_template: auto`` reads:

    {"messages": [{"role": "user", "content": "<question> Let's think step by step and output the final
     answer after \\"####\\"."}], "answer": "72"}

    python -m examples.gpu.gsm8k data/gsm8k/train-00000-of-00001.parquet data/gsm8k_train.jsonl

The input is JSONL (read with the standard library) or Parquet (``*.parquet``, read with pyarrow). A bad
row stops the conversion with one line per row naming it (``train.jsonl:3: ...``), exit code 2, and
nothing written.

:func:`correctness` is the reward (``reward.functions``, TRL's signature): 1.0 where the completion's
final answer (:func:`final_answer`) equals the row's ``answer``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator

from examples.arithmetic.reward import NUMBER, answer_matches, extract_answer, to_number

__all__ = ["INSTRUCTION", "MARK", "convert", "convert_row", "correctness", "final_answer", "main"]

MARK = "####"
# What the reward reads, said to the model (verl's GSM8K preprocessing asks the same).
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_LEADING_NUMBER = re.compile(r"\s*\$?\s*(" + NUMBER + r")")
MAX_REPORTED = 10


def final_answer(text: str) -> float | None:
    """The number after the text's last ``####``, GSM8K's own mark; without one, the number it states
    ("The answer is 72", :func:`examples.arithmetic.reward.extract_answer`); else None.
    ``"48 + 24 = 72\\n#### 72"`` -> 72.0; ``"#### $1,200"`` -> 1200.0; ``"So 72. #### seventy"`` -> None."""
    if not isinstance(text, str):
        return None
    if MARK in text:
        found = _LEADING_NUMBER.match(text.rsplit(MARK, 1)[1])
        return to_number(found.group(1)) if found else None
    return extract_answer(text)


def correctness(prompts, completions, answer, **kwargs) -> list[float | None]:
    """1.0 where the completion's :func:`final_answer` equals ``answer``, 0.0 where it differs or is missing;
    None where the row's answer is missing or not a number. Completions in either form (TRL's
    conversational ``[{"role": "assistant", "content": ...}]`` or text)."""
    return answer_matches(completions, answer, final_answer)


class BadRow(ValueError):
    pass


def convert_row(row, instruction: str = INSTRUCTION) -> dict:
    """One GSM8K row -> ``{"messages": [user], "answer": "<number>"}``; raises BadRow saying what is wrong."""
    if not isinstance(row, dict):
        raise BadRow(f"expected an object with 'question' and 'answer', got {type(row).__name__}")
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise BadRow(f"'question' must be non-empty text, got {_short(question)}")
    if not isinstance(solution, str) or MARK not in solution:
        raise BadRow(f"'answer' must be a solution ending in '{MARK} <number>', got {_short(solution)}")
    found = _LEADING_NUMBER.match(solution.rsplit(MARK, 1)[1])
    if found is None or to_number(found.group(1)) is None:
        raise BadRow(f"'answer' has no number after its last '{MARK}': {_short(solution.rsplit(MARK, 1)[1])}")
    content = f"{question.strip()} {instruction}" if instruction else question.strip()
    return {"messages": [{"role": "user", "content": content}], "answer": found.group(1).replace(",", "")}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rows(path: str) -> Iterator[tuple[str, object]]:
    """``(where, row)``: ``file:line`` for JSONL (blank lines skipped), ``file:row N`` for Parquet; a line
    that is not JSON comes as a BadRow."""
    name = os.path.basename(path)
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise BadRow(f"{name}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            columns = pq.read_schema(path).names
        except Exception as exc:  # noqa: BLE001 -- missing, unreadable or not Parquet
            raise BadRow(f"{name}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        missing = [c for c in ("question", "answer") if c not in columns]
        if missing:
            raise BadRow(f"{name}: no column {' or '.join(map(repr, missing))} (has {', '.join(columns)})")
        for i, row in enumerate(pq.read_table(path, columns=["question", "answer"]).to_pylist()):
            yield f"{name}:row {i}", row
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield f"{name}:{lineno}", json.loads(line)
                except json.JSONDecodeError as exc:
                    yield f"{name}:{lineno}", BadRow(f"invalid JSON ({exc.msg} at column {exc.colno})")


def convert(source: str, destination: str, instruction: str = INSTRUCTION) -> int:
    """Convert every row of ``source`` into ``destination`` (JSONL, written whole or not at all); returns the
    row count. Raises BadRow listing the bad rows (the first :data:`MAX_REPORTED`, then how many)."""
    rows, problems = [], []
    for where, row in _rows(source):
        try:
            if isinstance(row, BadRow):
                raise row
            rows.append(convert_row(row, instruction))
        except BadRow as exc:
            problems.append(f"{where}: {exc}")
    if problems:
        more = len(problems) - MAX_REPORTED
        raise BadRow("\n".join(problems[:MAX_REPORTED] + ([f"... and {more} more bad rows"] if more > 0 else [])))
    if not rows:
        raise BadRow(f"{os.path.basename(source)}: no rows")
    os.makedirs(os.path.dirname(os.path.abspath(destination)), exist_ok=True)
    partial = destination + ".tmp"
    with open(partial, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(partial, destination)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.gpu.gsm8k", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="GSM8K rows (question, answer): a .jsonl or .parquet file")
    parser.add_argument("destination", help="the prompt rows to write (JSONL), e.g. data/gsm8k_train.jsonl")
    parser.add_argument("--instruction", default=INSTRUCTION, help="appended to each question ('' for none)")
    args = parser.parse_args(argv)
    try:
        count = convert(args.source, args.destination, args.instruction)
    except OSError as exc:
        print(f"error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except BadRow as exc:
        print("\n".join(f"error: {line}" for line in str(exc).splitlines()), file=sys.stderr)
        return 2
    print(f"wrote {count} prompts to {args.destination}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
