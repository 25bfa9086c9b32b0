"""The precision of a run, resolved once from the config and the machine it runs on.

On a GPU the default is what OpenRLHF, verl and TRL users run: bf16 compute with fp32 master
weights (DeepSpeed's bf16 mode: the module computes in bf16, the optimizer keeps fp32 copies of the
weights and its moments in fp32), TF32 for the matmuls that stay fp32, and a bf16 rollout engine.
On a CPU everything stays fp32, which is what the CPU tests compare against.

Pure bf16 (bf16 weights updated in bf16, no fp32 copy) silently drops every update smaller than
bf16's resolution, about 1/256 of a weight, which at RL learning rates is most of them. A config
that would train that way (``model.dtype: bfloat16`` with ``deepspeed.bf16: false``) is refused
unless ``deepspeed.pure_bf16: true`` says it is meant. fp16 training needs loss scaling, which
fastrlhf does not configure, so a float16 model is refused for training.

Importing this module needs no torch (config validation must stay fast); only
:func:`gpu_available` and :func:`apply_matmul_precision` import it.
"""

from __future__ import annotations

import dataclasses

__all__ = ["apply_matmul_precision", "compute_dtype", "fp32_grad_accumulation", "gpu_available", "refuse_fp16",
           "resolve_precision", "trained_zero_stage"]


def refuse_fp16(extra: dict) -> None:
    """fp16 through ``deepspeed.extra`` turns on DeepSpeed's dynamic loss scaler, whose routine overflow skips while
    it calibrates (about one per halving from 2**16) the step guard counts as bad steps: a healthy run stopped at
    step ``trainer.max_skipped_steps`` with "lower trainer.lr"."""
    from .errors import ConfigError

    fp16 = (extra or {}).get("fp16")
    if isinstance(fp16, dict) and fp16.get("enabled"):
        raise ConfigError("deepspeed.extra.fp16", "fp16 training (DeepSpeed's loss scaling) is not supported; use "
                                                  "bf16 (deepspeed.bf16: true) or fp32")


def trained_zero_stage(ds) -> int:
    """The ZeRO stage a trained engine runs at: ``deepspeed.zero_stage``, except that bf16 at stage 0 runs ZeRO-1.

    At stage 0 DeepSpeed trains bf16 weights through its fp16 wrapper (``FP16_UnfusedOptimizer`` for a torch
    optimizer), which checks each parameter's gradient for overflow on the host: a device read per parameter and
    step (about 340 for a 1.5B Qwen2). ZeRO-1 keeps the same fp32 master weights, on one rank the same memory
    (less on several), and leaves that check to the guard's one read. The engine config and the memory plan
    both ask here."""
    return 1 if ds.zero_stage == 0 and ds.bf16 is True else ds.zero_stage


def fp32_grad_accumulation(ds) -> bool:
    """Whether a trained engine sums its micro-batches' gradients in fp32: at ZeRO-2 with bf16 compute
    (DeepSpeed's ``data_types.grad_accum_dtype``), unless the optimizer is offloaded (ZeRO-Offload already
    sums on the host in fp32) or ``deepspeed.extra`` sets another ``grad_accum_dtype``.

    The bf16 default rounds every micro-batch's sum to bf16, and the step then flattens that bf16 partition
    and casts it to fp32, both copies at once: for 1.5B parameters on one GPU 8.6 GiB, the run's peak
    (measured on an H100). In fp32, DeepSpeed adds each micro-batch's reduced gradient into one
    fp32 partition, which the step uses as it is and frees. ZeRO-1 is left as it is: DeepSpeed would swap in
    its ``BF16_Optimizer``, with a full-model fp32 gradient buffer that is never freed and a bf16 reduction of
    the sum. The engine config and the memory plan both ask here."""
    extra = ds.extra.get("data_types") if isinstance(ds.extra, dict) else None
    asked = extra.get("grad_accum_dtype") if isinstance(extra, dict) else None
    if asked is not None and asked not in ("fp32", "float32", "float"):
        return False
    return trained_zero_stage(ds) == 2 and ds.bf16 is True and not ds.offload_optimizer


def gpu_available() -> bool:
    """Whether this process will train on a CUDA device (what ``auto`` precision settings follow)."""
    import torch

    return torch.cuda.is_available()


def _resolve_model_dtype(model, ds, on_gpu: bool) -> str:
    if model.dtype != "auto":
        return model.dtype
    # auto: bf16 weights on a GPU unless the config turned bf16 off (then fp32, never pure bf16 by default).
    return "bfloat16" if on_gpu and (ds.bf16 is not False or ds.pure_bf16) else "float32"


def resolve_precision(config, on_gpu: bool):
    """``config`` with every ``auto`` precision setting made concrete for a GPU (``on_gpu``) or CPU run.

    - ``model.dtype``: bfloat16 on a GPU, float32 on a CPU.
    - ``deepspeed.bf16``: true when the model is bf16 (fp32 master weights), unless ``pure_bf16``.
    - ``rollout.dtype`` (RL runs): bfloat16 on a GPU, otherwise the dtype the actor computes in.
    """
    ds = config.deepspeed
    dtype = _resolve_model_dtype(config.model, ds, on_gpu)
    bf16 = ds.bf16 if ds.bf16 != "auto" else (dtype == "bfloat16" and not ds.pure_bf16)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype),
                                 deepspeed=dataclasses.replace(ds, bf16=bf16))
    rollout = getattr(config, "rollout", None)
    if rollout is not None and rollout.dtype == "auto":
        rollout_dtype = "bfloat16" if on_gpu else compute_dtype(config)
        config = dataclasses.replace(config, rollout=dataclasses.replace(rollout, dtype=rollout_dtype))
    return config


def compute_dtype(config) -> str:
    """The dtype the trained model runs its forward passes in (DeepSpeed bf16 casts the module to bf16);
    frozen copies (reference, reward model, rollout engine) load in it too."""
    return "bfloat16" if config.deepspeed.bf16 is True else config.model.dtype


def apply_matmul_precision(config) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA when ``model.tf32`` (no effect on a CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = bool(config.model.tf32)
        torch.backends.cudnn.allow_tf32 = bool(config.model.tf32)
