"""``fastrlhf sft``: supervised fine-tuning, next-token loss on the trained response tokens only (a
response's own tokens, or a chat's assistant turns)."""

from __future__ import annotations

import torch

from fastrlhf import distributed as D
from fastrlhf.algorithms import logprobs_from_logits, masked_sum, nll_loss
from fastrlhf.config import SFTConfig
from fastrlhf.data import SFTExample, check_same_data, load_sft_examples
from fastrlhf.engine.device import model_device, to_device
from fastrlhf.modeling import base_model, load_causal_lm, unwrap, use_attention, vocab_size
from fastrlhf.supervised import SupervisedJob, engine_config, run_supervised, seed_everything

__all__ = ["build_job", "collate_sft", "load_eval_examples", "load_examples", "packed_response_logprobs", "sft_loss",
           "sft_token_parts", "run"]


def collate_sft(examples: list[SFTExample], pad_id: int) -> dict:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (1 on trained response tokens), on
    the host (:func:`fastrlhf.engine.device.to_device` takes them to the model)."""
    length = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.float32)
    for row, e in enumerate(examples):
        p, r = len(e.prompt_ids), len(e.response_ids)
        input_ids[row, :p + r] = torch.tensor(e.prompt_ids + e.response_ids)
        attention_mask[row, :p + r] = 1
        loss_mask[row, p:p + r] = 1.0 if e.response_mask is None else torch.tensor(e.response_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def response_logprobs(engine, batch: dict, use_fused: bool = True, chunk_size=None, chunk_bytes=None) -> torch.Tensor:
    """Log-probability of each next token, ``[B, T-1]`` fp32.

    The fused path runs the LM head chunk by chunk on the final hidden states, so the
    ``[B, T, vocab]`` logits never exist; under ZeRO-3 the head weight is a partition, so the
    model's own forward (whose hooks gather it) is used instead.
    """
    from fastrlhf.modeling.heads import fused_logprob_head
    from fastrlhf.rl.forward import attention_mask_for

    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    labels = input_ids[:, 1:]
    attention_mask = attention_mask_for(engine, attention_mask)  # built here, not found by a device read
    if use_fused:
        model = base_model(unwrap(engine))
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     use_cache=False).last_hidden_state
        head = model.get_output_embeddings()
        with fused_logprob_head(head, chunk_size=chunk_size, chunk_bytes=chunk_bytes):
            return head(hidden[:, :-1], labels)[0]
    return logprobs_from_logits(engine(input_ids=input_ids, attention_mask=attention_mask,
                                       use_cache=False).logits[:, :-1], labels)


def sft_loss(engine, batch: dict, use_fused: bool = True, chunk_size=None, chunk_bytes=None,
             scale: float | None = None) -> torch.Tensor:
    """Mean negative log-likelihood over response tokens (prompt and padding masked out); with
    ``scale``, ``scale`` x their sum instead (a micro-batch's share of a larger batch's mean)."""
    logprobs, mask = response_logprobs(engine, batch, use_fused, chunk_size, chunk_bytes), batch["loss_mask"][:, 1:]
    if scale is None:
        return nll_loss(logprobs, mask)
    return -masked_sum(logprobs, mask) * scale


def _predicted(e: SFTExample) -> tuple[list[int], list[int]]:
    """(context, predicted tokens) of an example: the response, except a first response token that
    no prompt token precedes (as in the padded layout, where nothing predicts position 0)."""
    if e.prompt_ids:
        return e.prompt_ids, e.response_ids
    return e.response_ids[:1], e.response_ids[1:]


def _trained(e: SFTExample) -> list[int]:
    """1 per predicted token of :func:`_predicted` that the loss trains."""
    mask = [1] * len(e.response_ids) if e.response_mask is None else e.response_mask
    return mask if e.prompt_ids else mask[1:]


def packed_response_logprobs(engine, examples: list[SFTExample], use_fused: bool = True, chunk_size=None,
                             chunk_bytes=None) -> torch.Tensor:
    """``[M]`` fp32 log-probabilities of the examples' response tokens, all examples packed in one row
    (``fastrlhf.sequences.packing.PackedLayout``: positions restart per example, no padding, no attention
    across examples). The LM head runs on the ``[M, H]`` hidden states that predict response tokens,
    called as a module (so under ZeRO-3 its weight is gathered for the fused kernel too)."""
    from fastrlhf.modeling.heads import fused_logprob_head
    from fastrlhf.rl.forward import body_and_head, check_segments
    from fastrlhf.sequences.packing import PackedLayout

    device = model_device(engine)
    split = [_predicted(e) for e in examples]
    layout = PackedLayout.build([len(c) for c, _ in split], [len(r) for _, r in split], device=device)
    input_ids, labels = to_device((torch.tensor([t for c, r in split for t in c + r], dtype=torch.long)[None],
                                   torch.tensor([t for _, r in split for t in r], dtype=torch.long)), device)
    body, head = body_and_head(engine)
    check_segments(body, inputs := layout.model_kwargs())
    hidden = body(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state
    hidden = hidden[0, layout.hidden_index]
    if use_fused:
        with fused_logprob_head(head, chunk_size=chunk_size, chunk_bytes=chunk_bytes):
            return head(hidden, labels)[0]
    return logprobs_from_logits(head(hidden), labels)


def sft_token_parts(e: SFTExample, packed: bool) -> tuple[int, ...]:
    """Tokens an example costs a micro-batch: its own when packed; right-padded, prompt and response
    share one width."""
    return (len(e.prompt_ids), len(e.response_ids)) if packed else (len(e.prompt_ids) + len(e.response_ids),)


def build_job(config: SFTConfig, model, examples: list[SFTExample],
              eval_examples: list[SFTExample] | None = None) -> SupervisedJob:
    """The SFT loss over ``examples`` for :func:`fastrlhf.supervised.run_supervised` (``model``: loaded;
    ``eval_examples``: the held-out ones of ``data.eval_path``)."""
    pad_id = base_model(model).config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id
    t = config.trainer
    # Padded, the fused head reads lm_head.weight directly, which ZeRO-3 partitions; packed, the head
    # is called as a module (its hooks gather the weight), so the fused kernel runs at every stage.
    use_fused = t.fused_loss and (t.packing or config.deepspeed.zero_stage != 3)

    def loss_fn(engine, micro_batch, scale):
        trained = [_trained(e) for e in micro_batch]
        tokens = float(sum(map(sum, trained)))
        if t.packing:
            logprobs = packed_response_logprobs(engine, micro_batch, use_fused, t.loss_chunk_size, t.loss_chunk_bytes)
            if all(e.response_mask is None for e in micro_batch):
                return -logprobs.sum() * scale, {"response_tokens": tokens}
            mask = to_device(torch.tensor([m for each in trained for m in each], dtype=logprobs.dtype), logprobs.device)
            return -masked_sum(logprobs, mask) * scale, {"response_tokens": tokens}
        batch = to_device(collate_sft(micro_batch, pad_id), model_device(engine))
        loss = sft_loss(engine, batch, use_fused, t.loss_chunk_size, t.loss_chunk_bytes, scale=scale)
        return loss, {"response_tokens": tokens}

    # The loss is the mean over the rank's step batch of its response tokens' negative log-likelihood.
    return SupervisedJob(examples, model, loss_fn, bar_keys=("loss",), weight_of=lambda e: sum(_trained(e)),
                         token_parts=sft_token_parts, eval_examples=eval_examples, perplexity=True)


def load_examples(config: SFTConfig, path: str | None = None) -> list:
    """The SFT data of ``config`` (``data.path``, or ``path`` in its format), read and checked before any model
    loads (``--dry-run`` reads it so too)."""
    from fastrlhf.config import ConfigError
    from fastrlhf.rollout.tools import load_toolbox

    d = config.data
    try:
        tools = load_toolbox(d.tools, key="data.tools").schemas if d.tools else None
    except ValueError as exc:
        raise ConfigError("", str(exc)) from None
    return load_sft_examples(path or d.path, d.max_len, d.max_prompt_len, vocab_size=vocab_size(config.model.path),
                             tokenizer_path=config.model.path, chat_template=d.chat_template, tools=tools,
                             assistant_turns=d.assistant_turns, chat_template_kwargs=d.chat_template_kwargs,
                             overlong=d.overlong)


def load_eval_examples(config: SFTConfig) -> list | None:
    """``data.eval_path``'s examples, read and checked as ``data.path``'s (None without one)."""
    return load_examples(config, config.data.eval_path) if config.data.eval_path else None


def run(config: SFTConfig, resume: bool = False) -> dict:
    seed_everything(config.seed)
    examples, eval_examples = load_examples(config), load_eval_examples(config)
    # After the data checks: bad data fails without starting a process group.
    D.init_distributed(shared_dir=config.output_dir)
    check_same_data()  # every node read the same copy: before any model loads
    model = load_causal_lm(config.model, zero3_config=engine_config(config))
    use_attention(model, config.trainer.packing, backend=config.model.attention)
    return run_supervised(config, build_job(config, model, examples, eval_examples), resume=resume)
