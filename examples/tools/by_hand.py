"""Greedy episodes driven by hand with plain ``transformers`` (no fastrlhf code): a check of the pretraining and
SFT stages that does not depend on the trainer's episode loop.

For each held-out question: the prompt (the calculator's schema in the system turn for the tool arm), greedy
``generate`` of turn 1 up to ``<|im_end|>``; if it holds a ``<tool_call>``, the call is parsed, the calculator
run, and the template's tool turn (``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...``) appended as token
ids, then turn 2 is generated. Strict accuracy is ``examples.tools.reward.correctness`` on the last assistant
turn.

    python -m examples.tools.by_hand runs/tools/seed0/sft-tool/final --data runs/tools/seed0/data/val.jsonl --tools
"""

from __future__ import annotations

import argparse
import json
import re

__all__ = ["parse_tool_call", "run_episodes"]

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """``(name, arguments)`` of the first Hermes tool call in ``text``, or None."""
    m = _CALL.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
        return call["name"], dict(call["arguments"])
    except (ValueError, KeyError, TypeError):
        return None


def _generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """Greedy continuations (up to and including eos) of token-id prompts, batched with left padding."""
    import torch

    out = []
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad)
        for row in gen[:, width:].tolist():
            out.append(row[:row.index(eos) + 1] if eos in row else row)
    return out


def run_episodes(model_dir: str, rows: list[dict], tools: bool, max_new_tokens: int = 40,
                 batch_size: int = 50) -> dict:
    """Greedy episodes (at most one tool call) for ``rows`` (``messages`` + ``answer``); returns accuracy,
    the share of episodes that called the tool, the share whose call gave the right result, and the episodes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema

    from examples.tools.calculator import calculator
    from examples.tools.reward import correctness

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    schemas = [get_json_schema(calculator)] if tools else None

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    prompts = [ids(tokenizer.apply_chat_template(r["messages"], tools=schemas, tokenize=False,
                                                 add_generation_prompt=True)) for r in rows]
    first = _generate(model, tokenizer, prompts, max_new_tokens, batch_size)
    episodes = [[{"role": "assistant", "content": tokenizer.decode(t, skip_special_tokens=True)}] for t in first]
    second_at, second_prompts = [], []
    for i, (prompt, turn) in enumerate(zip(prompts, first, strict=True)):
        call = parse_tool_call(episodes[i][0]["content"]) if tools else None
        if call is None:
            continue
        name, arguments = call
        try:
            result = calculator(**arguments) if name == "calculator" else f"error: no tool {name!r}"
        except Exception as exc:  # noqa: BLE001 - a bad call is the model's mistake, shown to it as the result
            result = f"error: {exc}"
        tool = {"role": "tool", "name": "calculator", "content": result}
        episodes[i].append(tool)
        # The template's text between the assistant's eos and the next assistant turn: the rest of the closing
        # ("\n"), the tool turn, the assistant header (what fastrlhf's TurnTemplate.between renders).
        between = "\n" + tokenizer.apply_chat_template([{"role": "user", "content": "x"}, tool], tokenize=False,
                                                       add_generation_prompt=True).split("<|im_end|>\n", 1)[1]
        if turn[-1:] != [tokenizer.eos_token_id]:
            between = "<|im_end|>" + between
        second_at.append(i)
        second_prompts.append(prompt + turn + ids(between))
    for i, turn in zip(second_at, _generate(model, tokenizer, second_prompts, max_new_tokens, batch_size),
                       strict=True):
        episodes[i].append({"role": "assistant", "content": tokenizer.decode(turn, skip_special_tokens=True)})
    rewards = correctness(None, episodes, None, [r["answer"] for r in rows])
    called = [len(e) > 1 for e in episodes]
    right_result = [len(e) > 1 and e[1]["content"] == r["answer"] for e, r in zip(episodes, rows, strict=True)]
    return {"accuracy": sum(rewards) / len(rows), "questions": len(rows), "called_tool": sum(called) / len(rows),
            "right_tool_result": sum(right_result) / len(rows),
            "copied_when_right_result": (sum(1 for ok, r in zip(right_result, rewards, strict=True) if ok and r)
                                         / max(1, sum(right_result))),
            "prompt_tokens": max(map(len, prompts)),
            "episodes": [{"question": r["messages"][-1]["content"], "answer": r["answer"], "reward": w, "episode": e}
                         for r, e, w in zip(rows, episodes, rewards, strict=True)]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--data", required=True)
    parser.add_argument("--tools", action="store_true", help="the tool arm: the schema in the prompt, calls run")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--show", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dump", default=None, help="write every episode (jsonl) here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    with open(args.data) as f:
        rows = [json.loads(line) for line in f][:args.limit]
    result = run_episodes(args.model, rows, args.tools)
    shown = result.pop("episodes")
    print(json.dumps(result))
    if args.dump:
        with open(args.dump, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in shown)
    for e in shown[:args.show]:
        print(json.dumps(e))


if __name__ == "__main__":
    main()
