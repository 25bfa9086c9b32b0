"""Pretraining stand-in of the tools example: whole episodes, the full vocabulary's loss at a small vocabulary's
cost (``examples.arithmetic.pretrain.full_vocab_log_softmax``: the padded rows tied to one trained vector).

Each episode is tokenized as the rollout builds it (``fastrlhf.rollout.episodes``): the prompt through the chat
template, each assistant turn's text + eos, and between them the template's tool turn (``TurnTemplate``); the
loss covers the assistant turns only. The tools' system turn costs ~200 of an episode's ~320 tokens, so 3 of 4
batches leave it out (its turns are the same text, and ``fastrlhf sft`` after this stage sees it always): the
model learns the task at a third of the cost, and the system turn is no stranger to it.
"""

from __future__ import annotations

import json
import os
import random
import time

__all__ = ["episode_tokens", "pretrain"]


def episode_tokens(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of a chat as an episode: mask 1 on the assistant turns' tokens (their eos included)."""
    from fastrlhf.rollout.episodes import TurnTemplate

    template = TurnTemplate(tokenizer, tools or [], say=None)

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    tokens = ids(template.render(messages[:first], True))
    mask = [0] * len(tokens)
    eos = tokenizer.eos_token_id
    i = first
    while i < len(messages):
        turn = ids(messages[i]["content"]) + [eos]
        tokens += turn
        mask += [1] * len(turn)
        results = []
        i += 1
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        if results:
            between = template.between(results, tokenizer.convert_ids_to_tokens(eos))
            tokens += between
            mask += [0] * len(between)
    return tokens, mask


def pretrain(init_dir: str, data_path: str, out_dir: str, steps: int, tools: list[dict] | None, batch_size: int = 32,
             lr: float = 1e-3, warmup_steps: int = 20, with_tools_every: int = 4, seed: int = 0,
             log_every: int = 10) -> dict:
    """Train ``init_dir``'s model on the episodes of ``data_path`` and save it to ``out_dir/final``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.arithmetic.pretrain import full_vocab_log_softmax, save_full_vocab_model

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    full_rows, rows = model.get_input_embeddings().weight.shape[0], len(tokenizer)
    with open(data_path) as f:
        chats = [json.loads(line)["messages"] for line in f]
    # Tokenized when first drawn: a short run (the tests' 3 steps) reads 96 of the file's episodes, not all of them.
    cache: dict[tuple[int, bool], tuple[list[int], list[int]]] = {}

    def episode(i: int, with_tools: bool) -> tuple[list[int], list[int]]:
        key = (i, with_tools and bool(tools))
        if key not in cache:
            cache[key] = episode_tokens(tokenizer, chats[i], tools if key[1] else None)
        return cache[key]

    with torch.no_grad():
        padded = model.get_input_embeddings().weight[rows:].mean(0).clone()
    model.resize_token_embeddings(rows, mean_resizing=False)
    u = torch.nn.Parameter(padded)
    body, emb = model.get_decoder(), model.get_input_embeddings()
    params = [*model.parameters(), u]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)) * max(0.1, 1 - s / steps))
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    started = time.perf_counter()
    model.train()
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as log:
        for step in range(1, steps + 1):
            with_tools = step % with_tools_every == 0
            batch = [episode(i, with_tools) for i in rng.sample(range(len(chats)), batch_size)]
            width = max(len(t) for t, _ in batch)
            ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
            attention = torch.zeros((batch_size, width), dtype=torch.long)
            target = torch.zeros((batch_size, width), dtype=torch.bool)  # positions whose NEXT token is trained
            for i, (t, m) in enumerate(batch):
                ids[i, :len(t)] = torch.tensor(t)
                attention[i, :len(t)] = 1
                target[i, :len(t) - 1] = torch.tensor(m[1:], dtype=torch.bool)
            hidden = body(input_ids=ids, attention_mask=attention).last_hidden_state[target]
            labels = ids[:, 1:][target[:, :-1]]
            logp = full_vocab_log_softmax(hidden, emb.weight, u, full_rows - rows)
            loss = -logp.gather(1, labels[:, None]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            if step % log_every == 0 or step == steps:
                log.write(json.dumps({"step": step, "loss": loss.item(), "wall_time": time.perf_counter() - started})
                          + "\n")
                log.flush()

    save_full_vocab_model(init_dir, model, u, tokenizer, out_dir)
    return {"steps": steps, "loss": loss.item(), "seconds": round(time.perf_counter() - started, 1)}
