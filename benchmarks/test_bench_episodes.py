"""Multi-turn tool-use episodes (fastrlhf.rollout.episodes) against single-turn rows of the same length, on both
engines, side by side in one run.

Workload: the tiny chat model's Qwen2 shape (2 layers, hidden 128, head size 32) with 1,024 vocabulary rows (so that
the random model's turns end at the stop ids below: over 151,936 rows it samples ids no stop list holds), fp32; 16
chat prompts with one tool in the system turn (~230 tokens) x n=4, temperature 1. Every turn calls the tool (a
parser that reads a call in any turn: a random model writes none), turns end at any of a third of the vocabulary's
ids, at most 3 turns and 48 generated tokens per episode. The single-turn baseline then generates, for each episode,
one completion of exactly that episode's generated-token count from the same prompt (eos ignored). Reported:
episodes/s and generated tokens/s of each, the ratio, rounds per step and, for vLLM, the share of resubmitted tokens
its prefix cache served.
"""

from __future__ import annotations

import os

import pytest

from fastrlhf.rollout import HFEngine, SamplingConfig
from fastrlhf.rollout.episodes import EpisodeRunner
from fastrlhf.rollout.tools import ToolCall, load_toolbox, register_tool_call_parser

NUM_PROMPTS, N, BUDGET, MAX_TURNS, ROUNDS, VOCAB_ROWS = 16, 4, 48, 3, 3, 1024
_results: dict[tuple[str, str], dict] = {}


@register_tool_call_parser("bench-every-turn")
def _every_turn(text: str) -> list[ToolCall]:
    return [ToolCall("calculator", {"expression": f"{len(text)} * 3"})]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from fastrlhf.modeling.tiny_chat import build_chat_model, build_chat_tokenizer, save_chat_model

    tokenizer = build_chat_tokenizer()
    model = build_chat_model(tokenizer, seed=0, vocab_rows=VOCAB_ROWS).float().eval()
    path = tmp_path_factory.mktemp("bench_episodes") / "chat"
    save_chat_model(path, model, tokenizer)
    return str(path), model, tokenizer


@pytest.fixture(scope="module")
def engines(chat_model):
    path, model, tokenizer = chat_model
    built = {"hf": HFEngine(model, max_model_len=1024, tokenizer=tokenizer)}
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        from fastrlhf.rollout import VLLMEngine

        saved = os.environ.pop("TRITON_INTERPRET", None)
        built["vllm"] = VLLMEngine(path, dtype="float32", max_model_len=1024, kv_cache_bytes=256 << 20,
                                   tokenizer=tokenizer)
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    yield built
    for engine in built.values():
        engine.close()


def _prompts(tokenizer, toolbox):
    questions = [f"What is {1000 + 37 * i} * {2000 + 53 * i}? Use the calculator." for i in range(NUM_PROMPTS)]
    return [list(tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tools=toolbox.schemas,
                                                         tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]) for q in questions]


@pytest.mark.parametrize("mode", ["episodes", "single-turn"])
@pytest.mark.parametrize("engine_kind", ["hf", "vllm"])
def test_episode_rate_against_single_turn_rows(benchmark, chat_model, engines, engine_kind, mode):
    if engine_kind not in engines:
        pytest.skip("vllm is not installed")
    _, _, tokenizer = chat_model
    engine = engines[engine_kind]
    toolbox = load_toolbox(["examples.tools.calculator:calculator"], parser="bench-every-turn")
    prompts = _prompts(tokenizer, toolbox)
    sampling = SamplingConfig(n=N, temperature=1.0, max_new_tokens=BUDGET, seed=0,
                              stop_token_ids=tuple(range(4, VOCAB_ROWS, 3)))
    runner = EpisodeRunner(engine, toolbox, tokenizer, MAX_TURNS, say=None)
    if mode == "episodes":
        episodes = benchmark.pedantic(runner.generate, args=(prompts, sampling), rounds=ROUNDS, iterations=1)
        flat = [c for samples in episodes for c in samples]
        generated = sum(sum(c.mask) for c in flat)
        _results[(engine_kind, "lengths")] = [sum(c.mask) for c in flat]
        info = {"turns_per_episode": round(runner.metrics["tools/turns"], 2),
                "tool_tokens_per_episode": round(sum(len(c.mask) - sum(c.mask) for c in flat) / len(flat), 1)}
        if "tools/prefix_cache_hit" in runner.metrics:
            info["prefix_cache_hit"] = round(runner.metrics["tools/prefix_cache_hit"], 3)
    else:
        lengths = _results.get((engine_kind, "lengths"))
        if lengths is None:
            pytest.skip("runs after the episodes case of the same engine (its lengths)")
        rows = [p for p in prompts for _ in range(N)]
        single = SamplingConfig(n=1, temperature=1.0, max_new_tokens=max(lengths), seed=0, ignore_eos=True)
        benchmark.pedantic(engine.generate, args=(rows, single), kwargs={"limits": lengths}, rounds=ROUNDS,
                           iterations=1)
        generated, info = sum(lengths), {}
    seconds = benchmark.stats.stats.median
    rate = {"episodes_per_s": round(NUM_PROMPTS * N / seconds, 2), "tokens_per_s": round(generated / seconds, 1),
            "generated_tokens": generated}
    _results[(engine_kind, mode)] = rate
    benchmark.extra_info.update(rate, **info)
    if mode == "single-turn":
        episodes = _results[(engine_kind, "episodes")]
        benchmark.extra_info["single_turn_over_episode_rate"] = round(
            rate["episodes_per_s"] / episodes["episodes_per_s"], 3)
