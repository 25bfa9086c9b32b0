"""The tools example's tokenizer and model: the arithmetic example's Qwen2 shape (4 layers, hidden 128, GQA,
tied embeddings, the 151,936-row vocabulary) with room for an episode (~320 tokens, the tools' system turn
included), and a byte-level BPE trained on the task's text plus the template's tool text, with ``<tool_call>``
and ``</tool_call>`` as single tokens."""

from __future__ import annotations

from examples.arithmetic.model import MODEL_SHAPE
from examples.tools.data import CALCULATOR, corpus_text
from fastrlhf.modeling.tiny_chat import CORPUS, build_chat_model, build_chat_tokenizer, save_chat_model

__all__ = ["SHAPE", "make_initial_model"]

SHAPE = {**MODEL_SHAPE, "max_position_embeddings": 512}


def make_initial_model(out_dir: str, seed: int = 0) -> dict:
    """Tokenizer + random-init model saved to ``out_dir``; returns a summary."""
    from fastrlhf.rollout.tools import load_toolbox

    schemas = load_toolbox([CALCULATOR]).schemas
    texts = [*CORPUS, *corpus_text(seed), "<tool_response>\n", "\n</tool_response>"]
    tokenizer = build_chat_tokenizer(texts, vocab_size=1024, model_max_length=SHAPE["max_position_embeddings"])
    # The tools' system turn as the template renders it, so that BPE merges its words.
    system = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=schemas, tokenize=False)
    tokenizer = build_chat_tokenizer([*texts, *[system] * 50], vocab_size=1024,
                                     model_max_length=SHAPE["max_position_embeddings"])
    return save_chat_model(out_dir, build_chat_model(tokenizer, seed=seed, **SHAPE), tokenizer)
