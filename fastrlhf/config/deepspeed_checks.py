"""The rules of ``deepspeed.extra``, the mapping merged verbatim into each generated DeepSpeed config
(``fastrlhf.engine.deepspeed.deepspeed_config``): it may tune DeepSpeed, not overrule what fastrlhf sets from
its own settings, which the memory plan, the checkpoints and the step read too."""

from __future__ import annotations

from .errors import ConfigError

__all__ = ["check_extra"]

# DeepSpeed keys fastrlhf sets from a setting of its own: extra's value would win, unseen by the rest of the run
# (e.g. gradient_accumulation_steps 4 under trainer.grad_accum 1: DeepSpeed steps once every 4 micro-batches).
_SET_FROM = {
    "train_micro_batch_size_per_gpu": "trainer's batch settings (trainer.grad_accum, minibatch_size or batch_size)",
    "gradient_accumulation_steps": "trainer.grad_accum",
    "train_batch_size": "trainer's batch settings (trainer.grad_accum, minibatch_size or batch_size)",
    "gradient_clipping": "trainer.max_grad_norm",
    # DeepSpeed silently ignores these beside the client optimizer and schedule fastrlhf passes it
    "optimizer": "trainer.lr and trainer.weight_decay (fastrlhf's own AdamW)",
    "scheduler": "trainer.warmup_steps (fastrlhf's own schedule)",
}


def check_extra(ds) -> None:
    """A one-line ConfigError for a key of ``deepspeed.extra`` that contradicts the config (fp16: ``refuse_fp16``).
    An offload's own options (pin_memory, ...) are DeepSpeed's to tune once ``deepspeed.offload_*`` turns it on."""
    extra = ds.extra
    for key, setting in _SET_FROM.items():
        if key in extra:
            raise ConfigError(f"deepspeed.extra.{key}", f"is set by fastrlhf from {setting}; set that instead")
    bf16 = extra.get("bf16")
    if isinstance(bf16, dict) and "enabled" in bf16:
        raise ConfigError("deepspeed.extra.bf16.enabled", "is set by fastrlhf from deepspeed.bf16; set that instead")
    zero = extra.get("zero_optimization")
    if zero is None:
        return
    if not isinstance(zero, dict):
        raise ConfigError("deepspeed.extra.zero_optimization", f"expected a mapping, got {zero!r}")
    for key, on in (("stage", False), ("offload_optimizer", ds.offload_optimizer), ("offload_param", ds.offload_param)):
        if key in zero and not on:
            setting = "deepspeed.zero_stage" if key == "stage" else f"deepspeed.{key}"
            raise ConfigError(f"deepspeed.extra.zero_optimization.{key}", f"is set by fastrlhf from {setting}; set "
                                                                          "that instead")
