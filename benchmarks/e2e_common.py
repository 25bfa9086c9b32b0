"""Shared pieces of the end-to-end benchmarks: workloads, model folders, prompts, rewards, result lines.

Both trainers (``e2e_ours.py``, ``e2e_trl.py``) are child scripts that read one JSON spec, build
nothing themselves but read the same model folder and prompt file written here, and print one
``E2E_RESULT {json}`` line. Nothing here imports TRL.

Workloads
- ``A``: the demo task's model (``fastrlhf.demo.script_doubling``: character vocabulary of 43, a
  random-init 0.34M-parameter Llama of the demo's shape), 16 prefixed doubling prompts x 8
  completions, up to 8 new tokens, the exact-match rule reward (read from token ids).
- ``B``: a ~19M-parameter Llama with a 32,000-token vocabulary (random init, untied LM head: 16.4M of
  the parameters are the embedding and the LM head, as in small real models), synthetic prompts of
  64 random tokens, 64 new tokens, reward = fraction of completion tokens with an even id.
- ``C``: a 50.7M-parameter Qwen2 (:data:`QWEN2_151K`: GQA, q/k/v biases, tied embeddings, the real
  vocabulary size 151,936, so 38.9M of the parameters are the embedding), 2 ranks, prompts of 16-256
  random tokens (lengths drawn uniformly), completions up to 256 tokens that end when EOS is sampled,
  reward :func:`length_band_reward` (prefers 32-128 tokens). A random-init model almost never samples
  one token out of 151,936, so :func:`make_model` gives the final hidden states a common direction
  and points the EOS row of the tied embedding along it, scaled so that EOS is sampled at about 1 in
  80 positions (:func:`calibrate_eos`): completion lengths then spread over 1-256 as in real
  rollouts (that spread is the padding packing removes).

The prompt pool holds exactly ``prompts_per_step`` prompts, so every step of both trainers sees the
same prompts (each trainer shuffles their order, which changes nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import statistics
import sys
import tempfile

RESULT_PREFIX = "E2E_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> workload; every trainer-facing knob is here so both trainers read the same numbers.
# gradient_checkpointing: read by both trainers (TRL's GRPOConfig turns it on unless told, fastrlhf's model config
# leaves it off: left to the defaults, TRL's runs of A and B recomputed every layer's forward in the backward).
WORKLOADS = {
    "A": dict(model="doubling", prompts_per_step=16, n=8, max_new_tokens=8, prompt_len=13, lr=1e-3,
              kl_coef=0.001, steps=8, warmup=2, gradient_checkpointing=False),
    "B": dict(model="llama32k", prompts_per_step=4, n=8, max_new_tokens=64, prompt_len=64, lr=1e-4,
              kl_coef=0.001, steps=4, warmup=1, gradient_checkpointing=False),
    # prompt_len: the longest prompt (lengths drawn from prompt_len_min..prompt_len); nproc: ranks.
    "C": dict(model="qwen2_151k", prompts_per_step=4, n=4, max_new_tokens=256, prompt_len=256, prompt_len_min=16,
              lr=1e-5, kl_coef=0.001, steps=2, warmup=1, nproc=2, gradient_checkpointing=True),
}
# Llama of workload B: 32,000 x 256 embedding + LM head (16.4M) + 4 layers (2.6M) = 19.0M parameters.
LLAMA32K = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # workload B's special tokens
# Qwen2 of workload C: 151,936 x 256 tied embedding (38.9M) + 12 layers of 0.98M = 50.7M parameters;
# 4 query heads and 2 key/value heads of size 64 (a head size vLLM's CPU backend runs).
QWEN2_151K = dict(vocab_size=151936, hidden_size=256, intermediate_size=1024, num_hidden_layers=12,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
# As in Qwen2-Instruct: <|endoftext|> pads, <|im_end|> ends a completion; ids below 151,643 are ordinary
# tokens ("t<id>"), the rest up to 151,935 unused extra special tokens (as Qwen2 pads its vocabulary).
QWEN_PAD_ID, QWEN_EOS_ID, QWEN_ORDINARY = 151643, 151645, 151643
EOS_RATE = 1 / 80  # workload C: mean probability of sampling EOS at a position (calibrate_eos)


# --------------------------------------------------------------------------------------------- rewards
def doubling_reward(prompt_ids, completion_ids, meta=None) -> float:
    """Workload A (fastrlhf signature): the demo task's exact-match reward."""
    from fastrlhf.demo.script_doubling import reward

    return reward(prompt_ids, completion_ids, meta)


