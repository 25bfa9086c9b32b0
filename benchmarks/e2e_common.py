"""Shared pieces of the end-to-end benchmarks: workloads, model folders, prompts, rewards, result lines.

Both trainers (``e2e_ours.py``, ``e2e_trl.py``) are child scripts that read one JSON spec, build
nothing themselves but read the same model folder and prompt file written here, and print one
``E2E_RESULT {json}`` line. Nothing here imports TRL.

Workloads
- ``A``: the demo task's model (``fastrlhf.tasks.script_doubling``: character vocabulary of 43, a
  random-init 0.34M-parameter Llama of the demo's shape), 16 prefixed doubling prompts x 8
  completions, up to 8 new tokens, the exact-match rule reward (read from token ids).
- ``B``: a ~19M-parameter Llama with a 32,000-token vocabulary (random init, untied LM head: 16.4M of
  the parameters are the embedding and the LM head, as in small real models), synthetic prompts of
  64 random tokens, 64 new tokens, reward = fraction of completion tokens with an even id.

The prompt pool holds exactly ``prompts_per_step`` prompts, so every step of both trainers sees the
same prompts (each trainer shuffles their order, which changes nothing).
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import sys

RESULT_PREFIX = "E2E_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> workload; every trainer-facing knob is here so both trainers read the same numbers.
WORKLOADS = {
    "A": dict(model="doubling", prompts_per_step=16, n=8, max_new_tokens=8, prompt_len=13, lr=1e-3,
              kl_coef=0.001, steps=8, warmup=2),
    "B": dict(model="llama32k", prompts_per_step=4, n=8, max_new_tokens=64, prompt_len=64, lr=1e-4,
              kl_coef=0.001, steps=4, warmup=1),
}
# Llama of workload B: 32,000 x 256 embedding + LM head (16.4M) + 4 layers (2.6M) = 19.0M parameters.
LLAMA32K = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # workload B's special tokens


# --------------------------------------------------------------------------------------------- rewards
def doubling_reward(prompt_ids, completion_ids, meta=None) -> float:
    """Workload A (fastrlhf signature): the demo task's exact-match reward."""
    from fastrlhf.tasks.script_doubling import reward

    return reward(prompt_ids, completion_ids, meta)


def even_fraction_reward(prompt_ids, completion_ids, meta=None) -> float:
    """Workload B (fastrlhf signature): fraction of completion tokens with an even id."""
    return sum(1 for t in completion_ids if t % 2 == 0) / len(completion_ids) if len(completion_ids) else 0.0


# --------------------------------------------------------------------------------------------- set-up
def _llama32k_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Special tokens must not be substrings of ordinary ones (added tokens are matched first).
    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"t{i}": i for i in range(3, LLAMA32K["vocab_size"])})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>", clean_up_tokenization_spaces=False)


def prompt_text(model: str, ids: list[int]) -> str:
    """The text whose tokenization (no special tokens added) gives exactly ``ids``."""
    if model == "doubling":
        from fastrlhf.tasks.script_doubling import decode

        return decode(ids)
    return " ".join(f"t{i}" for i in ids)


def make_model(model: str, out_dir: str, seed: int = 0) -> int:
    """Write a random-init Llama + tokenizer (a standard HF folder); returns its parameter count."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if model == "doubling":
        from fastrlhf.tasks import script_doubling as task

        # The demo's shape (fastrlhf/demo/data.py MODEL_SHAPE).
        config = LlamaConfig(vocab_size=len(task.VOCAB), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                             tie_word_embeddings=False, bos_token_id=task.BOS_ID, eos_token_id=task.EOS_ID,
                             pad_token_id=task.PAD_ID)
        tokenizer, ids = task.build_tokenizer(), (task.BOS_ID, task.EOS_ID, task.PAD_ID)
    else:
        config = LlamaConfig(**LLAMA32K, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                             pad_token_id=PAD_ID)
        tokenizer, ids = _llama32k_tokenizer(), (BOS_ID, EOS_ID, PAD_ID)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = LlamaForCausalLM(config)
    lm.generation_config = GenerationConfig(bos_token_id=ids[0], eos_token_id=ids[1], pad_token_id=ids[2])
    lm.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in lm.parameters())


def make_prompts(model: str, count: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if model == "doubling":
        from fastrlhf.tasks import script_doubling as task

        return [task.encode(task.make_example(rng, prefixed=True).prompt) for _ in range(count)]
    return [[rng.randrange(3, LLAMA32K["vocab_size"]) for _ in range(prompt_len)] for _ in range(count)]


def prepare(work_dir: str, workload: dict) -> dict:
    """Model folder + prompt file for ``workload`` under ``work_dir``; returns the paths (cached)."""
    model_dir = os.path.join(work_dir, f"model-{workload['model']}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_model(workload["model"], model_dir)
    prompts = make_prompts(workload["model"], workload["prompts_per_step"], workload["prompt_len"])
    path = os.path.join(work_dir, f"prompts-{workload['model']}-{len(prompts)}.jsonl")
    with open(path, "w") as f:
        for ids in prompts:
            f.write(json.dumps({"prompt_ids": ids, "prompt": prompt_text(workload["model"], ids)}) + "\n")
    return {"model_dir": model_dir, "prompts": path}


# --------------------------------------------------------------------------------------------- child side
def child_setup(threads: int) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.pop("TRITON_INTERPRET", None)  # the CPU paths of our kernels are torch; TRL uses none
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summarize(steps: list[dict], warmup: int) -> dict:
    """Medians over the measured (post-warm-up) steps of every numeric per-step key."""
    measured = steps[warmup:]
    keys = sorted({k for s in measured for k, v in s.items() if isinstance(v, (int, float))})
    return {k: statistics.median(s[k] for s in measured if k in s) for k in keys}


def emit(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def read_spec() -> dict:
    return json.loads(sys.argv[1])


# --------------------------------------------------------------------------------------------- parent side
SCRIPTS = {"fastrlhf": "e2e_ours.py", "trl": "e2e_trl.py"}
SPLIT_KEYS = ("generate_s", "reward_s", "old_logprob_s", "reference_s", "score_s", "train_s", "sync_s")


def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def run_child(trainer: str, spec: dict, timeout_s: float = 1200.0) -> dict:
    """Run one trainer's child script on ``spec``; returns its E2E_RESULT (raises with its stderr on failure)."""
    import subprocess

    threads = str(spec["threads"])
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               FASTRLHF_NO_PROGRESS="1", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                                                    if p))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET"):
        env.pop(key, None)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), SCRIPTS[trainer])
    proc = subprocess.run([sys.executable, script, json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{trainer} child failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def pooled(results: list[dict], warmup: int) -> dict:
    """Medians over the measured steps of several runs of one trainer (warm-up steps of each run dropped)."""
    steps = [s for r in results for s in r["steps"][warmup:]]
    med = summarize(steps, 0)
    # Rates from medians (median tokens per step / median time): a per-step ratio's median is not
    # consistent with the median times when a loaded machine makes some steps much slower.
    med["trained_tokens_per_s"] = med["trained_tokens"] / med["step_s"]
    med["generated_tokens_per_s"] = med["generated_tokens"] / med["generate_s"] if med["generate_s"] else 0.0
    med["step_s_min"] = min(s["step_s"] for s in steps)
    med["step_s_max"] = max(s["step_s"] for s in steps)
    med["peak_rss_bytes"] = statistics.median(r["peak_rss_bytes"] for r in results)
    med["final_reward"] = statistics.median(r["final_reward"] for r in results)
    med["measured_steps"] = len(steps)
    return med


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)
