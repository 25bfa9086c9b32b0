"""Which attention runs packed rows (``trainer.packing``, ``trainer.share_prompts``): chosen once per run.

A packed row holds several sequences end to end (``fastrlhf.sequences.packing.PackedLayout``); each token may
attend only within its own sequence, or, with shared prompts, to its group's one copy of the prompt
and then causally to itself. ``model.attention`` names the kernel that does this in the training
forwards (reference, old-logprob, value and update passes; generation is the rollout engine's):

================  ============================  =============================================
device            packed rows                   shared prompts
================  ============================  =============================================
CUDA              ``flash_attention_2`` (varlen, ``flex``
                  when ``flash_attn`` imports
                  and models compute in bf16),
                  else ``flex``
CPU               ``sdpa``                      ``sdpa``
================  ============================  =============================================

- ``flex``: PyTorch's FlexAttention with a block mask built on the host from the sequence lengths
  (``fastrlhf.sequences.packed_attention.block_mask``): masked blocks are skipped, no ``[N, N]`` mask exists.
  torch has no FlexAttention backward on a CPU, so there it is refused for training.
- ``flash_attention_2``: flash-attn's variable-length kernel, its ``cu_seqlens`` built on the host once
  per micro-batch. It cannot express a shared prefix.
- ``sdpa``: one causal sdpa call per sequence (per segment with shared prompts), bounds from the host;
  the CPU default (FlexAttention's CPU path is an unfused reference, slower than this).

``auto`` (the default) takes the table; a choice this machine cannot run is a config error, raised
with the other fast checks before any model loads. Importing this module needs no torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from fastrlhf.config.errors import ConfigError

__all__ = ["BACKENDS", "choose", "resolve_attention"]

BACKENDS = ("auto", "flex", "flash_attention_2", "sdpa")
_HALF = ("bfloat16", "float16")


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def choose(requested: str, on_gpu: bool, dtype: str, share_prompts: bool = False) -> str:
    """The backend of ``model.attention`` (``requested``) for a run on a GPU (``on_gpu``) or a CPU whose
    models compute in ``dtype``; raises :class:`ConfigError` for one that cannot run there."""
    if requested not in BACKENDS:
        raise ConfigError("model.attention", f"expected one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "auto":
        if not on_gpu:
            return "sdpa"
        if not share_prompts and dtype in _HALF and _flash_attn_installed():
            return "flash_attention_2"
        return "flex"
    if requested == "flex" and not on_gpu:
        raise ConfigError("model.attention", "flex needs a GPU: torch has no FlexAttention backward on a CPU "
                                             "(use sdpa or auto)")
    if requested == "flash_attention_2":
        if share_prompts:
            raise ConfigError("model.attention", "flash_attention_2 cannot run shared prompts "
                                                 "(trainer.share_prompts): use flex or auto")
        if not on_gpu:
            raise ConfigError("model.attention", "flash_attention_2 needs a GPU (use sdpa or auto)")
        if not _flash_attn_installed():
            raise ConfigError("model.attention", "flash_attention_2 needs the flash_attn package: "
                                                 "pip install flash-attn --no-build-isolation (or use auto)")
        if dtype not in _HALF:
            raise ConfigError("model.attention", f"flash_attention_2 needs bf16 or fp16 compute, this run computes in "
                                                 f"{dtype} (model.dtype, deepspeed.bf16; or use auto)")
    return requested


def resolve_attention(config, on_gpu: bool):
    """``config`` with ``model.attention`` made concrete (after the precision: the dtype decides). The dtype is the
    one the forward passes compute in: fp32 weights under ``deepspeed.bf16`` run bf16 (DeepSpeed casts the module,
    the frozen models load in it), where flash-attn runs."""
    from fastrlhf.config.precision import compute_dtype

    trainer = config.trainer
    backend = choose(config.model.attention, on_gpu, compute_dtype(config), getattr(trainer, "share_prompts", False))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, attention=backend))