def even_fraction_reward(prompt_ids, completion_ids, meta=None) -> float:
    """Workload B (fastrlhf signature): fraction of completion tokens with an even id."""
    return sum(1 for t in completion_ids if t % 2 == 0) / len(completion_ids) if len(completion_ids) else 0.0


def length_band_reward(prompt_ids, completion_ids, meta=None) -> float:
    """Workload C (fastrlhf signature): 1 for completions of 32-128 tokens, falling linearly to 0 at
    0 and at 256 tokens (so the update keeps lengths varied rather than pushing them to one end)."""
    n = len(completion_ids)
    if n < 32:
        return n / 32
    return 1.0 if n <= 128 else max(0.0, (256 - n) / 128)


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


def _qwen_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(QWEN_ORDINARY)}
    vocab.update({"<|endoftext|>": QWEN_PAD_ID, "<|im_start|>": QWEN_PAD_ID + 1, "<|im_end|>": QWEN_EOS_ID})
    vocab.update({f"<|extra_{i}|>": i for i in range(QWEN_EOS_ID + 1, QWEN2_151K["vocab_size"])})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def calibrate_eos(lm, eos_id: int, rate: float = EOS_RATE, seed: int = 0) -> float:
    """Make a random-init Qwen2 ``lm`` sample EOS at about ``rate`` of the positions; returns the scale.

    A random-init model's final hidden states share no direction across sequences (each leans to its
    own first tokens), so a constant one is added: the last layer's value bias is redrawn with std 0.5,
    and since attention weights sum to 1, ``o_proj`` of it, ``r``, is added at every position (the final
    hidden states then have cosine about 0.43 +- 0.05 to ``r``). The EOS row of the tied embedding is
    set to ``alpha * r / |r|``, ``alpha`` such that EOS's probability averaged over the positions of
    random 256-token sequences is ``rate``: the EOS logit varies by position and by sequence, and so
    do the completion lengths.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    attn = lm.model.layers[-1].self_attn
    kv_heads, head_dim = lm.config.num_key_value_heads, attn.head_dim
    emb = lm.get_input_embeddings().weight
    with torch.no_grad():
        attn.v_proj.bias.copy_(torch.randn(attn.v_proj.bias.shape, generator=g) * 0.5)
        # Query head j reads key/value head j // (heads / kv_heads): the bias as o_proj sees it.
        per_head = attn.v_proj.bias.view(kv_heads, head_dim).repeat_interleave(
            lm.config.num_attention_heads // kv_heads, dim=0)
        r = attn.o_proj.weight @ per_head.reshape(-1)
        u = r / r.norm()
        ids = torch.randint(0, QWEN_ORDINARY, (4, 256), generator=g)
        h = lm.model(input_ids=ids).last_hidden_state.reshape(-1, emb.shape[1])
        logits = h @ emb.T
        others = torch.cat([logits[:, :eos_id], logits[:, eos_id + 1:]], dim=1).logsumexp(-1)
        proj = h @ u

        def mean_rate(alpha: float) -> float:
            return float(torch.sigmoid(alpha * proj - others).mean())

        lo, hi = 0.0, 10.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_rate(mid) < rate else (lo, mid)
        alpha = (lo + hi) / 2
        emb[eos_id] = alpha * u
    return alpha


def prompt_text(model: str, ids: list[int]) -> str:
    """The text whose tokenization (no special tokens added) gives exactly ``ids``."""
    if model == "doubling":
        from fastrlhf.demo.script_doubling import decode

        return decode(ids)
    return " ".join(f"t{i}" for i in ids)


def make_model(model: str, out_dir: str, seed: int = 0) -> int:
    """Write a random-init Llama + tokenizer (a standard HF folder); returns its parameter count."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if model == "qwen2_151k":
        from fastrlhf.modeling.tiny import count_parameters, make_tiny_qwen2

        kw = {k: v for k, v in QWEN2_151K.items() if k not in ("num_hidden_layers", "num_attention_heads",
                                                               "num_key_value_heads")}
        lm = make_tiny_qwen2(seed=seed, num_layers=QWEN2_151K["num_hidden_layers"],
                             num_heads=QWEN2_151K["num_attention_heads"],
                             num_kv_heads=QWEN2_151K["num_key_value_heads"], **kw)
        lm.config.bos_token_id, lm.config.eos_token_id, lm.config.pad_token_id = None, QWEN_EOS_ID, QWEN_PAD_ID
        calibrate_eos(lm, QWEN_EOS_ID)
        lm.generation_config = GenerationConfig(eos_token_id=QWEN_EOS_ID, pad_token_id=QWEN_PAD_ID)
        lm.save_pretrained(out_dir, safe_serialization=True)
        _qwen_tokenizer().save_pretrained(out_dir)
        return count_parameters(lm)
    if model == "doubling":
        from fastrlhf.demo import script_doubling as task

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


