"""Causal LMs created locally (no model hub): tiny ones for tests, benchmarks and examples, and the
shape of Qwen2.5-1.5B (:data:`QWEN2_1_5B`) from random init for the GPU tests and benchmarks."""

from __future__ import annotations

import os

import torch

__all__ = [
    "tiny_llama_config",
    "make_tiny_llama",
    "save_tiny_llama",
    "tiny_qwen2_config",
    "make_tiny_qwen2",
    "save_tiny_qwen2",
    "QWEN2_1_5B",
    "make_qwen2_on",
    "count_parameters",
]

# Qwen2.5-1.5B's shape (28 layers, hidden 1536, GQA 12/2, the 151,936 vocabulary, tied embeddings):
# 1.54B parameters, the model of the GPU proof (tests/gpu, benchmarks/gpu).
QWEN2_1_5B = dict(vocab_size=151_936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                  intermediate_size=8960, max_position_embeddings=32768, tie_word_embeddings=True,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def _tiny_shape(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                max_position_embeddings, tie_word_embeddings) -> dict:
    """The config fields every tiny architecture shares."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        # Token ids are arbitrary in tests; keep the special ids inside the vocab.
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


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
    shape = _tiny_shape(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads or num_heads, intermediate_size,
                        max_position_embeddings, tie_word_embeddings)
    return LlamaConfig(**{**shape, **overrides})


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


def tiny_qwen2_config(
    vocab_size: int = 256,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    **overrides,
):
    """A Qwen2Config small enough for CPU tests, shaped like the small Qwen2/Qwen2.5 models: q/k/v
    biases (always, in Qwen2), grouped-query attention (half as many key/value heads as query heads
    unless ``num_kv_heads`` says otherwise) and tied embeddings.

    The defaults give head size 32, the smallest the vLLM CPU attention backend runs.
    """
    from transformers import Qwen2Config

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size must be divisible by num_heads, got {hidden_size} and {num_heads}")
    num_kv_heads = num_kv_heads or max(1, num_heads // 2)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads must be a multiple of num_kv_heads, got {num_heads} and {num_kv_heads}")
    shape = _tiny_shape(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                        max_position_embeddings, tie_word_embeddings)
    return Qwen2Config(**{**shape, **overrides})


def make_tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A random-init Qwen2ForCausalLM (deterministic for a given seed), in eval mode.

    Its q/k/v biases are drawn like its weights (normal, std ``initializer_range``): HF starts them
    at zero, and a zero bias would let a weight sync that drops biases go unnoticed.
    """
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(**config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, config.initializer_range)
    return model.to(dtype).eval()


def save_tiny_qwen2(directory: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """Create a tiny Qwen2 and ``save_pretrained`` it (safetensors) into ``directory``; returns the model."""
    model = make_tiny_qwen2(seed=seed, dtype=dtype, **config_kwargs)
    model.save_pretrained(str(directory))
    return model


def make_qwen2_on(device: str | torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0, **shape):
    """A random-init Qwen2ForCausalLM of ``shape`` (:func:`tiny_qwen2_config` keys, e.g.
    ``**QWEN2_1_5B``) created directly on ``device`` (a 1.5B model initialises in seconds on a GPU
    where the CPU takes minutes), in ``dtype``, in eval mode. Biases start at zero, as in HF."""
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(**shape)
    device = torch.device(device)
    # The seeding must not leak into the caller's generator of the device the weights are drawn on.
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, device_type=device.type), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
