"""Tiny one-label ``*ForSequenceClassification`` reward models: encoders (their ``classifier`` head pools the first
token, most through a pooler of their own) and a decoder (a ``score`` head read at the last token)."""

import torch
import transformers

_CLASSES = {"deberta-v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification"),
            "bert": ("BertConfig", "BertForSequenceClassification"),
            "roberta": ("RobertaConfig", "RobertaForSequenceClassification"),
            "llama": ("LlamaConfig", "LlamaForSequenceClassification")}


def tiny_classifier(name: str):
    """``name``: deberta-v2, bert, roberta or llama; seeded, in eval mode, pad id 0, 64 positions."""
    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 num_labels=1, max_position_embeddings=64, pad_token_id=0)
    config, model = _CLASSES[name]
    extra = {"llama": dict(num_key_value_heads=2), "deberta-v2": dict(pooler_hidden_size=32)}.get(name, {})
    return getattr(transformers, model)(getattr(transformers, config)(**small, **extra)).eval()
