"""Greedy episodes on the held-out questions with the HF engine: accuracy (strict ``The answer is N``), tool calls
per episode, and sample episodes. The same loop the trainer runs (``fastrlhf.rollout.episodes``)."""

from __future__ import annotations

import json

__all__ = ["evaluate"]


def evaluate(model_dir: str, val_path: str, with_tools: bool, max_new_tokens: int = 64, max_turns: int = 3,
             samples: int = 3, limit: int | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.tools.data import CALCULATOR
    from examples.tools.reward import correctness
    from fastrlhf.rollout import HFEngine, SamplingConfig
    from fastrlhf.rollout.episodes import EpisodeRunner
    from fastrlhf.rollout.tools import Toolbox, load_toolbox

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with open(val_path) as f:
        rows = [json.loads(line) for line in f][:limit]
    toolbox = load_toolbox([CALCULATOR]) if with_tools else Toolbox()
    prompts = [list(tokenizer(tokenizer.apply_chat_template(r["messages"], tools=toolbox.schemas or None,
                                                            tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)["input_ids"]) for r in rows]
    runner = EpisodeRunner(HFEngine(model, max_model_len=model.config.max_position_embeddings, tokenizer=tokenizer),
                           toolbox, tokenizer, max_turns if with_tools else 1, say=None)
    greedy = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens)
    episodes = [samples_[0] for i in range(0, len(prompts), 50)
                for samples_ in runner.generate(prompts[i:i + 50], greedy)]
    calls = sum(e.extra["tool_calls"] for e in episodes)
    rewards = correctness(None, [e.extra["messages"] for e in episodes], None, [r["answer"] for r in rows])
    shown = [{"question": r["messages"][-1]["content"], "answer": r["answer"], "correct": bool(ok),
              "episode": tokenizer.decode(e.token_ids, skip_special_tokens=False)}
             for r, e, ok in list(zip(rows, episodes, rewards, strict=True))[:samples]]
    return {"accuracy": sum(rewards) / len(rows), "questions": len(rows), "tool_calls_per_episode": calls / len(rows),
            "samples": shown}
