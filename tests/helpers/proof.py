"""What the GPU proof (tests/gpu, benchmarks/gpu) trains: the shapes and dtypes per device."""

import torch

from fastrlhf.modeling.tiny import QWEN2_1_5B


def model_shape(where: str) -> dict:
    """The model the proof trains: Qwen2.5-1.5B's shape on CUDA; on the CPU a tiny Qwen2 with the same
    features (GQA, q/k/v biases, tied embeddings) and a small vocabulary."""
    if where == "cuda":
        return dict(QWEN2_1_5B)
    return dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                max_position_embeddings=1024, tie_word_embeddings=True)


def model_dtype(where: str) -> torch.dtype:
    return torch.bfloat16 if where == "cuda" else torch.float32
