"""Greedy accuracy of a model folder on the held-out split, with plain ``transformers`` (no trainer code).

The prompt is the tokenizer's chat template with the generation prompt; the completion is greedy,
cut at ``<|im_end|>``; it is right when :func:`examples.arithmetic.reward.correctness` says so.

    python -m examples.arithmetic.evaluate --model runs/arithmetic/seed0/sft/final --data runs/arithmetic/data/val.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter

from examples.arithmetic.reward import NUMBER, correctness, extract_answer

__all__ = ["load_rows", "greedy", "evaluate", "outside_mass"]


def load_rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def greedy(model, tokenizer, chats: list[list[dict]], max_new_tokens: int, batch_size: int = 128) -> list[str]:
    """Greedy completions of ``chats`` (left-padded batches through ``generate``), decoded without specials."""
    import torch

    from fastrlhf.engine.device import model_device, to_device

    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out = []
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(prompts), batch_size):
            ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[start:start + batch_size]]
            width = max(map(len, ids))
            input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for i, row in enumerate(ids):
                input_ids[i, width - len(row):] = torch.tensor(row)
                mask[i, width - len(row):] = 1
            seqs = model.generate(**to_device(dict(input_ids=input_ids, attention_mask=mask), model_device(model)),
                                  do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
            for row in seqs[:, width:].tolist():
                row = row[:row.index(eos)] if eos in row else row
                out.append(tokenizer.decode(row, skip_special_tokens=True))
    return out


def last_number_is(completion: str, answer: str) -> bool:
    """Whether the completion's last number is ``answer``, however it is phrased (a lenient reader)."""
    numbers = re.findall(NUMBER, completion)
    return bool(numbers) and numbers[-1].replace(",", "") == answer


def evaluate(model_dir: str, data_path: str, max_new_tokens: int = 40, num_samples: int = 6) -> dict:
    """``{"accuracy", "lenient_accuracy", "per_kind": {kind: accuracy}, "worked", "accuracy_worked",
    "accuracy_bare", "no_answer", "n", "samples"}`` on ``data_path``.

    ``accuracy`` is the reward's (a stated answer, right); ``lenient_accuracy`` counts a right last
    number however it is said, i.e. the arithmetic alone; ``no_answer`` is the share with no stated
    answer. ``worked`` is the share of answers that show their work (an equation), ``accuracy_worked``
    / ``accuracy_bare`` the lenient accuracy of those that do / do not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = load_rows(data_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    completions = greedy(model, tokenizer, [r["messages"] for r in rows], max_new_tokens)
    answers = [r["answer"] for r in rows]
    right = correctness(None, completions, None, answers)
    asked, correct = Counter(), Counter()
    for row, ok in zip(rows, right, strict=True):
        asked[row.get("kind", "all")] += 1
        correct[row.get("kind", "all")] += bool(ok)
    samples = [{"question": r["messages"][-1]["content"], "completion": c, "answer": r["answer"], "correct": bool(ok)}
               for r, c, ok in list(zip(rows, completions, right, strict=True))[:num_samples]]
    lenient = [last_number_is(c, a) for c, a in zip(completions, answers, strict=True)]
    worked = ["=" in c for c in completions]
    n_worked = sum(worked)
    right_worked = sum(ok for ok, w in zip(lenient, worked, strict=True) if w)
    return {"accuracy": sum(map(bool, right)) / len(rows), "lenient_accuracy": sum(lenient) / len(rows),
            "per_kind": {k: correct[k] / asked[k] for k in sorted(asked)},
            "worked": n_worked / len(rows),
            "accuracy_worked": right_worked / n_worked if n_worked else None,
            "accuracy_bare": ((sum(lenient) - right_worked) / (len(rows) - n_worked)
                              if n_worked < len(rows) else None),
            "no_answer": sum(extract_answer(c) is None for c in completions) / len(rows),
            "n": len(rows), "samples": samples}


def outside_mass(model_dir: str, data_path: str, rows: int = 32) -> float:
    """Mean probability the model gives, at each answer token of the first ``rows`` SFT rows, to ids the
    tokenizer never makes (the padded rows of the 151,936-row vocabulary); sampling draws these."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastrlhf.engine.device import model_device, to_device

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    masses = []
    with torch.inference_mode():
        for row in load_rows(data_path)[:rows]:
            prompt = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=False)
            ids = tokenizer(prompt + row["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
            start = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) - 1
            input_ids = to_device(torch.tensor([ids]), model_device(model))
            logp = model(input_ids=input_ids).logits[0, start:].log_softmax(-1)
            masses.append(logp[:, len(tokenizer):].logsumexp(-1).exp().mean().item())
    return sum(masses) / len(masses)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default="runs/arithmetic/data/val.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    result = evaluate(args.model, args.data, args.max_new_tokens)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    for s in result["samples"]:
        print(("OK  " if s["correct"] else "BAD ") + f"{s['question']!r} -> {s['completion']!r} (answer {s['answer']})")


if __name__ == "__main__":
    main()
