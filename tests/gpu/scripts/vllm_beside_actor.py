"""Started by tests/gpu/test_commands.py (``test_vllm_beside_the_actor``) under the DeepSpeed launcher, one rank.

The RL step that ``fastrlhf train`` builds (``build_rl_step``: a ZeRO-2 actor, vLLM in the same process as
``rollout.engine: vllm`` makes it, sleep mode on CUDA), driven stage by stage so that each claim is measured:

1. generation with logprobs, and the mismatch between the engine's logprobs and the actor's (mean |diff| per
   completion token); then, with ``rollout.repetition_penalty`` and ``rollout.min_p``, the engine's (processed)
   logprobs against transformers' processors applied in vLLM's order on the actor's logits
   (tests/helpers/processed_logprobs.py), and against the plain distribution;
2. sleep: the device memory it frees (CUDA: free memory before and after; CPU: the resident set), and on CUDA
   what the engine's weights and KV cache hold, which it should free;
3. an update while the engine sleeps (one optimizer step, large enough that the greedy outputs change), then the
   engine's earlier logprobs against the updated actor (``mismatch_stale``: what a failed sync would show);
4. the bucketed weight sync (ms, of which the wake of the weights; bytes, buckets), the wake-up (free memory
   back to where it was), then greedy outputs against HF's ``generate`` on the actor's new weights, and each
   engine token against the actor's own top logit (``greedy_worst_gap``: 0 where the engine chose the actor's
   argmax), and the mismatch again.

Writes a JSON report to argv[2]; argv[1] is the run's config (YAML, ``fastrlhf train``'s schema).
"""

import json
import os
import sys
import time

GIB = float(1 << 30)


def used_bytes(device) -> float:
    """Device memory in use: CUDA's used memory (every process; the caching allocator emptied first), or this
    process's resident set on a CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return float(total - free)
    with open("/proc/self/statm") as f:
        return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mismatch(module, prompts, completions, pad_id, device) -> float:
    """Mean |actor logprob - engine logprob| over the completions' tokens (the actor's, without gradients)."""
    from fastrlhf.algorithms import masked_mean
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.forward import sequence_logprobs

    exp = build_experience(prompts, completions, pad_id, device)
    actor, _ = sequence_logprobs(module, exp)
    mask = exp.response_mask
    return float(masked_mean(torch_abs(actor - exp.engine_logprobs, mask), mask))


def torch_abs(diff, mask):
    import torch

    return torch.where(mask > 0, diff.abs(), 0.0)


def greedy_gaps(module, prompts, outputs, device) -> list[float]:
    """Per sequence, the largest (actor's top logprob - logprob of the engine's token) over its tokens: 0 when
    every greedy token is the actor's argmax, small at a near-tie, large when the engine holds other weights."""
    import torch

    gaps = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt + tokens], device=device)
            logp = module(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            chosen = logp.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0]
            gaps.append(float((logp.max(-1).values - chosen).max()))
    return gaps


