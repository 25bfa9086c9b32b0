"""Tiny random checkpoints of the architectures users load from local folders (Llama-3, Qwen2 with tied embeddings,
Qwen3, Mistral, Phi-3, Gemma, SmolLM), saved as a hub folder is: bf16 weights, a generation_config.json with a list
of eos ids (as Llama-3-Instruct's and Qwen2-Instruct's)."""

import torch

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
EOS_IDS = [1, 3]


def architecture_config(name: str):
    """The transformers config of a tiny ``name`` (a key of :data:`ARCHITECTURES`)."""
    import transformers

    cls, extra = ARCHITECTURES[name]
    return getattr(transformers, cls)(**SHAPE, **extra)


ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {}),
    "phi3": ("Phi3Config", {}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "smollm": ("LlamaConfig", {"tie_word_embeddings": True}),
}


def save_architecture(path, name: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> str:
    """A tiny random ``name`` checkpoint in ``path``; returns the path."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(architecture_config(name))
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=EOS_IDS, pad_token_id=2, do_sample=True, temperature=0.7, top_p=0.8
    )
    model.to(dtype).save_pretrained(path)
    return str(path)
