"""The learned reward of ``make demo REWARD=model``: a script classifier scored against the prompt's request.

The classifier (``fastrlhf rm`` with ``kind: classifier``, 3 labels in ``SCRIPT_LABELS`` order) reads
``S`` + a completion and predicts which script the answer is written in. The trainer's reward-model
path scores one fixed ``label_index`` for every prompt, but here the wanted label depends on the
prompt's prefix, so this small reward function does the label selection: reward = the classifier's
probability of the script the prompt asks for (``meta.label``, written with the prompts).

Config: ``reward: {function: fastrlhf.demo.rewards:script_classifier}``; the classifier folder is
``$FASTRLHF_DEMO_CLASSIFIER`` (default ``runs/demo/rm/final``). Every call also appends whether the
completion was an exact match to ``$FASTRLHF_DEMO_EXACT_LOG.rank<R>`` when that variable is set, so
the demo can plot true accuracy during training even though the reward is not accuracy.
"""

from __future__ import annotations

import os

from fastrlhf.demo import script_doubling as task

__all__ = ["script_classifier", "classifier_path"]

_MODELS: dict = {}
_LOG: dict = {}


def classifier_path() -> str:
    return os.environ.get("FASTRLHF_DEMO_CLASSIFIER", "runs/demo/rm/final")


def _classifier(path: str):
    model = _MODELS.get(path)
    if model is None:
        import torch
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        model.requires_grad_(False)
        _MODELS[path] = model
    return model


def _log_exact(value: bool) -> None:
    base = os.environ.get("FASTRLHF_DEMO_EXACT_LOG")
    if not base:
        return
    f = _LOG.get(base)
    if f is None:
        rank = os.environ.get("RANK", "0")
        f = _LOG[base] = open(f"{base}.rank{rank}", "a", buffering=1, encoding="utf-8")
    f.write("1\n" if value else "0\n")


def script_classifier(prompt_ids, completion_ids, meta) -> float:
    """P(classifier says the answer is in the requested script); 0.0 for an empty completion."""
    import torch

    from fastrlhf.engine.device import model_device, to_device

    _log_exact(task.reward(prompt_ids, completion_ids) == 1.0)
    if not completion_ids:
        return 0.0
    label = int(meta["label"])
    model = _classifier(classifier_path())
    ids = to_device(torch.tensor([[task.BOS_ID, *completion_ids]], dtype=torch.long), model_device(model))
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return float(torch.softmax(logits, -1)[label])