def main(config_path: str, out_path: str) -> None:
    started = time.perf_counter()
    import torch

    from fastrlhf import distributed as D
    from fastrlhf.config import load_config
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.rl.step import empty_device_cache
    from fastrlhf.rl.trainer import build_rl_step, preflight
    from fastrlhf.rollout import HFEngine, SamplingConfig, vllm_adapter
    from fastrlhf.supervised import seed_everything

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/helpers
    from helpers.processed_logprobs import logprob_gaps

    config = load_config(config_path, "train")
    prepared = preflight(config)
    D.init_distributed(timeout_s=120)
    seed_everything(config.seed)
    step, _ = build_rl_step(config, StepGuard(), prepared.tokenizer, prepared.text_rewards, plan=prepared.plan)
    engine, actor, device = step.rollout, step.actor.engine, step.device
    module = actor.module
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "engine": engine.kind, "sleep_mode": engine.sleep_mode, "startup_s": round(engine.startup_seconds, 2),
              "params": sum(p.numel() for p in module.parameters())}
    if engine.sync_at_start:  # as fastrlhf.rl.trainer.run: a CPU engine's GEMMs onto weights sleep() can release
        step.sync()
    prompts = [e.prompt_ids for e in prepared.examples[: config.trainer.prompts_per_step]]
    sampled = SamplingConfig(n=config.rollout.n, temperature=1.0, max_new_tokens=config.rollout.max_new_tokens,
                             seed=1)
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=config.rollout.max_new_tokens, ignore_eos=True)

    # 1. Generation with logprobs, against the actor.
    t0 = time.perf_counter()
    completions = engine.generate(prompts, sampled)
    report["generate_s"] = round(time.perf_counter() - t0, 3)
    report["generated_tokens"] = sum(len(c.token_ids) for samples in completions for c in samples)
    report["mismatch_before"] = mismatch(module, prompts, completions, step.pad_token_id, device)
    greedy_before = [c[0].token_ids for c in engine.generate(prompts, greedy)]
    penalised = SamplingConfig(n=2, temperature=0.8, min_p=0.05, repetition_penalty=1.3, seed=3, ignore_eos=True,
                               max_new_tokens=min(16, config.rollout.max_new_tokens))
    few = prompts[:2]
    results = engine.generate(few, penalised)
    gaps = logprob_gaps(module, few, results, penalised)
    plain = SamplingConfig(n=2, temperature=0.8, max_new_tokens=penalised.max_new_tokens)
    report["processed_gap_mean"], report["processed_gap_max"] = float(gaps.mean()), float(gaps.max())
    report["processed_plain_gap_mean"] = float(logprob_gaps(module, few, results, plain).mean())

    # 2. Sleep: what it frees. Measured around the second sleep, once the optimizer's states exist (the first
    # update allocates them) and the engine has run.
    def one_update(lr_scale: float) -> float:
        rows = [p + samples[0].token_ids for p, samples in zip(prompts, completions, strict=True)]
        ids = torch.tensor([r[: min(map(len, rows))] for r in rows], device=device)  # one width, no padding
        for group in actor.optimizer.param_groups:
            group["lr"] = config.trainer.lr * lr_scale
        loss = actor(input_ids=ids, labels=ids).loss
        actor.backward(loss)
        actor.step()
        return float(loss)

    engine.sleep()
    one_update(0.0)  # lr 0: the optimizer's states come into being, no weight moves
    step.sync()
    engine.generate(prompts[:1], greedy)  # awake: weights and KV cache in place
    awake = used_bytes(device)
    engine.sleep()
    asleep = used_bytes(device)
    report["sleep_freed_gib"] = (awake - asleep) / GIB
    dtype_bytes = torch.finfo(engine.weight_dtype).bits // 8
    report["engine_weights_gib"] = report["params"] * dtype_bytes / GIB
    report["kv_cache_gib"] = kv_cache_bytes(engine, dtype_bytes) / GIB

    # 3. The update while the engine sleeps; the engine's earlier logprobs against the updated actor.
    report["update_loss"] = one_update(1.0)
    report["mismatch_stale"] = mismatch(module, prompts, completions, step.pad_token_id, device)

    # 4. Sync (bucketed), wake, then greedy against HF on the new weights and the mismatch again.
    t0 = time.perf_counter()
    empty_device_cache(device)  # what step.sync() does first, timed apart: the rest is the load itself
    engine.wake_up(("weights",))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report["wake_weights_ms"] = (time.perf_counter() - t0) * 1e3
    sync = step.sync()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report["sync_ms"] = (time.perf_counter() - t0) * 1e3
    report["sync_bytes"], report["sync_buckets"] = sync["sync_bytes"], sync["sync_buckets"]
    # On CUDA: the model's own load_weights (True) or vLLM's generic reload_weights.
    report["sync_loads_in_place"] = vllm_adapter.engine_loads_in_place(engine.llm)
    report["sync_gb_per_s"] = sync["sync_bytes"] / 1e9 / (report["sync_ms"] / 1e3)
    greedy_after = [c[0].token_ids for c in engine.generate(prompts, greedy)]  # wakes the KV cache
    report["wake_restored_gib"] = (used_bytes(device) - asleep) / GIB
    hf = [c[0].token_ids for c in HFEngine(module, max_model_len=engine.max_model_len).generate(prompts, greedy)]
    report["greedy_equal_hf"] = sum(a == b for a, b in zip(greedy_after, hf, strict=True)) / len(prompts)
    report["greedy_changed_by_update"] = sum(a != b for a, b in zip(greedy_after, greedy_before, strict=True)) / len(
        prompts)
    report["greedy_worst_gap"] = max(greedy_gaps(module, prompts, greedy_after, device))
    report["greedy_worst_gap_stale"] = max(greedy_gaps(module, prompts, greedy_before, device))
    completions = engine.generate(prompts, sampled)
    report["mismatch_after"] = mismatch(module, prompts, completions, step.pad_token_id, device)
    engine.close()
    report["script_s"] = round(time.perf_counter() - started, 1)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def kv_cache_bytes(engine, dtype_bytes: int) -> float:
    """The KV cache vLLM allocated: its blocks x tokens per block x (K and V of every layer's KV heads); 0 where
    this vLLM does not say how many blocks it made."""
    cache_config = getattr(getattr(engine.llm.llm_engine, "vllm_config", None), "cache_config", None)
    if getattr(cache_config, "num_gpu_blocks", None) is None:
        return 0.0
    with open(os.path.join(engine.model_path, "config.json")) as f:
        cfg = json.load(f)
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head
    return float(cache_config.num_gpu_blocks * cache_config.block_size * per_token * dtype_bytes)


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
