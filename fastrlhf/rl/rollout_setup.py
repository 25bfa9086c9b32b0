"""The run's rollout engine, built beside the actor: which kind (``rollout.engine``, ``auto`` falling back to HF
where vLLM cannot run the model), whether it shares the actor's module, and vLLM's share of the GPU."""

from __future__ import annotations

__all__ = ["FREE_MEMORY_MARGIN", "build_rollout", "gpu_memory_utilization", "vllm_cannot_run"]


def vllm_cannot_run(config) -> str | None:
    """Why vLLM cannot run this model here (read from its config.json, without importing vLLM), or None."""
    import torch

    if torch.cuda.is_available():
        return None
    from fastrlhf.rollout.vllm_engine import check_cpu_head_size, read_model_config

    try:
        check_cpu_head_size(read_model_config(config.model.path), ask_vllm=False)
    except ValueError as exc:
        return str(exc)
    return None


def build_rollout(config, actor_module, num_params: int, device, tokenizer=None, plan=None):
    """(engine, shares_actor): HF generates with the actor's own module when it holds whole weights.

    Otherwise (ZeRO-3, or vLLM) the engine holds its own plain copy, synced after every step (LoRA
    actors: with the adapter merged, see ``fastrlhf.rl.lora_sync``). ``engine: auto`` takes HF where
    vLLM cannot run the model (a head size vLLM-CPU lacks), with a warning.
    """
    from fastrlhf import distributed as D
    from fastrlhf.modeling import base_model, load_causal_lm
    from fastrlhf.rollout import HFEngine, VLLMEngine, choose_engine_kind

    ro, ds = config.rollout, config.deepspeed
    kind = ro.engine if ro.engine != "auto" else choose_engine_kind(num_params, device)
    if ro.engine == "auto" and kind == "vllm" and (why := vllm_cannot_run(config)):
        if D.is_main():
            print(f"warning: rollout.engine auto: using the HF engine, {why}", flush=True)
        kind = "hf"
    from fastrlhf.memory.components import seq_len

    max_len = seq_len(config)  # prompt + completion (an episode's: its tool turns too)
    if kind == "hf":
        if ds.zero_stage < 3:
            # Same module, same weights: generation sees every update at once, no sync needed.
            return HFEngine(actor_module, max_model_len=max_len, tokenizer=tokenizer,
                            fp32_logits=config.model.fp32_logits), True
        rollout_model = load_causal_lm(config.model, trainable=False, dtype=ro.dtype).to(device)
        return HFEngine(rollout_model, max_model_len=max_len, tokenizer=tokenizer,
                        fp32_logits=config.model.fp32_logits), False
    on_cuda = getattr(device, "type", str(device)) == "cuda"
    tp = ro.tensor_parallel_size
    kv_cache_bytes = ro.kv_cache_bytes
    if kv_cache_bytes == "auto":  # the step's whole batch at once, from the plan; without one: 1 GiB on a CPU,
        # on CUDA what gpu_memory_utilization leaves
        kv_cache_bytes = (plan.kv_cache_bytes if plan is not None and plan.kv_cache_bytes
                          else None if on_cuda else 1 << 30)
    engine = VLLMEngine(config.model.path, dtype=ro.dtype, max_model_len=max_len, kv_cache_bytes=kv_cache_bytes,
                        seed=config.seed + D.rank() // tp, tokenizer=tokenizer,
                        gpu_memory_utilization=gpu_memory_utilization(ro, plan) if on_cuda else None,
                        sleep=ro.sleep and on_cuda, tensor_parallel_size=ro.tensor_parallel_size,
                        enforce_eager=ro.enforce_eager is True, fp32_logits=config.model.fp32_logits)
    if not on_cuda and D.is_main():  # what the weight syncs do on this CPU, once
        from fastrlhf.engine.platform import cpu_tools

        print(f"rollout: vllm; {cpu_tools('cpu').probe.cpu_probe().summary()}", flush=True)
    if tp > 1:
        from fastrlhf.rollout.tensor_parallel import TensorParallelGroup

        engine = TensorParallelGroup(engine, tp, D.rank())
    elif not on_cuda and ds.zero_stage < 3 and config.model.lora_r == 0:
        # An in-process CPU engine reads the actor's embedding rows as they are: no copy of its own
        # (a vocab x hidden matrix). The actor's weights only change in updates, each synced before
        # the next generation. (ZeRO-3 holds no whole weight; a LoRA actor syncs merged copies.)
        engine.share_input_embedding(base_model(actor_module).get_input_embeddings().weight)
    return engine, False


# What vLLM may not take of the memory the trainer's models leave free: room for the update's
# activations and the allocator's fragmentation (vLLM itself asks for a fraction of the *total*).
FREE_MEMORY_MARGIN = 0.10


def gpu_memory_utilization(ro, plan=None) -> float:
    """``rollout.gpu_memory_utilization``, or for ``auto``: the share of this GPU's total memory still
    free now that the trainer's models are placed, less a margin (vLLM's default 0.9 would refuse to
    start beside them), and no more than the plan leaves once the update's activations, loss chunks
    and optimizer step are counted (they are not allocated yet when the engine starts)."""
    if ro.gpu_memory_utilization != "auto":
        return float(ro.gpu_memory_utilization)
    import torch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = int((free / total - FREE_MEMORY_MARGIN) * 100) / 100
    planned = plan.gpu_memory_utilization if plan is not None else None
    if share < 0.05 or (planned is not None and planned < 0.05):
        from fastrlhf.config import ConfigError

        # Name what left no room: the memory free now, or the plan's share once the update's phases are counted
        # (with plenty free now, "only N GiB are free" would point at the wrong cause).
        why = (f"only {free / 2**30:.1f} of {total / 2**30:.1f} GiB are free after the trainer's models"
               if share < 0.05 else
               f"the memory plan leaves vLLM {planned:.2f} of this GPU ({planned * total / 2**30:.1f} GiB) once the "
               f"update's activations, loss chunks and optimizer step are counted ({free / 2**30:.1f} GiB are "
               "free now; see fastrlhf plan)")
        raise ConfigError("rollout.gpu_memory_utilization", f"{why}: no room for vLLM (try deepspeed.zero_stage 3, "
                          "offload, or engine: hf)")
    return share if planned is None else min(share, planned)
