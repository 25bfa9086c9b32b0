"""Models: Hugging Face checkpoints loaded for training or inference (``loading``: dtype, LoRA, ZeRO-3
partitioned loading, the attention of packed rows, the critic's value head, the final export), the decoder
layers torch.compiled (``compile``: ``model.compile``), the tied embedding / LM head gradient (``tied_gradient``),
the LM head run by the fused kernels, or with fp32 logits in HF generate (``heads``), and models made locally
(``tiny``: tiny ones for tests and the demo, Qwen2.5-1.5B's shape for the GPU proof; ``tiny_chat``: a Qwen2-shaped
chat model with a tokenizer trained here, ``python -m fastrlhf.modeling.tiny_chat OUT``).

Imports ``fastrlhf.config`` and ``fastrlhf.sequences``; DeepSpeed only to load under ZeRO-3.
"""

from fastrlhf.modeling.loading import (
    CausalLMWithValueHead,
    apply_lora,
    base_model,
    export_hf,
    load_causal_lm,
    load_sequence_classifier,
    load_value_model,
    torch_dtype,
    unwrap,
    use_attention,
    vocab_size,
    zero3_loading,
)

__all__ = ["CausalLMWithValueHead", "apply_lora", "base_model", "export_hf", "load_causal_lm",
           "load_sequence_classifier", "load_value_model", "torch_dtype", "unwrap", "use_attention", "vocab_size",
           "zero3_loading"]
