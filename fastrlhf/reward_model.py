"""``fastrlhf rm``: reward models on ``AutoModelForSequenceClassification``.

pairwise:   Bradley-Terry, loss = -logsigmoid(r_chosen - r_rejected), accuracy = P(r_chosen > r_rejected)
classifier: cross-entropy over ``num_labels`` classes, accuracy of the argmax
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastrlhf import distributed as D
from fastrlhf.algorithms import bradley_terry_loss
from fastrlhf.config import RMConfig
from fastrlhf.data import load_classification_examples, load_pairwise_examples
from fastrlhf.modeling import base_model, load_sequence_classifier, vocab_size
from fastrlhf.supervised import SupervisedJob, engine_config, run_supervised, seed_everything

__all__ = ["pad_batch", "pairwise_loss", "classifier_loss", "run"]


def pad_batch(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask``."""
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, s in enumerate(sequences):
        input_ids[row, :len(s)] = torch.tensor(s)
        attention_mask[row, :len(s)] = 1
    return input_ids, attention_mask


def scores(engine, sequences: list[list[int]], pad_id: int) -> torch.Tensor:
    input_ids, attention_mask = pad_batch(sequences, pad_id)
    return engine(input_ids=input_ids, attention_mask=attention_mask).logits.float()


def pairwise_loss(engine, pairs, pad_id: int):
    # Chosen and rejected go through one forward pass: one batch of 2B sequences.
    sequences = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    rewards = scores(engine, sequences, pad_id)[:, 0]
    chosen, rejected = rewards[: len(pairs)], rewards[len(pairs):]
    loss = bradley_terry_loss(chosen, rejected)
    return loss, {"accuracy": (chosen > rejected).float().mean().item(),
                  "margin": (chosen - rejected).mean().item()}


def classifier_loss(engine, examples, pad_id: int):
    logits = scores(engine, [e.input_ids for e in examples], pad_id)
    labels = torch.tensor([e.label for e in examples])
    loss = F.cross_entropy(logits, labels)
    return loss, {"accuracy": (logits.argmax(-1) == labels).float().mean().item()}


def run(config: RMConfig, resume: bool = False) -> dict:
    seed_everything(config.seed)
    vocab = vocab_size(config.model.path)
    if config.kind == "pairwise":
        examples = load_pairwise_examples(config.data.path, config.data.max_len, vocab, config.model.path)
    else:
        examples = load_classification_examples(config.data.path, config.data.max_len, config.resolved_num_labels,
                                                vocab, config.model.path)
    D.init_distributed()  # after the data checks: bad data fails without starting a process group
    model = load_sequence_classifier(config.model, config.resolved_num_labels, zero3_config=engine_config(config))
    pad_id = base_model(model).config.pad_token_id
    loss = pairwise_loss if config.kind == "pairwise" else classifier_loss

    def loss_fn(engine, micro_batch):
        return loss(engine, micro_batch, pad_id)

    return run_supervised(config, SupervisedJob(examples, model, loss_fn, bar_keys=("loss", "accuracy")), resume=resume)
