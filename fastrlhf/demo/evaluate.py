"""Greedy exact-match accuracy of a model folder on the held-out prefixed prompts."""

from __future__ import annotations

import json
from collections import Counter

from fastrlhf.demo import script_doubling as task

__all__ = ["load_eval_prompts", "greedy_completions", "evaluate"]


def load_eval_prompts(path: str) -> list[list[int]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt_ids"] for line in f if line.strip()]


def greedy_completions(model, prompts: list[list[int]], max_new_tokens: int = 8, batch_size: int = 500,
                       progress: bool = True, desc: str = "evaluate") -> list[list[int]]:
    """Greedy completions (cut after the first EOS) of ``prompts``, left-padded batches through ``generate``."""
    import torch
    from tqdm import tqdm

    from fastrlhf.engine.device import model_device, to_device

    out = []
    model.eval()
    with torch.inference_mode(), tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress,
                                      dynamic_ncols=True) as bar:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), task.PAD_ID, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            seqs = model.generate(**to_device(dict(input_ids=ids, attention_mask=mask), model_device(model)),
                                  do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=task.EOS_ID,
                                  pad_token_id=task.PAD_ID)
            for row in seqs[:, width:].tolist():
                end = row.index(task.EOS_ID) + 1 if task.EOS_ID in row else len(row)
                out.append(row[:end])
            bar.update(len(chunk))
    return out


def evaluate(model_dir: str, eval_path: str, progress: bool = True, desc: str = "evaluate",
             num_samples: int = 8) -> dict:
    """Exact-match accuracy (the RL reward's definition), plus how often the number is right in any script.

    Returns ``{"accuracy", "right_number", "per_script": {requested script: accuracy}, "scripts": {script
    answered in: share}, "samples": [...], "n"}``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = load_eval_prompts(eval_path)
    completions = greedy_completions(model, prompts, progress=progress, desc=desc)
    exact = right_number = 0
    scripts: Counter = Counter()
    asked: Counter = Counter()  # prompts per requested script
    exact_by_script: Counter = Counter()
    samples = []
    for prompt_ids, completion_ids in zip(prompts, completions, strict=True):
        ok = task.reward(prompt_ids, completion_ids) == 1.0
        exact += ok
        requested = task.requested_script(task.decode(prompt_ids))
        asked[requested] += 1
        exact_by_script[requested] += ok
        completion = task.decode(completion_ids)
        expected = task.expected_completion(task.decode(prompt_ids))
        script = task.completion_script(completion)
        scripts[script or "other"] += 1
        digits_of = {ch: str(i) for chars in task.SCRIPTS.values() for i, ch in enumerate(chars)}
        as_digits = "".join(digits_of.get(ch, "?") for ch in completion.rstrip(task.EOS))
        want = "".join(digits_of.get(ch, "?") for ch in expected.rstrip(task.EOS))
        right_number += as_digits == want and completion.endswith(task.EOS)
        if len(samples) < num_samples:
            samples.append({"prompt": task.decode(prompt_ids), "completion": completion, "expected": expected,
                            "correct": bool(ok)})
    n = len(prompts)
    return {"accuracy": exact / n, "right_number": right_number / n,
            "per_script": {s: exact_by_script[s] / asked[s] for s in task.SCRIPTS if asked[s]},
            "scripts": {k: v / n for k, v in sorted(scripts.items())}, "samples": samples, "n": n}