def make_prompts(model: str, count: int, prompt_len: int, seed: int = 0, prompt_len_min: int | None = None
                 ) -> list[list[int]]:
    """``count`` prompts of ``prompt_len`` tokens (or of lengths drawn from ``prompt_len_min..prompt_len``)."""
    rng = random.Random(seed)
    if model == "qwen2_151k":
        lengths = [rng.randint(prompt_len_min or prompt_len, prompt_len) for _ in range(count)]
        return [[rng.randrange(0, QWEN_ORDINARY) for _ in range(n)] for n in lengths]
    if model == "doubling":
        from fastrlhf.demo import script_doubling as task

        return [task.encode(task.make_example(rng, prefixed=True).prompt) for _ in range(count)]
    return [[rng.randrange(3, LLAMA32K["vocab_size"]) for _ in range(prompt_len)] for _ in range(count)]


def prepare(work_dir: str, workload: dict) -> dict:
    """Model folder + prompt file for ``workload`` under ``work_dir``; returns the paths (cached)."""
    model_dir = os.path.join(work_dir, f"model-{workload['model']}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        make_model(workload["model"], model_dir)
    prompts = make_prompts(workload["model"], workload["prompts_per_step"], workload["prompt_len"],
                           prompt_len_min=workload.get("prompt_len_min"))
    path = os.path.join(work_dir, f"prompts-{workload['model']}-{len(prompts)}.jsonl")
    with open(path, "w") as f:
        for ids in prompts:
            f.write(json.dumps({"prompt_ids": ids, "prompt": prompt_text(workload["model"], ids)}) + "\n")
    return {"model_dir": model_dir, "prompts": path, "prompt_lens": [len(p) for p in prompts]}


# --------------------------------------------------------------------------------------------- child side
def child_setup(threads: int, nproc: int = 1) -> None:
    """``threads`` torch threads in all: ``threads // nproc`` per rank."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.pop("TRITON_INTERPRET", None)  # the CPU paths of our kernels are torch; TRL uses none
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(max(1, threads // nproc))
    torch.manual_seed(0)


def rank() -> int:
    """This process's rank under the launcher (0 without one)."""
    return int(os.environ.get("RANK", "0"))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summarize(steps: list[dict], warmup: int) -> dict:
    """Medians over the measured (post-warm-up) steps of every numeric per-step key."""
    measured = steps[warmup:]
    keys = sorted({k for s in measured for k, v in s.items() if isinstance(v, (int, float))})
    return {k: statistics.median(s[k] for s in measured if k in s) for k in keys}


def emit(result: dict) -> None:
    """Print the result line. The ranks of a run share one stdout pipe, and a write of more than
    PIPE_BUF (4 KiB) bytes is not atomic: two ranks' result lines could interleave, so the write is
    made under a lock that the ranks of one launcher (same parent) share."""
    import fcntl

    data = (RESULT_PREFIX + json.dumps(result) + "\n").encode()
    sys.stdout.flush()
    lock_path = os.path.join(tempfile.gettempdir(), f"fastrlhf-e2e-emit-{os.getppid()}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        view = memoryview(data)
        while view:
            view = view[os.write(sys.stdout.fileno(), view):]


def read_spec() -> dict:
    return json.loads(sys.argv[1])


# --------------------------------------------------------------------------------------------- parent side
SCRIPTS = {"fastrlhf": "e2e_ours.py", "trl": "e2e_trl.py"}
SPLIT_KEYS = ("generate_s", "reward_s", "old_logprob_s", "reference_s", "score_s", "train_s", "sync_s")


def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def run_in_own_group(cmd: list[str], env: dict, timeout_s: float, what: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``cmd`` run from the repository root in a process group of its own,
    killed whole on timeout (then a RuntimeError naming ``what``): a hung child never outlives its benchmark."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise RuntimeError(f"{what} timed out after {timeout_s} s:\n{stderr[-6000:]}") from None
    finally:
        for parent in (proc.pid, os.getpid()):  # emit()'s lock: the launcher's (several ranks) or ours
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tempfile.gettempdir(), f"fastrlhf-e2e-emit-{parent}.lock"))
    return proc.returncode, stdout, stderr


def run_child(trainer: str, spec: dict, timeout_s: float = 1200.0) -> dict:
    """Run one trainer's child script on ``spec``; returns its E2E_RESULT (raises with its stderr on failure).

    ``spec["nproc"]`` > 1: the script runs on that many ranks under ``torch.distributed.run`` (the same
    launcher for both trainers), ``threads // nproc`` torch threads each, and the ranks' results are
    merged (:func:`merge_ranks`). The launcher and its ranks form one process group, killed on timeout.
    """
    nproc = int(spec.get("nproc", 1))
    from fastrlhf.demo.stages import child_env

    env = child_env(max(1, spec["threads"] // nproc))
    env.pop("TRITON_INTERPRET", None)  # a test session's interpreter mode must not reach the measured children
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), SCRIPTS[trainer])
    cmd = [sys.executable, script, json.dumps(spec)]
    if nproc > 1:
        from fastrlhf.distributed import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port())] + cmd[1:]
    returncode, stdout, stderr = run_in_own_group(cmd, env, timeout_s, f"{trainer} child")
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if returncode != 0 or len(lines) < nproc:
        raise RuntimeError(f"{trainer} child failed (exit {returncode}, {len(lines)} of {nproc} results):\n"
                           f"{stderr[-6000:]}")
    return merge_ranks([json.loads(line[len(RESULT_PREFIX):]) for line in lines])


