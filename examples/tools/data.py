"""Questions a small model cannot answer in its head, products of two 4-digit numbers, with a calculator to call.

A tool-using episode, as the policy is to write it (Qwen2.5's chat template, the calculator's schema in its
system turn)::

    user       What is 4821 * 7395?
    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "4821 * 7395"}}\\n</tool_call>
    tool       35651295
    assistant  The answer is 35651295.

Like much real data, the demonstrations do not always use the tool: for two of the four phrasings of a product
(``How much is a multiplied by b?``, ``What do you get when you multiply a by b?``) 60% of them answer at once, a
number the model cannot compute in its head. Greedy decoding after SFT then answers those phrasings without the
calculator, and gets them wrong; sampled (temperature 0.7), a group of 8 holds both behaviours, and GRPO's strict
reward moves the model to calling the tool. The no-tool arm answers every question at once (``The answer is
35651295.``), the same questions, no tools in its prompt. Half the training products have 7 digits
(``SEVEN_DIGIT_SHARE``) and some training questions are sums and differences (variety); the 200 validation questions
are products only, drawn uniformly, the same for every seed, and no training question asks one of them.

Files (``write_data``), TRL's conversational format:

- ``sft-tool.jsonl`` / ``sft-direct.jsonl``: demonstrations for ``fastrlhf sft``, which trains on a chat's last
  assistant message: each tool demonstration gives two rows (the call; the answer after the tool's result);
- ``rl.jsonl``: ``{"messages": [user], "answer": "35651295"}`` prompts for ``fastrlhf train``;
- ``val.jsonl``: the held-out questions, same format;
- ``pretrain-tool.jsonl`` / ``pretrain-direct.jsonl``: whole episodes for the pretraining stand-in.
"""

from __future__ import annotations

import json
import os
import random

__all__ = ["CALCULATOR", "question", "tool_call_text", "answer_text", "validation_problems", "train_problems",
           "uses_tool", "demonstration", "tool_episode", "direct_episode", "write_data", "corpus_text"]

CALCULATOR = "examples.tools.calculator:calculator"
PHRASINGS = {
    "*": ["What is {a} * {b}?", "Compute {a} times {b}.", "How much is {a} multiplied by {b}?",
          "What do you get when you multiply {a} by {b}?"],
    "+": ["What is {a} + {b}?", "Compute {a} plus {b}."],
    "-": ["What is {a} - {b}?", "Compute {a} minus {b}."],
}
VAL_SEED, VAL_SIZE = 1234, 200
# Share of the training products with 7 digits (the rest have 8). Drawn uniformly, 17% of them have 7, and the
# model learned to copy 8-digit results only: copying is positional for a model this small.
SEVEN_DIGIT_SHARE = 0.5
# Share of the tool arm's demonstrations that answer without the tool, per (operator, phrasing).
ANSWER_AT_ONCE = {("*", 2): 0.6, ("*", 3): 0.6}


def question(a: int, op: str, b: int, phrasing: int) -> str:
    return PHRASINGS[op][phrasing % len(PHRASINGS[op])].format(a=a, b=b)


def result(a: int, op: str, b: int) -> int:
    return {"*": a * b, "+": a + b, "-": a - b}[op]


def tool_call_text(a: int, op: str, b: int) -> str:
    """The assistant's first turn: one Hermes tool call (what the chat template renders for a ``tool_calls``
    entry, so the text and the template agree token for token)."""
    arguments = json.dumps({"expression": f"{a} {op} {b}"})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'


def answer_text(value: int) -> str:
    return f"The answer is {value}."


def _draw(rng: random.Random, op: str) -> tuple[int, str, int, int]:
    return rng.randint(1000, 9999), op, rng.randint(1000, 9999), rng.randrange(4)


def validation_problems() -> list[tuple[int, str, int, int]]:
    rng = random.Random(VAL_SEED)
    return [_draw(rng, "*") for _ in range(VAL_SIZE)]


def train_problems(count: int, seed: int, product_share: float = 0.8):
    """``count`` problems, none with a validation question's numbers."""
    held = {(a, b) for a, _, b, _ in validation_problems()}
    rng = random.Random(seed * 1000 + 17)
    out = []
    while len(out) < count:
        op = "*" if rng.random() < product_share else rng.choice("+-")
        digits = (7 if rng.random() < SEVEN_DIGIT_SHARE else 8) if op == "*" else None
        p = _draw(rng, op)
        while digits and len(str(result(*p[:3]))) != digits:
            p = _draw(rng, op)
        if (p[0], p[2]) not in held:
            out.append(p)
    return out


def _user(p) -> dict:
    return {"role": "user", "content": question(*p)}


def uses_tool(p) -> bool:
    """Whether the tool arm's demonstration of ``p`` calls the calculator (fixed per problem)."""
    a, op, b, phrasing = p
    share = ANSWER_AT_ONCE.get((op, phrasing % len(PHRASINGS[op])), 0.0)
    return random.Random(a * 100_003 + b * 7 + phrasing).random() >= share


def demonstration(p) -> list[dict]:
    """The tool arm's demonstration: the episode with the calculator, or (``uses_tool`` false) the answer at once."""
    return tool_episode(p) if uses_tool(p) else direct_episode(p)


def tool_episode(p) -> list[dict]:
    a, op, b, _ = p
    return [_user(p), {"role": "assistant", "content": tool_call_text(a, op, b)},
            {"role": "tool", "name": "calculator", "content": str(result(a, op, b))},
            {"role": "assistant", "content": answer_text(result(a, op, b))}]


def direct_episode(p) -> list[dict]:
    a, op, b, _ = p
    return [_user(p), {"role": "assistant", "content": answer_text(result(a, op, b))}]


def _write(path: str, rows) -> int:
    tmp = f"{path}.tmp"
    count = 0
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def write_data(out_dir: str, seed: int = 0, pretrain_size: int = 12000, sft_size: int = 400,
               rl_size: int = 2000) -> dict[str, str]:
    """Every file of the example (see the module docstring) into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    problems = train_problems(pretrain_size + sft_size + rl_size, seed)
    pretrain, sft, rl = (problems[:pretrain_size], problems[pretrain_size:pretrain_size + sft_size],
                         problems[pretrain_size + sft_size:])
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in
             ("pretrain-tool", "pretrain-direct", "sft-tool", "sft-direct", "rl", "val")}
    _write(paths["pretrain-tool"], ({"messages": demonstration(p)} for p in pretrain))
    _write(paths["pretrain-direct"], ({"messages": direct_episode(p)} for p in pretrain))
    # fastrlhf sft learns a chat's last assistant message: the call, and (another row) the answer after the result.
    _write(paths["sft-tool"], ({"messages": tool_episode(p)[:k]} if uses_tool(p) else {"messages": direct_episode(p)}
                               for p in sft for k in ((2, 4) if uses_tool(p) else (2,))))
    _write(paths["sft-direct"], ({"messages": direct_episode(p)} for p in sft))
    _write(paths["rl"], ({"messages": [_user(p)], "answer": str(result(*p[:3]))} for p in rl))
    _write(paths["val"], ({"messages": [_user(p)], "answer": str(result(*p[:3]))} for p in validation_problems()))
    return paths


def corpus_text(seed: int = 0, size: int = 2000):
    """Text for the tokenizer: questions, calls, results and answers (no validation question)."""
    for p in train_problems(size, seed + 99):
        a, op, b, _ = p
        yield question(*p)
        yield tool_call_text(a, op, b)
        yield answer_text(result(a, op, b))
