"""Run under ``deepspeed --num_gpus 2``: a few PPO and GRPO steps at ZeRO-2 and ZeRO-3 in one launch.

argv: <model dir> <prompts.jsonl> <out dir> <case>... where a case is ``algo:zero_stage:engine``,
or ``algo:zero_stage:engine:lora`` for a LoRA actor. Each rank writes ``<out>/<case>-rank<r>.json``:
the per-step metrics, whether every parameter of its rollout engine equals the (gathered) actor
parameter after the final sync (for LoRA: the actor with its adapter merged by peft), and a
checksum of the actor's weights (all ranks must agree).
"""

import json
import math
import os
import sys

import torch


def gathered_actor_state(engine, zero3):
    import deepspeed

    params = list(engine.module.named_parameters())
    if zero3:
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


def peft_merged_state(engine, actor_state):
    """The actor's weights with its LoRA adapter merged by peft itself (not by our sync's merge)."""
    from peft import get_peft_model

    from fastrlhf.modeling import base_model, unwrap

    peft_actor = unwrap(engine)
    base = base_model(peft_actor)
    fresh = get_peft_model(type(base)(base.config), peft_actor.peft_config["default"])
    fresh.load_state_dict(actor_state, strict=True)
    return {n: p.detach() for n, p in fresh.merge_and_unload().named_parameters()}


def nan_guard_steps(rl_step, stateful, examples, sampler, zero3, before):
    """Step 3: NaN reward on rank 1 only; step 4: NaN loss on rank 1 only. Both ranks must skip both
    updates and keep their weights (the guard's decision is collective)."""
    import fastrlhf.rl.step as step_module
    from fastrlhf import distributed as D
    from fastrlhf.data import shard

    def batch():
        local = shard(sampler.next_indices(4), D.rank(), D.world_size())
        return [examples[i].prompt_ids for i in local], [examples[i].meta for i in local]

    scorer = rl_step.scorer

    def nan_on_rank1(exp, *args):
        scores = scorer(exp, *args)
        if D.rank() == 1:
            scores[0] = float("nan")
        return scores

    rl_step.scorer = nan_on_rank1
    reward_metrics = rl_step(*batch(), 3)
    rl_step.scorer = scorer
    after_reward = gathered_actor_state(stateful["actor"], zero3)

    real = step_module.policy_loss_from_model

    def nan_loss_on_rank1(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan") if D.rank() == 1 else loss), metrics

    step_module.policy_loss_from_model = nan_loss_on_rank1
    loss_metrics = rl_step(*batch(), 4)
    step_module.policy_loss_from_model = real
    after_loss = gathered_actor_state(stateful["actor"], zero3)
    return {
        "nan_reward_skipped": reward_metrics["skipped"], "nan_loss_skipped": loss_metrics["skipped"],
        "skipped_steps": loss_metrics["skipped_steps"],
        "unchanged_after_nan_reward": all(torch.equal(after_reward[n], t) for n, t in before.items()),
        "unchanged_after_nan_loss": all(torch.equal(after_loss[n], t) for n, t in before.items()),
    }


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    model_dir, prompts, out_dir, *cases = args
    from fastrlhf import distributed as D
    from fastrlhf.config import parse_config
    from fastrlhf.data import EpochSampler, load_prompts, shard
    from fastrlhf.distributed import comm
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.rl.trainer import build_rl_step

    D.init_distributed()
    examples = load_prompts(prompts)
    for case in cases:
        algo, stage, engine_kind, *variant = case.split(":")
        lora = variant == ["lora"]
        raw = {
            "algorithm": algo, "output_dir": os.path.join(out_dir, case.replace(":", "-")), "seed": 1,
            "model": {"path": model_dir, **({"lora_r": 4, "lora_alpha": 8} if lora else {})},
            "reward": {"function": "target_token"},
            "data": {"prompts": prompts, "max_prompt_len": 16},
            "rollout": {"engine": engine_kind, "n": 2, "max_new_tokens": 6, "kv_cache_bytes": 64 << 20},
            "trainer": {"max_steps": 2, "prompts_per_step": 4, "minibatch_size": 4, "grad_accum": 2, "lr": 1e-3,
                        "kl_coef": 0.05, "kl_in_reward": algo == "ppo", "tis_cap": 2.0},
            "deepspeed": {"zero_stage": int(stage), "extra": {"zero_optimization": {
                "stage3_param_persistence_threshold": 0}} if stage == "3" else {}},
        }
        if algo == "ppo":
            raw["critic"] = {"lr": 1e-3}
        config = parse_config(raw)
        guard = StepGuard(3)
        rl_step, stateful = build_rl_step(config, guard)
        sampler = EpochSampler(len(examples), seed=1)
        history = []
        for step in range(1, 3):
            local = shard(sampler.next_indices(4), D.rank(), D.world_size())
            batch = [examples[i] for i in local]
            history.append(rl_step([e.prompt_ids for e in batch], [e.meta for e in batch], step))
        actor = gathered_actor_state(stateful["actor"], int(stage) == 3)
        guard_checks = {}
        if algo == "grpo" and engine_kind == "hf" and not lora:
            guard_checks = nan_guard_steps(rl_step, stateful, examples, sampler, int(stage) == 3, actor)
        engine_model = getattr(rl_step.rollout, "model", None)
        if engine_model is not None and lora:  # the engine must hold W + scaling * B @ A, as peft merges it
            engine_state = {n: p.detach() for n, p in engine_model.named_parameters()}
            want = peft_merged_state(stateful["actor"], actor)
            synced = set(engine_state) == set(want) and all(
                torch.allclose(engine_state[n], t, rtol=0, atol=1e-6) for n, t in want.items())
        elif engine_model is not None:  # HF engine: compare its weights with the actor's
            engine_state = dict(engine_model.named_parameters())
            synced = all(torch.equal(engine_state[n].detach(), t) for n, t in actor.items())
        else:  # vLLM: generate greedily with the engine and with the gathered actor weights, compare tokens
            from fastrlhf.modeling import load_causal_lm
            from fastrlhf.rollout import HFEngine, SamplingConfig

            plain = load_causal_lm(config.model, trainable=False)
            plain.load_state_dict(actor, strict=False)
            greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True)
            prompts_ = [examples[0].prompt_ids, examples[1].prompt_ids]
            a = [c[0].token_ids for c in rl_step.rollout.generate(prompts_, greedy)]
            b = [c[0].token_ids for c in HFEngine(plain).generate(prompts_, greedy)]
            synced = a == b
        result = {
            "metrics": history,
            "synced": synced,
            "checksum": float(sum(t.double().sum() for t in actor.values())),
            "guard": guard_checks,
            "finite": all(math.isfinite(v) for m in history for v in m.values() if isinstance(v, float)),
        }
        rl_step.rollout.close()
        with open(os.path.join(out_dir, f"{case.replace(':', '-')}-rank{D.rank()}.json"), "w") as f:
            json.dump(result, f)
        comm.barrier()


if __name__ == "__main__":
    main()
    from fastrlhf.cli import exit_with

    exit_with(0)  # as a launched fastrlhf rank leaves: without the c10d stores' exit-time abort
