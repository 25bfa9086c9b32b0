"""Tiny causal LMs created locally (no model hub): for tests, benchmarks and examples."""

from __future__ import annotations

import os

import torch

__all__ = ["tiny_llama_config", "make_tiny_llama", "save_tiny_llama", "count_parameters"]


def tiny_llama_config(
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    **overrides,
):
    """A LlamaConfig small enough for CPU tests.

    The defaults give head size 32, the smallest the vLLM CPU attention backend runs
    (see ``fastrlhf.rollout.vllm_adapter.CPU_SUPPORTED_HEAD_SIZES``).
    """
    from transformers import LlamaConfig

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size must be divisible by num_heads, got {hidden_size} and {num_heads}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        # Token ids are arbitrary in tests; keep the special ids inside the vocab.
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        **overrides,
    )


def make_tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A random-init LlamaForCausalLM (deterministic for a given seed), in eval mode."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(**config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def save_tiny_llama(directory: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """Create a tiny Llama and ``save_pretrained`` it (safetensors) into ``directory``; returns the model."""
    model = make_tiny_llama(seed=seed, dtype=dtype, **config_kwargs)
    model.save_pretrained(str(directory))
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