def merge_ranks(results: list[dict]) -> dict:
    """One result from every rank's: rank 0's, with ``peak_rss_bytes`` the SUM of the ranks' peaks (what
    the job holds; ``rank_peak_rss_bytes`` lists them). Steps: rank 0's when they are already global
    (fastrlhf logs rank-reduced metrics), else (``steps_local``: TRL counts each rank's own
    completions) each step's tokens summed over the ranks and its times the slowest rank's."""
    results = sorted(results, key=lambda r: r.get("rank", 0))
    if len(results) == 1:
        return results[0]
    merged = dict(results[0])
    merged["rank_peak_rss_bytes"] = [r["peak_rss_bytes"] for r in results]
    merged["peak_rss_bytes"] = sum(merged["rank_peak_rss_bytes"])
    merged["nproc"] = len(results)
    if merged.get("steps_local"):
        steps = []
        for per_rank in zip(*(r["steps"] for r in results), strict=True):
            step = {k: max(s[k] for s in per_rank) for k, v in per_rank[0].items() if isinstance(v, (int, float))}
            for key in ("generated_tokens", "trained_tokens", "completions"):
                step[key] = sum(s.get(key, 0) for s in per_rank)
            step["reward"] = sum(s["reward"] * s["completions"] for s in per_rank) / max(1, step["completions"])
            step["trained_tokens_per_s"] = step["trained_tokens"] / step["step_s"]
            step["generated_tokens_per_s"] = step["generated_tokens"] / step["generate_s"] if step["generate_s"] else 0
            steps.append(step)
        merged["steps"] = steps
        merged["final_reward"] = steps[-1]["reward"] if steps else None
    return merged


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
