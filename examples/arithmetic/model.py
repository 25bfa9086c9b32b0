"""The example's starting point: a byte-level BPE tokenizer trained on the task's text and a
randomly initialised Qwen2-architecture model, saved together as a standard HF folder.

- Tokenizer: Qwen2's pre-tokenizer (its split regex, digits one by one, then byte-level), a small
  BPE vocabulary trained with ``tokenizers`` on the train split's text, the special tokens
  ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (eos, 2) and a Qwen-style
  ChatML chat template, saved as a ``PreTrainedTokenizerFast``.
- Model: ``Qwen2ForCausalLM`` with GQA (4 query heads, 2 key/value heads), Qwen2's q/k/v biases,
  tied embeddings and the real Qwen2 vocabulary size, 151,936 rows: the tokenizer uses only the
  first ``len(tokenizer)`` ids, as a real Qwen2 checkpoint leaves its padded rows unused. The
  head size (32) is one the vLLM CPU attention backend runs, so either rollout engine serves it.

    python -m examples.arithmetic.model --out runs/arithmetic/init
"""

from __future__ import annotations

import argparse
import os
import shutil

__all__ = ["MODEL_SHAPE", "QWEN2_VOCAB_SIZE", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer", "build_model",
           "make_initial_model"]

QWEN2_VOCAB_SIZE = 151936
# 4 query heads of 32 over 2 key/value heads (GQA); head_dim 32 is in vLLM-CPU's supported sizes.
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
# Qwen2's pre-tokenizer split: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# ChatML as Qwen writes it (without Qwen2.5's default system message, so prompts stay short).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(texts, vocab_size: int = 1024):
    """A ``PreTrainedTokenizerFast`` with a byte-level BPE vocabulary of ``vocab_size`` trained on ``texts``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # The chat markup ("user", "assistant", newlines) is text the model reads too.
    tok.train_from_iterator([*texts, "user\nassistant\n"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None, additional_special_tokens=["<|im_start|>"],
                                   chat_template=CHAT_TEMPLATE, model_max_length=MODEL_SHAPE["max_position_embeddings"],
                                   clean_up_tokenization_spaces=False)


def build_model(tokenizer, seed: int = 0, **shape):
    """A random-init ``Qwen2ForCausalLM`` (vocab 151,936, tied, GQA) whose eos/pad are the tokenizer's."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2Config(vocab_size=QWEN2_VOCAB_SIZE, tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos,
                         pad_token_id=pad, **{**MODEL_SHAPE, **shape})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    return model


def make_initial_model(out_dir: str, texts, seed: int = 0, vocab_size: int = 1024, **shape) -> dict:
    """Train the tokenizer on ``texts``, build the model, save both to ``out_dir``; returns a summary."""
    tokenizer = build_tokenizer(texts, vocab_size)
    model = build_model(tokenizer, seed=seed, **shape)
    tmp = f"{out_dir.rstrip(os.sep)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return {"parameters": params, "embedding_parameters": embedding, "tokenizer_vocab": len(tokenizer),
            "model_vocab": model.config.vocab_size}


def main(argv=None) -> None:
    from examples.arithmetic.data import corpus_text

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/arithmetic/init")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = make_initial_model(args.out, corpus_text(), seed=args.seed)
    print(f"{args.out}: {info}")


if __name__ == "__main__":
    main()
