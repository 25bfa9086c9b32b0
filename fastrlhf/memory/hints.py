"""What would shrink each component of a memory plan: the remedy that ``fastrlhf plan`` and the launch check
name beside the largest component."""

from __future__ import annotations

__all__ = ["HINTS", "hint_for"]

HINTS = {
    "optimizer states": "deepspeed.zero_stage 3 or deepspeed.offload_optimizer",
    "gradients": "deepspeed.zero_stage 2 or 3, or deepspeed.offload_optimizer",
    "weights": "deepspeed.zero_stage 3, deepspeed.offload_param, or LoRA (model.lora_r)",
    "reference weights": "deepspeed.zero_stage 3 (shards the reference) or LoRA (no reference copy)",
    "reward model weights": "a smaller reward model, or reward functions",
    "ZeRO buffers": "a smaller deepspeed.extra.zero_optimization.reduce_bucket_size",
    "rollout weights": "rollout.tensor_parallel_size or rollout.sleep",
    "weight sync bucket": "a smaller rollout.sync_bucket_bytes",
    "LoRA merge": "model.lora_targets without the largest weights (embed_tokens, lm_head, the MLP's)",
    "rollout KV cache": "a smaller rollout.kv_cache_bytes, trainer.prompts_per_step or rollout.n",
    "rollout working memory": "a smaller trainer.prompts_per_step or rollout.n",
    # before "activations", which their names end with
    "scoring activations": "a smaller trainer.forward_micro_batch, or trainer.max_tokens_per_microbatch",
    "reward model activations": "a smaller trainer.forward_micro_batch, or a smaller reward model",
    "activations": "model.gradient_checkpointing: true, or a larger trainer.grad_accum (smaller micro-batches)",
    "fused loss": "a smaller trainer.loss_chunk_bytes",
    "optimizer step temporaries": "deepspeed.zero_stage 3 with a smaller zero_optimization.sub_group_size",
}


def hint_for(name: str, config) -> str | None:
    """The remedy for the component ``name`` of the plan of ``config`` (None: no known one)."""
    if name.endswith("optimizer states") and config.deepspeed.zero_stage == 3:
        return "deepspeed.offload_optimizer"
    for key, hint in HINTS.items():
        if name.endswith(key) and not (key == "weights" and name.startswith(("reference", "reward", "rollout"))):
            return hint
    return None
