"""GSM8K-style word problems with numeric answers, generated locally and seeded.

Five kinds of problem, each with a few phrasings (small numbers: a model this small learns them in minutes):

- ``add``        "Tom has 7 apples and buys 5 more. How many apples does Tom have now?"   7 + 5 = 12
- ``sub``        "Mia has 15 coins and gives 6 to Leo. How many coins does Mia have left?" 15 - 6 = 9
- ``mul``        "Ben buys 3 bags of pens. Each bag has 4 pens. How many pens ..."         3 * 4 = 12
- ``add_sub``    two steps: buys some, then gives some away                                a + b = d. d - c = e
- ``mul_add``    two steps: bags of some, then finds more                                  a * b = d. d + c = e

A worked answer is GSM8K's: the equations, then ``The answer is N.`` (``"7 + 5 = 12. The answer is
12."``). Like much real SFT data, the answers are not uniform: 65% of the two-step answers are bare
(``"The answer is 7."``), and only 35% of all answers close with ``The answer is N.``; the others
say it in their own words (``"7 + 5 = 12. That makes 12 apples."``). A grader that reads only a
stated answer (GSM8K's strict match, which the example's reward is) scores those 0, and greedy
decoding after SFT takes the majority phrasing: that is what RL has to fix.

The validation split is 200 questions (half one-step, half two-step), fixed for every seed; no SFT
or RL row asks any of them, nor the numbers of any two-step validation problem. As in GSM8K, the
one-step arithmetic is not held out: nearly every one-step validation problem's numbers come up in
training in other words (other names, item, template). What is new is the question.

Files (``write_data``), TRL's conversational format:

- ``sft.jsonl``   ``{"messages": [user, assistant]}``: answered problems for ``fastrlhf sft``;
- ``rl.jsonl``    ``{"messages": [user], "answer": "12", "kind": "add"}``: prompts for ``fastrlhf train``
  (``answer`` and ``kind`` reach the reward functions as keyword arguments);
- ``val.jsonl``   the held-out validation split, same format as ``rl.jsonl``.

    python -m examples.arithmetic.data --out runs/arithmetic/data --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator

__all__ = ["KINDS", "TWO_STEP", "Problem", "all_keys", "validation_problems", "held_out", "make_problem", "solve",
           "bare_answer", "loose_closing", "write_data", "corpus_text"]

NAMES = ["Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe", "Jack", "Nora", "Omar", "Ella",
         "Ravi", "Lena"]
ITEMS = ["apples", "pens", "books", "cards", "stickers", "marbles", "cookies", "coins", "shells", "stamps",
         "balloons", "pencils"]

TEMPLATES = {
    "add": [
        "{n} has {a} {item} and buys {b} more. How many {item} does {n} have now?",
        "{n} has {a} {item}. {m} gives {n} {b} more. How many {item} does {n} have now?",
        "There are {a} {item} in a box. {n} puts {b} more in the box. How many {item} are in the box now?",
    ],
    "sub": [
        "{n} has {a} {item} and gives {b} to {m}. How many {item} does {n} have left?",
        "{n} had {a} {item} and lost {b} of them. How many {item} does {n} have now?",
        "There are {a} {item} in a box. {n} takes {b} out. How many {item} are in the box now?",
    ],
    "mul": [
        "{n} buys {a} bags of {item}. Each bag has {b} {item}. How many {item} does {n} buy?",
        "{n} has {a} boxes with {b} {item} in each box. How many {item} does {n} have?",
    ],
    "add_sub": [
        "{n} has {a} {item}, buys {b} more and then gives {c} to {m}. How many {item} does {n} have now?",
        "There are {a} {item} in a box. {n} puts in {b} more and {m} takes {c} out. How many {item} are in the "
        "box now?",
    ],
    "mul_add": [
        "{n} buys {a} bags with {b} {item} in each bag and finds {c} more. How many {item} does {n} have now?",
        "{n} has {a} boxes with {b} {item} in each box. {m} gives {n} {c} more. How many {item} does {n} have now?",
    ],
}
KINDS = tuple(TEMPLATES)
TWO_STEP = ("add_sub", "mul_add")


def all_keys() -> list[tuple]:
    """Every (kind, numbers...) this generator can ask, in a fixed order."""
    keys = []
    keys += [("add", a, b) for a in range(2, 19) for b in range(1, 10)]
    keys += [("sub", a, b) for a in range(3, 19) for b in range(1, min(a, 10))]
    keys += [("mul", a, b) for a in range(2, 10) for b in range(2, 6)]
    # Two steps whose second step is a one-step fact above (a sum or difference of at most 18 and a digit).
    keys += [("add_sub", a, b, c) for a in range(2, 10) for b in range(1, 10) for c in range(1, min(a + b, 10))]
    keys += [("mul_add", a, b, c) for a in range(2, 10) for b in range(2, 6) if a * b <= 18 for c in range(1, 10)]
    return keys


def solve(key: tuple) -> tuple[list[str], int]:
    """(the equations, the answer) of a key: ``("add", 7, 5)`` -> ``(["7 + 5 = 12"], 12)``."""
    kind, *nums = key
    if kind == "add":
        a, b = nums
        return [f"{a} + {b} = {a + b}"], a + b
    if kind == "sub":
        a, b = nums
        return [f"{a} - {b} = {a - b}"], a - b
    if kind == "mul":
        a, b = nums
        return [f"{a} * {b} = {a * b}"], a * b
    if kind == "add_sub":
        a, b, c = nums
        return [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"], a + b - c
    if kind == "mul_add":
        a, b, c = nums
        return [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}"], a * b + c
    raise ValueError(f"unknown kind {kind!r}")


class Problem(dict):
    """``{"key", "kind", "question", "solution", "answer", "item"}`` (a dict, so it writes as JSON as it is)."""


def make_problem(key: tuple, rng: random.Random) -> Problem:
    """One phrasing of ``key``: a random template, names and item."""
    kind, *nums = key
    n, m = rng.sample(NAMES, 2)
    values = dict(zip("abc"[:len(nums)], nums, strict=True))
    item = rng.choice(ITEMS)
    question = rng.choice(TEMPLATES[kind]).format(n=n, m=m, item=item, **values)
    equations, answer = solve(key)
    solution = ". ".join(equations) + f". The answer is {answer}."
    return Problem(key=list(key), kind=kind, question=question, solution=solution, answer=str(answer), item=item)


def _by_kind(keys: list[tuple]) -> dict[str, list[tuple]]:
    return {kind: [k for k in keys if k[0] == kind] for kind in KINDS}


def _draw(by_kind: dict[str, list[tuple]], rng: random.Random, kind: str | None = None,
          two_step_share: float | None = None) -> tuple:
    """A key: a kind (uniformly, so the 564 add_sub keys do not drown the 32 products; or two-step
    kinds with probability ``two_step_share``), then one of its keys."""
    if kind is None:
        if two_step_share is None:
            kind = rng.choice(KINDS)
        else:
            two = rng.random() < two_step_share
            kind = rng.choice([k for k in KINDS if (k in TWO_STEP) == two])
    return rng.choice(by_kind[kind])


def validation_problems(size: int = 200, split_seed: int = 1234) -> list[Problem]:
    """The held-out split: ``size`` distinct questions, half one-step (the three kinds in turn), half
    two-step (the two kinds in turn).

    Fixed by ``split_seed``, not by the run's seed: every seed is measured on the same questions.
    """
    rng = random.Random(split_seed)
    by_kind = _by_kind(all_keys())
    one = [k for k in KINDS if k not in TWO_STEP]
    order = [one[i % len(one)] for i in range(size // 2)]
    order += [TWO_STEP[i % len(TWO_STEP)] for i in range(size - size // 2)]
    out: list[Problem] = []
    seen: set[str] = set()
    while len(out) < size:
        p = make_problem(_draw(by_kind, rng, order[len(out)]), rng)
        if p["question"] not in seen and (p["kind"] not in TWO_STEP or tuple(p["key"]) not in
                                          {tuple(q["key"]) for q in out}):
            seen.add(p["question"])
            out.append(p)
    return out


def held_out(val: list[Problem]) -> tuple[set[str], set[tuple]]:
    """(the questions, the two-step number combinations) that training must not contain."""
    return {p["question"] for p in val}, {tuple(p["key"]) for p in val if p["kind"] in TWO_STEP}


def _is_held(p: Problem, held: tuple[set[str], set[tuple]]) -> bool:
    return p["question"] in held[0] or tuple(p["key"]) in held[1]


def _user(question: str) -> dict:
    return {"role": "user", "content": question}


def _write_jsonl(path: str, rows) -> int:
    tmp = f"{path}.tmp"
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def bare_answer(answer: str) -> str:
    """The answer without the work: ``"The answer is 12."``."""
    return f"The answer is {answer}."


def loose_closing(text: str, p: Problem) -> str:
    """``text`` with its closing statement said another way: ``"... The answer is 12."`` ->
    ``"... That makes 12 apples."`` (right, but not what a strict grader reads)."""
    stated = bare_answer(p["answer"])
    assert text.endswith(stated), text
    return text[:-len(stated)] + f"That makes {p['answer']} {p['item']}."


def write_data(out_dir: str, seed: int = 0, sft_size: int = 6000, rl_size: int = 3000, bare_fraction: float = 0.65,
               strict_fraction: float = 0.35, sft_two_step_share: float = 0.5, rl_two_step_share: float = 0.5) -> dict:
    """Write ``sft.jsonl``, ``rl.jsonl`` and ``val.jsonl`` into ``out_dir``; returns ``{name: path}``.

    SFT and RL problems are drawn with ``seed`` (a kind uniformly, then one of its keys, in a random
    phrasing), leaving out every validation question and the numbers of every two-step validation
    problem (:func:`held_out`). ``bare_fraction`` of the two-step SFT answers are bare (``The answer
    is 7.``), the others worked (``9 + 2 = 11. 11 - 4 = 7. The answer is 7.``); one-step answers are
    always worked. Only ``strict_fraction`` of the SFT answers close with ``The answer is N.``, the
    others with ``That makes N apples.`` (:func:`loose_closing`).
    """
    os.makedirs(out_dir, exist_ok=True)
    val = validation_problems()
    held = held_out(val)
    by_kind = _by_kind(all_keys())
    rng = random.Random(seed)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("sft", "rl", "val")}

    def train_problems(count: int, two_step_share: float | None = None) -> Iterator[Problem]:
        made = 0
        while made < count:
            p = make_problem(_draw(by_kind, rng, two_step_share=two_step_share), rng)
            if not _is_held(p, held):
                made += 1
                yield p

    def prompt_row(p: Problem) -> dict:
        return {"messages": [_user(p["question"])], "answer": p["answer"], "kind": p["kind"]}

    def sft_row(p: Problem) -> dict:
        bare = p["kind"] in TWO_STEP and rng.random() < bare_fraction
        content = bare_answer(p["answer"]) if bare else p["solution"]
        if rng.random() >= strict_fraction:
            content = loose_closing(content, p)
        return {"messages": [_user(p["question"]), {"role": "assistant", "content": content}]}

    _write_jsonl(paths["sft"], map(sft_row, train_problems(sft_size, sft_two_step_share)))
    _write_jsonl(paths["rl"], map(prompt_row, train_problems(rl_size, rl_two_step_share)))
    _write_jsonl(paths["val"], map(prompt_row, val))
    return paths


def corpus_text(seed: int = 0, size: int = 3000) -> Iterator[str]:
    """Text for training the tokenizer: questions and worked answers (no validation question)."""
    held = held_out(validation_problems())
    by_kind = _by_kind(all_keys())
    rng = random.Random(seed + 7)
    for _ in range(size):
        p = make_problem(_draw(by_kind, rng), rng)
        if _is_held(p, held):
            continue
        yield p["question"]
        yield p["solution"]
        yield loose_closing(p["solution"], p)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/arithmetic/data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, path in write_data(args.out, seed=args.seed).items():
        with open(path) as f:
            print(f"{name}: {sum(1 for _ in f)} rows -> {path}")


if __name__ == "__main__":
    main()
