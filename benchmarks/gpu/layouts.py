"""Race 4 of ``make bench-gpu``: one GRPO step's reference pass and update in the three layouts of a micro-batch,
padded, packed (``trainer.packing``) and packed with shared prompts (``trainer.share_prompts``), on workload C's
shape scaled to the 1.5B model: prompts of 114-243 tokens x 8 samples, completions of up to 1,024 tokens whose
lengths follow a sampled EOS (drawn once, the same in every layout). Packed rows run the backend
``model.attention: auto`` picks on the machine (``fastrlhf.sequences.attention``: flash-attn's varlen kernel where it is
installed, else FlexAttention; shared prompts always FlexAttention).

Each layout runs ``RLStep`` on the same fixed completions (no generation): a warm-up step (compiles), then the
median of the measured ones of ``time/score`` (reward + reference logprobs; the step is on-policy, so no
old-logprob pass) plus ``time/train`` (the update), each also on its own, and the most memory allocated in each.
Targets: packed >= 1.5x padded, shared >= 2x padded.

At the GRPO races' shape (:data:`GRPO_RACE_SHAPE`: 8 prompts of 128 tokens x 8 completions of 256, none ending
early, as a random-init model's), the same comparison runs in one process with no rollout engine beside it: on an
H100 the shared layout's train stage was slower than the padded one's inside the vLLM race (1.62 s for 29% fewer
tokens than the padded run's 0.99 s, another machine), and this says whether the layout itself is (its packed rows'
FlexAttention at that shape) or the run around it; ``shared_sdpa`` runs the shared layout on per-segment sdpa calls
instead, so that the same call says whether FlexAttention is the cause.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.gpu.rl_update import actor_engine
from benchmarks.gpu.workload import model_shape

LAYOUTS = {"padded": dict(packing=False), "packed": dict(packing=True), "shared": dict(packing=True,
                                                                                     share_prompts=True),
           # The shared layout on per-segment sdpa calls instead of the machine's choice (FlexAttention on a GPU):
           # whether FlexAttention is what makes the layout slow at the GRPO races' shape.
           "shared_sdpa": dict(packing=True, share_prompts=True, attention="sdpa")}
TARGETS = dict(packed_vs_padded_min=1.5, shared_vs_padded_min=2.0)
# The GRPO races' batch (benchmarks.gpu.grpo: 8 x 8 of 128 + 256 tokens, micro-batches of 16 sequences).
# A diagnosis, not a target: its completions are all of one length, so that packing saves nothing there.
GRPO_RACE_SHAPE = dict(prompts=8, n=8, prompt_range=(128, 128), max_new=256, max_tokens=6144, eos_every=10**9,
                       targets=False, layouts=("padded", "packed", "shared", "shared_sdpa"))


def completions_of(prompts: int, n: int, prompt_range: tuple[int, int], max_new: int, vocab: int, seed: int,
                   eos_every: int = 350):
    """Prompts and ``n`` completions each, lengths as an EOS sampled with probability 1/``eos_every`` per token
    gives (at most ``max_new``)."""
    from fastrlhf.rollout import Completion

    g = torch.Generator().manual_seed(seed)
    lo, hi = prompt_range
    prompt_ids = [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(prompts)]
    lengths = torch.distributions.Geometric(torch.tensor(1 / eos_every)).sample((prompts, n)).long() + 1
    completions = [[Completion(torch.randint(3, vocab, (min(int(length), max_new),), generator=g).tolist(),
                               [0.0] * min(int(length), max_new), "stop") for length in row] for row in lengths]
    return prompt_ids, completions


def race(device: str = "cuda", shape: str = "qwen2-1.5b", dtype: str = "bfloat16", prompts: int = 8, n: int = 8,
         prompt_range: tuple[int, int] = (114, 243), max_new: int = 1024, max_tokens: int = 16384, steps: int = 3,
         seed: int = 0, eos_every: int = 350, targets: bool = True,
         layouts: tuple[str, ...] = ("padded", "packed", "shared")) -> dict:
    from fastrlhf import distributed as D
    from fastrlhf.config import (
        DataConfig,
        ModelConfig,
        RewardConfig,
        RolloutConfig,
        TrainConfig,
        TrainerConfig,
    )
    from fastrlhf.modeling import use_attention
    from fastrlhf.rl.rewards import RewardScorer
    from fastrlhf.rl.step import RLStep
    from fastrlhf.sequences.attention import choose

    D.init_distributed(timeout_s=120)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    torch_dtype, model = getattr(torch, dtype), model_shape(shape)
    torch.manual_seed(seed)
    prompt_ids, completions = completions_of(prompts, n, tuple(prompt_range), max_new, model["vocab_size"], seed,
                                             eos_every)
    backend = choose("auto", device == "cuda", dtype, share_prompts=False)
    shared_backend = choose("auto", device == "cuda", dtype, share_prompts=True)
    engine, reference, guard = actor_engine(dev, torch_dtype, model, seed, 1e-7, 1, 1)
    actor = engine.module
    out: dict = dict(shape=shape, sequences=prompts * n, backend=backend, shared_backend=shared_backend,
                     real_tokens=sum(len(p) * n + sum(len(c.token_ids) for c in row)
                                     for p, row in zip(prompt_ids, completions, strict=True)))
    for name in layouts:
        layout = dict(LAYOUTS[name])
        attention = layout.pop("attention", shared_backend if layout.get("share_prompts") else backend)
        for m in (actor, reference):  # the attention a run of this layout sets up (padded: plain sdpa)
            use_attention(m, layout["packing"], layout.get("share_prompts", False), attention)
        trainer = TrainerConfig(max_steps=steps, prompts_per_step=prompts, minibatch_size=prompts * n, ppo_epochs=1,
                                lr=1e-7, kl_coef=0.04, max_tokens_per_microbatch=max_tokens, **layout)
        config = TrainConfig(output_dir="unused", model=ModelConfig(path="unused", gradient_checkpointing=True),
                             data=DataConfig(prompts="unused"), trainer=trainer, algorithm="grpo", seed=seed,
                             rollout=RolloutConfig(n=n, max_new_tokens=max_new, max_logprob_mismatch=None),
                             reward=RewardConfig(function="length"))
        step = RLStep(config, engine, None, RewardScorer("length"), reference=reference, pad_token_id=0,
                      rollout_shares_actor=True, device=engine.device, guard=guard)
        runs = [step(prompt_ids, None, step=i + 1, completions=completions) for i in range(steps)]
        measured = runs[1:] if len(runs) > 1 else runs
        out[f"{name}_s"] = round(statistics.median(m["time/score"] + m["time/train"] for m in measured), 4)
        for key in ("score", "train"):
            out[f"{name}_{key}_s"] = round(statistics.median(m[f"time/{key}"] for m in measured), 4)
            if f"memory/{key}_gib" in runs[-1]:  # CUDA only
                out[f"{name}_{key}_peak_gib"] = round(max(m[f"memory/{key}_gib"] for m in runs), 2)
                for churn in ("alloc_retries", "cuda_mallocs"):  # the allocator's, over the measured steps
                    out[f"{name}_{key}_{churn}"] = int(sum(m.get(f"memory/{key}_{churn}", 0) for m in measured))
        out[f"{name}_skipped"] = sum(m["skipped"] for m in runs)
        del step
    for name in layouts[1:]:
        out[f"{name}_vs_{layouts[0]}"] = round(out[f"{layouts[0]}_s"] / out[f"{name}_s"], 3)
    if targets:
        out["targets_met"] = bool(out["packed_vs_padded"] >= TARGETS["packed_vs_padded_min"]
                                  and out["shared_vs_padded"] >= TARGETS["shared_vs_padded_min"])
    return out
