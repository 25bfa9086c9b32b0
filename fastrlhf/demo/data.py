"""Data files and the initial model of the demo, all generated locally (no downloads).

Numbers are split once, the same for every seed: ``EVAL_SIZE`` numbers are held out for the test
(``eval.jsonl``, the reported accuracy) and ``VAL_SIZE`` for validation during RL (``val.jsonl``,
early stopping); neither appears in pretraining, reward-model or RL data.
"""

from __future__ import annotations

import json
import os
import random

from fastrlhf.demo import script_doubling as task

__all__ = ["MODEL_SHAPE", "SCRIPT_LABELS", "split_numbers", "write_data", "write_classifier_data", "make_initial_model"]

# Head size 32 (128 / 4): the smallest the vLLM CPU attention backend runs, so the folder works with
# either rollout engine. 0.34M parameters: small enough for 2 CPU cores, big enough to learn doubling.
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=32)
# Classifier labels of the learned reward model: index = label.
SCRIPT_LABELS = list(task.SCRIPTS)  # ["digits", "lower", "upper"]
EVAL_SIZE = 1000
VAL_SIZE = 1000


def split_numbers(seed: int = 1234) -> tuple[list[int], list[int], list[int]]:
    """(train, validation, test numbers), disjoint, covering 1000-9999."""
    numbers = list(range(1000, 10000))
    random.Random(seed).shuffle(numbers)
    test, val = numbers[:EVAL_SIZE], numbers[EVAL_SIZE:EVAL_SIZE + VAL_SIZE]
    return sorted(numbers[EVAL_SIZE + VAL_SIZE:]), val, test


def _write_jsonl(path: str, rows) -> int:
    tmp = f"{path}.tmp"
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def _prompt(number: int, prefix: str) -> str:
    return f"{task.BOS}{prefix}:{number}x2="


def write_data(data_dir: str, rl_prompts: int = 4000, seed: int = 0) -> dict:
    """Write the demo's JSONL files into ``data_dir``; returns {name: path}.

    - ``pretrain.jsonl``: every train number in every script, unprefixed (``S__:``): SFT pairs.
    - ``rl_prompts.jsonl``: prefixed prompts for RL, ``meta.script`` / ``meta.label`` = the requested script.
    - ``val.jsonl``: held-out prefixed prompts for validation during RL.
    - ``eval.jsonl``: the held-out prefixed test prompts with their expected completions.
    """
    os.makedirs(data_dir, exist_ok=True)
    rng = random.Random(seed)
    train, val, test = split_numbers()
    paths = {name: os.path.join(data_dir, f"{name}.jsonl")
             for name in ("pretrain", "rl_prompts", "val", "eval")}

    pretrain = [(n, s) for n in train for s in task.SCRIPTS]
    rng.shuffle(pretrain)
    _write_jsonl(paths["pretrain"], (
        {"prompt_ids": task.encode(_prompt(n, task.UNPREFIXED)), "response_ids": task.encode(task.answer(n, s)),
         "text": _prompt(n, task.UNPREFIXED) + task.answer(n, s)} for n, s in pretrain))

    def prefixed(numbers, k):
        for n in (rng.choice(numbers) for _ in range(k)) if k else numbers:
            script = rng.choice(SCRIPT_LABELS)
            prompt = _prompt(n, task.PREFIXES[script])
            yield {"prompt_ids": task.encode(prompt), "text": prompt,
                   "meta": {"script": script, "label": SCRIPT_LABELS.index(script),
                            "expected": task.expected_completion(prompt)}}

    _write_jsonl(paths["rl_prompts"], prefixed(train, rl_prompts))
    _write_jsonl(paths["val"], prefixed(val, 0))
    _write_jsonl(paths["eval"], prefixed(test, 0))
    return paths


def _mixed_answer(rng: random.Random, number: int) -> str:
    """An answer that switches script part-way (some characters in another script)."""
    digits = str(2 * number)
    scripts = rng.sample(SCRIPT_LABELS, 2)
    k = rng.randint(1, len(digits) - 1)  # characters in the second script: at least one, not all
    swapped = set(rng.sample(range(len(digits)), k))
    return "".join(task.SCRIPTS[scripts[i in swapped]][int(d)] for i, d in enumerate(digits)) + task.EOS


def write_classifier_data(path: str, examples: int = 6000, mixed_fraction: float = 0.3, seed: int = 0) -> str:
    """``S`` + an answer, labelled with its script: the learned reward model's data (train numbers only).

    Answers that switch script part-way are labelled with the script they START in. Trained on clean
    answers alone, the classifier read mostly the last characters and paid full reward for an answer
    whose first character was in the wrong script; RL found that (measured: 4.8% of answers mixed
    scripts after RL, accuracy 95.0%).
    """
    rng = random.Random(seed + 1)
    train, _, _ = split_numbers()

    def rows():
        for _ in range(examples):
            n = rng.choice(train)
            text = _mixed_answer(rng, n) if rng.random() < mixed_fraction else task.answer(n, rng.choice(SCRIPT_LABELS))
            label = task.completion_script(text[0] + task.EOS)
            yield {"input_ids": task.encode(task.BOS + text), "label": SCRIPT_LABELS.index(label),
                   "text": task.BOS + text}

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _write_jsonl(path, rows())
    return path


def make_initial_model(out_dir: str, seed: int = 0, **shape) -> int:
    """A random-init Llama with the task's tokenizer, saved as a standard HF folder; returns its parameter count."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(task.VOCAB), tie_word_embeddings=False, bos_token_id=task.BOS_ID,
                         eos_token_id=task.EOS_ID, pad_token_id=task.PAD_ID, **{**MODEL_SHAPE, **shape})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=task.BOS_ID, eos_token_id=task.EOS_ID,
                                               pad_token_id=task.PAD_ID)
    tmp = f"{out_dir.rstrip(os.sep)}.tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    task.build_tokenizer().save_pretrained(tmp)
    if os.path.exists(out_dir):
        import shutil

        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return sum(p.numel() for p in model.parameters())
