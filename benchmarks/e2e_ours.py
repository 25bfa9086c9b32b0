"""Child script: fastrlhf's GRPO trainer (``fastrlhf.rl.trainer.run``) on one workload; prints E2E_RESULT.

``python benchmarks/e2e_ours.py '<json spec>'`` (see ``test_bench_e2e.py``). Workloads A and B:
single rank, ZeRO stage 0 (one rank has nothing to partition). Workload C: ``nproc`` ranks under
``torch.distributed.run`` at the default ZeRO stage (2), ``trainer.packing`` and
``trainer.max_tokens_per_microbatch`` from the spec (``trainer`` keys), the vLLM KV cache sized by
the plan (``kv_cache_bytes: auto``). All: fp32, fused loss, ``rollout.engine`` from the spec
(``auto`` by default: it picks what a user gets). One optimizer step per RL step (minibatch = the
whole rollout batch), constant learning rate, k3 KL in the loss, token-mean aggregation, gradient
checkpointing as the workload says (``gradient_checkpointing``, the same key TRL's run reads).

Timing: ``metrics.jsonl``'s ``time/*`` keys per step; the actor's old-logprob and the reference's
logprob passes are split out of ``time/score`` by timing ``sequence_logprobs`` (the old-logprob
pass is skipped here: one optimizer step per RL step is on-policy, ``trainer.old_logprobs: auto``).
Checkpointing and the final HF export are switched off: they are not part of a step and TRL's run
does neither. Under several ranks the metrics are rank-reduced (token counts summed over the ranks,
times the slowest rank's); rank 0 reports them, the other ranks only their peak RSS.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.e2e_common import child_setup, emit, peak_rss_bytes, rank, read_spec, summarize  # noqa: E402

REWARDS = {"doubling": "benchmarks.e2e_common:doubling_reward",
           "llama32k": "benchmarks.e2e_common:even_fraction_reward",
           "qwen2_151k": "benchmarks.e2e_common:length_band_reward"}


def main(spec: dict) -> dict:
    child_setup(spec["threads"], spec.get("nproc", 1))
    import fastrlhf.engine.loop
    import fastrlhf.modeling
    import fastrlhf.rl.step as step_module
    from fastrlhf.config import parse_config
    from fastrlhf.rl import rollout_setup, trainer

    fastrlhf.engine.loop.save_checkpoint = lambda *a, **k: None
    fastrlhf.modeling.export_hf = lambda *a, **k: None

    # Per step: seconds in the actor's old-logprob pass (0 when the on-policy step skips it) and in
    # the reference's, told apart by the model each ``sequence_logprobs`` call is given.
    logprob_times: list[dict] = []
    original = step_module.sequence_logprobs
    original_prepare = step_module.RLStep.logprobs_and_values
    current: dict = {}

    def timed_sequence_logprobs(model, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(model, *args, **kwargs)
        current["times"]["ref" if model is current["reference"] else "old"] += time.perf_counter() - t0
        return out

    def timed_prepare(self, exp):
        current.update(reference=self.reference, times={"old": 0.0, "ref": 0.0})
        out = original_prepare(self, exp)
        logprob_times.append(current["times"])
        return out

    step_module.sequence_logprobs = timed_sequence_logprobs
    step_module.RLStep.logprobs_and_values = timed_prepare

    engine_kind = {}
    original_build = rollout_setup.build_rollout

    def build_rollout(config, module, num_params, device, *args, **kwargs):
        engine, shares = original_build(config, module, num_params, device, *args, **kwargs)
        engine_kind["kind"] = type(engine).__name__
        engine_kind["num_params"] = num_params
        return engine, shares

    rollout_setup.build_rollout = build_rollout

    batch = spec["prompts_per_step"] * spec["n"]
    reward = REWARDS[spec["model"]]
    total_steps = spec["warmup"] + spec["steps"]
    raw = {
        "algorithm": "grpo", "output_dir": spec["out_dir"], "seed": 0,
        "model": {"path": spec["model_dir"], "dtype": "float32",
                  "gradient_checkpointing": spec.get("gradient_checkpointing", False), **spec.get("model_options", {})},
        "reward": {"function": reward},
        "data": {"prompts": spec["prompts"], "max_prompt_len": max(spec["prompt_len"], 16)},
        "rollout": {"engine": spec.get("engine", "auto"), "n": spec["n"], "temperature": 1.0,
                    "max_new_tokens": spec["max_new_tokens"],
                    "kv_cache_bytes": spec.get("kv_cache_bytes", 256 << 20)},
        "trainer": {"max_steps": total_steps, "prompts_per_step": spec["prompts_per_step"], "minibatch_size": batch,
                    "lr": spec["lr"], "warmup_steps": 0, "kl_coef": spec["kl_coef"], "kl_kind": "k3",
                    "agg": "token-mean", "max_grad_norm": 1.0, "fused_loss": True, "log_every": 1,
                    **spec.get("trainer", {})},
        "deepspeed": {"zero_stage": spec.get("zero_stage", 0), **spec.get("deepspeed", {})},
    }
    config = parse_config(raw, "train")
    t0 = time.perf_counter()
    trainer.run(config)
    run_s = time.perf_counter() - t0
    peak = peak_rss_bytes()
    if rank() != 0:
        return {"trainer": "fastrlhf", "rank": rank(), "peak_rss_bytes": peak}

    with open(os.path.join(spec["out_dir"], "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "time/generate" in r]
    steps = []
    for i, r in enumerate(rows):
        old_s, ref_s = (logprob_times[i]["old"], logprob_times[i]["ref"]) if i < len(logprob_times) else (0, 0)
        tokens = r["generated_tokens"]
        wall = r.get("wall_time", r["step_time"])
        steps.append({
            "step_s": wall,
            "generate_s": r["time/generate"],
            "reward_s": r["time/reward"],
            "old_logprob_s": old_s,
            "reference_s": ref_s,
            "score_s": r["time/score"] - old_s - ref_s,  # rewards + advantages (+ the experience batch)
            "train_s": r["time/train"],
            "sync_s": r["time/sync"],
            "generated_tokens": tokens,
            "trained_tokens": tokens,  # GRPO trains on every completion token
            "generated_tokens_per_s": tokens / r["time/generate"] if r["time/generate"] else 0.0,
            "trained_tokens_per_s": tokens / wall,
            "reward": r["reward_mean"],
            # Step 1 of the padded and the packed run must agree on these (test_bench_e2e.py).
            "policy_loss": r.get("policy_loss", 0.0),
            "grad_norm": r.get("grad_norm", 0.0),
            "entropy": r.get("entropy", 0.0),
            "mean_completion_len": r.get("mean_response_length", 0.0),
            "truncated_fraction": r.get("truncated_fraction", 0.0),
            # Real tokens of a rank's batch, mean and largest over the ranks (trainer.balance_ranks).
            "rank_tokens_mean": r.get("rank_tokens", 0.0),
            "rank_tokens_max": r.get("rank_tokens_max", 0.0),
        })
    return {
        "trainer": "fastrlhf", "engine": engine_kind.get("kind"), "num_params": engine_kind.get("num_params"),
        "steps": steps, "median": summarize(steps, spec["warmup"]), "final_reward": steps[-1]["reward"],
        "peak_rss_bytes": peak, "run_s": run_s, "threads": spec["threads"], "rank": 0,
        "config": {k: raw[k] for k in ("rollout", "trainer", "deepspeed")},
        "gradient_checkpointing": raw["model"]["gradient_checkpointing"],
    }


if __name__ == "__main__":
    emit(main(read_spec()))
