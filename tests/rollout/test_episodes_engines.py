"""Episodes on the real engines: greedy episodes of HFEngine and VLLMEngine are identical token for token
(tiny Qwen2 chat model, fp32), and vLLM's prefix cache serves a continued episode's history."""

from __future__ import annotations

import os

import pytest
import torch

from fastrlhf.rollout import HFEngine, SamplingConfig
from fastrlhf.rollout.episodes import EpisodeRunner
from fastrlhf.rollout.tools import ToolCall, load_toolbox, register_tool_call_parser

pytestmark = pytest.mark.slow

H = "tests.helpers.tool_fixtures"


@register_tool_call_parser("test-every-turn")
def every_turn_calls_add(text: str) -> list[ToolCall]:
    """A random model writes no tool call: this parser reads one in every turn, so that episodes run their
    turns on a real engine (a registered parser for another format is read the same way)."""
    return [ToolCall("add", {"a": len(text), "b": 1})]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from fastrlhf.modeling.tiny_chat import build_chat_model, build_chat_tokenizer, save_chat_model

    tokenizer = build_chat_tokenizer()
    # Head size 32 (one vLLM-CPU runs); a wide init gives peaked distributions: greedy never hinges on noise.
    model = build_chat_model(tokenizer, seed=0, vocab_rows=640, hidden_size=64, intermediate_size=128,
                             num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                             initializer_range=0.2).float().eval()
    path = tmp_path_factory.mktemp("episodes") / "chat"
    save_chat_model(path, model, tokenizer)
    return str(path), model, tokenizer


@pytest.fixture(scope="module")
def vllm_engine(chat_model):
    pytest.importorskip("vllm")
    saved = os.environ.pop("TRITON_INTERPRET", None)  # the kernel tests' interpreter must not reach vLLM
    from fastrlhf.rollout import VLLMEngine

    path, _, tokenizer = chat_model
    # Whatever else vLLM-CPU leaves in this process's environment goes with the fixture.
    environment = dict(os.environ)
    engine = VLLMEngine(path, dtype="float32", max_model_len=1024, kv_cache_bytes=32 << 20, tokenizer=tokenizer)
    ENGINE_START_ENV.update(before=environment, after=dict(os.environ))
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
    yield engine
    engine.close()
    os.environ.clear()
    os.environ.update(environment)
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved


ENGINE_START_ENV: dict[str, dict] = {}


def test_starting_the_vllm_engine_leaves_the_rendezvous_variables_as_it_found_them(vllm_engine):
    """vLLM-CPU writes LOCAL_WORLD_SIZE (and MASTER_PORT) as it starts; the engine puts back what the launcher set
    (a later test that sets WORLD_SIZE read a leaked LOCAL_WORLD_SIZE as one rank of several nodes; a trainer's
    memory plan would read its ranks per node)."""
    from fastrlhf.rollout.vllm_engine import _RENDEZVOUS_ENV

    before, after = ENGINE_START_ENV["before"], ENGINE_START_ENV["after"]
    assert {k: after.get(k) for k in _RENDEZVOUS_ENV} == {k: before.get(k) for k in _RENDEZVOUS_ENV}


