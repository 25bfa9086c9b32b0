"""The example's starting point: a byte-level BPE tokenizer trained on the task's text and a
randomly initialised Qwen2-architecture model, saved together as a standard HF folder.

- Tokenizer: Qwen2's pre-tokenizer (its split regex, digits one by one, then byte-level), a small
  BPE vocabulary trained with ``tokenizers`` on the train split's text, the special tokens
  ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (eos, 2) and Qwen2.5's chat
  template, saved as a ``PreTrainedTokenizerFast``: the tiny chat model's builders
  (``fastrlhf.modeling.tiny_chat``, ``python -m fastrlhf.modeling.tiny_chat``) on this task's corpus.
- Model: ``Qwen2ForCausalLM`` with GQA (4 query heads, 2 key/value heads), Qwen2's q/k/v biases,
  tied embeddings and the real Qwen2 vocabulary size, 151,936 rows: the tokenizer uses only the
  first ``len(tokenizer)`` ids, as a real Qwen2 checkpoint leaves its padded rows unused. The
  head size (32) is one the vLLM CPU attention backend runs, so either rollout engine serves it.

    python -m examples.arithmetic.model --out runs/arithmetic/init
"""

from __future__ import annotations

import argparse

from fastrlhf.modeling.tiny_chat import (
    CHAT_TEMPLATE,
    QWEN2_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_chat_model,
    build_chat_tokenizer,
    save_chat_model,
)

__all__ = ["MODEL_SHAPE", "QWEN2_VOCAB_SIZE", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer", "build_model",
           "make_initial_model"]

# 4 query heads of 32 over 2 key/value heads (GQA); head_dim 32 is in vLLM-CPU's supported sizes.
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128)


def build_tokenizer(texts, vocab_size: int = 1024):
    """A ``PreTrainedTokenizerFast`` with a byte-level BPE vocabulary of ``vocab_size`` trained on ``texts``
    (:func:`fastrlhf.modeling.tiny_chat.build_chat_tokenizer`, without the tool-call tokens)."""
    return build_chat_tokenizer(texts, vocab_size, model_max_length=MODEL_SHAPE["max_position_embeddings"],
                                tool_tokens=False)


def build_model(tokenizer, seed: int = 0, **shape):
    """A random-init ``Qwen2ForCausalLM`` (vocab 151,936, tied, GQA) whose eos/pad are the tokenizer's."""
    return build_chat_model(tokenizer, seed=seed, **{**MODEL_SHAPE, **shape})


def make_initial_model(out_dir: str, texts, seed: int = 0, vocab_size: int = 1024, **shape) -> dict:
    """Train the tokenizer on ``texts``, build the model, save both to ``out_dir``; returns a summary."""
    tokenizer = build_tokenizer(texts, vocab_size)
    return save_chat_model(out_dir, build_model(tokenizer, seed=seed, **shape), tokenizer)


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
