"""The workloads the GPU races share: the 7B LM head's shape, GRPO's loss settings, the model shapes (the 1.5B Qwen2 and
the CPU smoke shape), and the GRPO races' random-init model folder with its word-level tokenizer and prompts."""

from __future__ import annotations

import json

import torch

# Qwen2.5-7B's hidden size and padded vocabulary; 16 sequences of 1024 tokens.
LM_HEAD_7B = dict(batch=16, seq_len=1024, hidden=3584, vocab=152_064)
# GRPO's loss as the trainer runs it: PPO clip 0.2 both ways, k3 KL to the reference in the loss, token mean.
LOSS = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_kind="k3")
AGG = "token-mean"
# The CPU smoke shape: the GPU proof's tiny Qwen2 (tests/helpers/proof.py), GQA, biases, tied embeddings.
TINY_QWEN2 = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                  max_position_embeddings=1024, tie_word_embeddings=True)


def model_shape(name: str) -> dict:
    from fastrlhf.modeling.tiny import QWEN2_1_5B

    return dict(QWEN2_1_5B) if name == "qwen2-1.5b" else dict(TINY_QWEN2)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``t<id>`` words, so that TRL's text prompts are exactly the token-id prompts
    fastrlhf reads; the last two ids are padding and EOS (a random-init model almost never samples EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pad, eos = vocab_size - 2, vocab_size - 1
    vocab = {f"t{i}": i for i in range(pad)}
    vocab.update({"<pad>": pad, "<eos>": eos})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>",
                                   clean_up_tokenization_spaces=False)


def save_model(device: str, shape: str, dtype: str, out_dir: str, seed: int = 0) -> dict:
    """A random-init model folder (safetensors) with its tokenizer; EOS and padding are the tokenizer's."""
    from transformers import GenerationConfig

    from fastrlhf.modeling.tiny import count_parameters, make_qwen2_on

    model = make_qwen2_on(device, getattr(torch, dtype), seed=seed, **model_shape(shape))
    tokenizer = word_tokenizer(model.config.vocab_size)
    model.config.bos_token_id, model.config.eos_token_id = None, tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {"params": count_parameters(model)}


def write_prompts(spec: dict, vocab: int) -> None:
    """``prompts`` random prompts of ``prompt_len`` ids below the tokenizer's padding and EOS, with their text."""
    g = torch.Generator().manual_seed(0)
    with open(spec["prompts_file"], "w") as f:
        for ids in torch.randint(3, vocab - 2, (spec["prompts"], spec["prompt_len"]), generator=g).tolist():
            f.write(json.dumps({"prompt_ids": ids, "prompt": " ".join(f"t{i}" for i in ids)}) + "\n")