def prompts_for(tokenizer, toolbox, questions):
    return [list(tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tools=toolbox.schemas,
                                                         tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"]) for q in questions]


# Long questions: prompts of several 128-token cache blocks, which the prefix cache serves when resubmitted.
QUESTIONS = ["What is 12 plus 30? " * 25, "Add 7 and 8, please. " * 30, "Sum 1 and 2." * 3]


def test_greedy_episodes_of_hf_and_vllm_are_identical_and_vllm_serves_the_history_from_its_cache(
        chat_model, vllm_engine):
    _, model, tokenizer = chat_model
    toolbox = load_toolbox([f"{H}:add"], parser="test-every-turn")
    prompts = prompts_for(tokenizer, toolbox, QUESTIONS)
    # Turns end at any even token id: short, uneven turns, so episodes take several rounds.
    greedy = SamplingConfig(temperature=0, max_new_tokens=40, stop_token_ids=tuple(range(4, 640, 2)))
    hf = EpisodeRunner(HFEngine(model, max_model_len=1024, tokenizer=tokenizer), toolbox, tokenizer, 4, say=None)
    vllm = EpisodeRunner(vllm_engine, toolbox, tokenizer, 4, say=None)
    hf_episodes, vllm_episodes = hf.generate(prompts, greedy), vllm.generate(prompts, greedy)
    flat = lambda results: [c for samples in results for c in samples]  # noqa: E731
    assert [c.token_ids for c in flat(hf_episodes)] == [c.token_ids for c in flat(vllm_episodes)]
    assert [c.mask for c in flat(hf_episodes)] == [c.mask for c in flat(vllm_episodes)]
    assert all(c.extra["turns"] >= 2 for c in flat(hf_episodes))  # tool turns did happen
    assert hf.metrics["tools/calls"] == vllm.metrics["tools/calls"] >= 3
    # The engines' logprobs of the policy's tokens agree as on single-turn rows.
    for h, v in zip(flat(hf_episodes), flat(vllm_episodes), strict=True):
        diff = [abs(a - b) for a, b, m in zip(h.logprobs, v.logprobs, h.mask, strict=True) if m]
        assert max(diff) < 1e-3
    # Resubmitted episodes: most of what vLLM received again came from its prefix cache.
    assert vllm.metrics["tools/prefix_cache_hit"] > 0.5
    assert "tools/prefix_cache_hit" not in hf.metrics


def test_trainer_logprobs_on_episode_tokens_match_the_engines(chat_model, vllm_engine):
    """The mismatch probe's quantity on episodes: actor logprobs of the policy's tokens vs the engine's."""
    from fastrlhf.algorithms import masked_mean
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.forward import sequence_logprobs

    _, model, tokenizer = chat_model
    toolbox = load_toolbox([f"{H}:add"], parser="test-every-turn")
    prompts = prompts_for(tokenizer, toolbox, QUESTIONS[2:] * 2)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=30, stop_token_ids=tuple(range(4, 640, 2)),
                              seed=5)
    episodes = EpisodeRunner(vllm_engine, toolbox, tokenizer, 3, say=None).generate(prompts, sampling)
    single = vllm_engine.generate(prompts, sampling)  # single-turn rows of the same prompts

    def mismatch(completions):
        exp = build_experience(prompts, completions, tokenizer.pad_token_id)
        with torch.no_grad():
            actor, _ = sequence_logprobs(model, exp, temperature=1.0, micro_batch=4)
        return exp, float(masked_mean((actor - exp.engine_logprobs).abs(), exp.response_mask))

    exp, on_episodes = mismatch(episodes)
    assert (exp.response_mask == 0).any() and (exp.response_mask == 1).any()
    _, on_single_turns = mismatch(single)
    # fp32 on both sides: the same reduction-order noise (~1e-6), episodes no worse than single turns.
    assert on_episodes < max(4 * on_single_turns, 1e-5), (on_episodes, on_single_turns)


def test_a_seeded_batch_longer_than_one_prefill_step_samples_on_vllm_cpu(vllm_engine):
    """Episodes resubmit long histories with a seed each: 24 prompts of 400 tokens are more than one step's
    prefill budget. vLLM-CPU's chunked prefill would rewind a seeded generator with a CUDA-only call and
    crash ("CPU Generator does not use offset"); the CPU engine runs without it."""
    prompts = [[5 + (i * j) % 600 for j in range(400)] for i in range(24)]
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=3)
    first = vllm_engine.generate(prompts, sampling)
    again = vllm_engine.generate(prompts, sampling)
    assert [[c.token_ids for c in s] for s in first] == [[c.token_ids for c in s] for s in again]
    seeded = vllm_engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=4), seeds=list(range(24)))
    assert len(seeded) == 24 and all(len(c.token_ids) == 4 for (c,) in seeded)
