"""Pretraining stand-in: the random-init Qwen2 model learns the task's language and arithmetic from the
SFT chats, cheaply and exactly, before the real ``fastrlhf sft`` and ``fastrlhf train`` stages.

Why not ``fastrlhf sft`` from the start: 97% of the model's weights and nearly all of its training FLOPs
are the tied 151,936-row LM head, of which the tokenizer uses the first ~460 rows. On 2 CPU cores a
full-vocabulary step costs seconds, and the model needs ~800 steps to learn the task (measured:
~50 minutes). Training only the first rows (a small-vocabulary twin) is ~30x cheaper but leaves the
other 151,424 rows at their random init, where they hold ~45% of the probability mass: a sampled
completion of 20 tokens then almost surely contains a token the tokenizer cannot make, and a short
full-vocabulary SFT that pushes them down wrecks what the twin learned (measured: 64% -> 30% greedy
accuracy for 1.3% mass left).

So this loop keeps the full vocabulary's softmax exactly, at the twin's cost: the padded rows are
tied to ONE trained vector ``u``, so their 151,424 logits are one logit ``h . u`` counted 151,424
times, i.e. the extra logit ``h . u + ln(151424)`` beside the first rows'. The loss is the full
model's cross-entropy (on the answer tokens, as ``fastrlhf sft``), and the saved model is the
ordinary 151,936-row Qwen2 with every padded row set to ``u``.
"""

from __future__ import annotations

import json
import math
import os
import random
import time

__all__ = ["full_vocab_log_softmax", "pretrain", "save_full_vocab_model"]


def full_vocab_log_softmax(hidden, rows_weight, padded_row, padded_count: int):
    """Log-probabilities ``[N, rows + 1]`` under the full vocabulary whose last ``padded_count`` rows all
    equal ``padded_row``: the first ``rows`` tokens', then the padded rows' total (``h . u + ln count``).
    Exact: the full model's log-softmax over ``rows + padded_count`` logits gives the same values."""
    import torch

    logits = torch.cat([hidden @ rows_weight.T, (hidden @ padded_row + math.log(padded_count))[:, None]], dim=-1)
    return logits.log_softmax(-1)


def save_full_vocab_model(init_dir: str, model, padded_row, tokenizer, out_dir: str) -> None:
    """``out_dir/final``: the ordinary full-vocabulary model of ``init_dir``'s shape, with ``model``'s trained
    weights (its first rows of the tied embedding) and ``padded_row`` in every padded row (written beside, then
    renamed into place)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    rows = model.get_input_embeddings().weight.shape[0]
    full = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    with torch.no_grad():
        weight = full.get_input_embeddings().weight
        weight[:rows] = model.get_input_embeddings().weight
        weight[rows:] = padded_row
        trained = model.state_dict()
        for name, param in full.state_dict().items():
            if param.shape == trained[name].shape:
                param.copy_(trained[name])
    tmp = os.path.join(out_dir, "final.tmp")
    full.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    final = os.path.join(out_dir, "final")
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)


def pretrain(init_dir: str, data_path: str, out_dir: str, steps: int = 2000, batch_size: int = 32, lr: float = 1e-3,
             warmup_steps: int = 20, max_grad_norm: float = 1.0, seed: int = 0, log_every: int = 10) -> dict:
    """Train ``init_dir``'s model on ``data_path`` (chats) and save it to ``out_dir``; returns a summary.

    Writes ``<out_dir>/metrics.jsonl`` (``step``, ``loss``, ``padded_mass``: the mean probability of the
    padded rows at the answer tokens) as it goes.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastrlhf.data import load_sft_examples

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    full_rows = model.get_input_embeddings().weight.shape[0]
    rows = len(tokenizer)  # every id the tokenizer makes is below this
    # The chats tokenized exactly as `fastrlhf sft` reads them (template, response + EOS); every id
    # must be one of the first `rows` (the loader names the line of one that is not).
    examples = [(e.prompt_ids, e.response_ids) for e in load_sft_examples(
        data_path, model.config.max_position_embeddings, vocab_size=rows, tokenizer_path=init_dir, chat_template=True)]

    with torch.no_grad():
        padded = model.get_input_embeddings().weight[rows:].mean(0).clone()
    model.resize_token_embeddings(rows, mean_resizing=False)  # the first rows, tied again
    u = torch.nn.Parameter(padded)
    body, emb = model.get_decoder(), model.get_input_embeddings()
    params = [*model.parameters(), u]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
    pad_id = tokenizer.pad_token_id
    rng = random.Random(seed)
    order: list[int] = []
    os.makedirs(out_dir, exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    started = time.perf_counter()
    model.train()
    with open(metrics_path, "w") as log:
        for step in range(1, steps + 1):
            if len(order) < batch_size:  # epoch shuffles, as fastrlhf's sampler
                more = list(range(len(examples)))
                rng.shuffle(more)
                order += more
            batch = [examples[i] for i in order[:batch_size]]
            del order[:batch_size]
            width = max(len(p) + len(r) for p, r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            target = torch.zeros((len(batch), width), dtype=torch.bool)  # positions whose NEXT token is an answer token
            for i, (p, r) in enumerate(batch):
                ids[i, :len(p) + len(r)] = torch.tensor(p + r)
                mask[i, :len(p) + len(r)] = 1
                target[i, len(p) - 1:len(p) + len(r) - 1] = True
            hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state[target]  # [N, H]
            labels = ids[:, 1:][target[:, :-1]]
            logp = full_vocab_log_softmax(hidden, emb.weight, u, full_rows - rows)
            loss = -logp.gather(1, labels[:, None]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            scheduler.step()
            if step % log_every == 0 or step == steps:
                record = {"step": step, "loss": loss.item(), "padded_mass": logp[:, -1].exp().mean().item(),
                          "lr": scheduler.get_last_lr()[0], "wall_time": time.perf_counter() - started}
                log.write(json.dumps(record) + "\n")
                log.flush()

    save_full_vocab_model(init_dir, model, u, tokenizer, out_dir)
    return {"steps": steps, "loss": loss.item(), "seconds": time.perf_counter() - started}


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(pretrain(args.init, args.data, args.out, args.steps, args.batch_size, args.lr, seed=args.seed))


if __name__ == "__main__":
    main()
