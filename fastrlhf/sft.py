"""``fastrlhf sft``: supervised fine-tuning, next-token loss on response tokens only."""

from __future__ import annotations

import torch

from fastrlhf import distributed as D
from fastrlhf.algorithms import logprobs_from_logits, nll_loss
from fastrlhf.config import SFTConfig
from fastrlhf.data import SFTExample, load_sft_examples
from fastrlhf.modeling import base_model, load_causal_lm, vocab_size
from fastrlhf.supervised import SupervisedJob, engine_config, run_supervised, seed_everything

__all__ = ["collate_sft", "sft_loss", "run"]


def collate_sft(examples: list[SFTExample], pad_id: int) -> dict:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (1 on response tokens)."""
    length = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.float32)
    for row, e in enumerate(examples):
        p, r = len(e.prompt_ids), len(e.response_ids)
        input_ids[row, :p + r] = torch.tensor(e.prompt_ids + e.response_ids)
        attention_mask[row, :p + r] = 1
        loss_mask[row, p:p + r] = 1.0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def response_logprobs(engine, batch: dict, use_fused: bool = True, chunk_size=None, chunk_bytes=None) -> torch.Tensor:
    """Log-probability of each next token, ``[B, T-1]`` fp32.

    The fused path runs the LM head chunk by chunk on the final hidden states, so the
    ``[B, T, vocab]`` logits never exist; under ZeRO-3 the head weight is a partition, so the
    model's own forward (whose hooks gather it) is used instead.
    """
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    labels = input_ids[:, 1:]
    if use_fused:
        from fastrlhf.kernels import fused_linear_logprob_entropy

        model = base_model(engine.module)
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        head = model.get_output_embeddings()
        logprobs, _ = fused_linear_logprob_entropy(hidden[:, :-1], head.weight, labels, bias=head.bias,
                                                   chunk_size=chunk_size, chunk_bytes=chunk_bytes)
        return logprobs
    return logprobs_from_logits(engine(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1], labels)


def sft_loss(engine, batch: dict, use_fused: bool = True, chunk_size=None, chunk_bytes=None) -> torch.Tensor:
    """Mean negative log-likelihood over response tokens (prompt and padding masked out)."""
    return nll_loss(response_logprobs(engine, batch, use_fused, chunk_size, chunk_bytes), batch["loss_mask"][:, 1:])


def run(config: SFTConfig, resume: bool = False) -> dict:
    seed_everything(config.seed)
    examples = load_sft_examples(config.data.path, config.data.max_len, config.data.max_prompt_len,
                                 vocab_size=vocab_size(config.model.path), tokenizer_path=config.model.path,
                                 chat_template=config.data.chat_template)
    D.init_distributed()  # after the data checks: bad data fails without starting a process group
    model = load_causal_lm(config.model, zero3_config=engine_config(config))
    pad_id = base_model(model).config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id
    use_fused = config.trainer.fused_loss and config.deepspeed.zero_stage != 3

    def loss_fn(engine, micro_batch):
        batch = collate_sft(micro_batch, pad_id)
        loss = sft_loss(engine, batch, use_fused, config.trainer.loss_chunk_size, config.trainer.loss_chunk_bytes)
        return loss, {"response_tokens": float(batch["loss_mask"].sum())}

    return run_supervised(config, SupervisedJob(examples, model, loss_fn, bar_keys=("loss",)), resume=resume)
