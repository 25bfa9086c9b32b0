"""The HF engine's context and generation on a GPU's terms: sequences within the model's positions, rows that end at
their own limits, and the packed attention's reads of the device during generation."""

import collections
import os

import pytest
import torch
import yaml
from helpers.model_folders import fake_model_folder
from helpers.other_device import OtherDevice

from fastrlhf.modeling import use_attention
from fastrlhf.modeling.tiny import make_tiny_qwen2
from fastrlhf.rollout.hf_engine import HFEngine
from fastrlhf.rollout.sampling import SamplingConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _small_positions_model(kind: str):
    """A one-layer model of 32 positions: rotary (Qwen2) or a learned position table (GPT-2)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=32,
                eos_token_id=63,
            )
        ).eval()
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32, bos_token_id=62, eos_token_id=63)
    ).eval()


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_the_hf_engine_generates_within_the_models_positions(kind):
    """A tool run sizes the engine's context as prompt + new + tool tokens (``memory.components.seq_len``), which the
    config checks let past the model's positions for the HF engine. Generation then ran on past them: a rotary
    model's episode reached 50 tokens on 32 positions, silently; a learned position table raised IndexError (a
    device-side assert on CUDA). The engine's context is now the model's positions at most."""
    engine = HFEngine(_small_positions_model(kind), max_model_len=64)
    assert engine.max_model_len == 32
    ((completion,),) = engine.generate([[1] * 30], SamplingConfig(max_new_tokens=20, ignore_eos=True, seed=0))
    assert len(completion.token_ids) == 2 and completion.finish_reason == "length"
    # A context within the positions stays as given.
    assert HFEngine(_small_positions_model(kind), max_model_len=24).max_model_len == 24


def test_the_tools_example_fits_its_models_positions_on_every_engine(tmp_path):
    """examples/tools/grpo.yaml asked for 300 + 64 + 256 (max_tool_tokens' default) = 620 tokens of a model with 512
    positions: accepted with rollout.engine hf only, refused at load with vllm or auto."""
    from examples.tools.model import SHAPE
    from fastrlhf.config import parse_config

    raw = yaml.safe_load(open(os.path.join(ROOT, "examples", "tools", "grpo.yaml")))
    (tmp_path / "p.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}], "answer": "1"}\n')
    folder = fake_model_folder(tmp_path / "model", {"model_type": "qwen2", "vocab_size": 1024, **SHAPE})
    raw["model"]["path"], raw["output_dir"] = folder, str(tmp_path / "out")
    raw["data"]["prompts"] = raw["eval"]["data"] = str(tmp_path / "p.jsonl")
    for engine in ("hf", "vllm"):
        config = parse_config({**raw, "rollout": {**raw["rollout"], "engine": engine}}, "train", on_gpu=False)
        ro = config.rollout
        assert config.data.max_prompt_len + ro.max_new_tokens + ro.max_tool_tokens <= SHAPE["max_position_embeddings"]


def _counting_forwards(model):
    calls = []
    return calls, model.register_forward_hook(lambda *args: calls.append(1))


def test_rows_end_at_their_own_limits():
    """An episode's rows come with their own limits (its remaining budget, its context); HF's ``max_new_tokens`` is
    the largest. A row at its limit that had not stopped kept the batch decoding up to the largest limit, every
    token of it cut afterwards: here 8 forward passes where one gives the same completions."""
    model = make_tiny_qwen2(seed=0, vocab_size=64, hidden_size=32, num_heads=2)
    engine = HFEngine(model)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    free = engine.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True))
    first, second = free[0][0].token_ids, free[1][0].token_ids
    assert second[0] not in first  # the second row stops at its first token, the first row never does
    greedy = SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True, stop_token_ids=(second[0],))
    calls, hook = _counting_forwards(model)
    try:
        out = engine.generate(prompts, greedy, limits=[1, 8])
    finally:
        hook.remove()
    assert [(c.token_ids, c.finish_reason) for (c,) in out] == [(first[:1], "length"), (second[:1], "stop")]
    assert len(calls) == 1
    # Sampled with n per prompt: each prompt's limit holds for each of its rows.
    sampled = engine.generate(prompts, SamplingConfig(n=3, max_new_tokens=8, ignore_eos=True, seed=0), limits=[2, 5])
    assert [[len(c.token_ids) for c in row] for row in sampled] == [[2] * 3, [5] * 3]


def test_an_unpadded_prefill_reads_the_sequence_bounds_once_per_forward():
    """HF generate's prefill of prompts without padding reaches the packed attention with position ids and no mask;
    each layer read the sequence bounds from the device (a nonzero, then its indices: 8 stalls on 4 layers, 56 on
    Qwen2-1.5B's 28). One read per forward now, whatever the depth."""
    reads_by_depth = {}
    for layers in (2, 4):
        model = make_tiny_qwen2(seed=0, vocab_size=64, hidden_size=32, num_heads=2, num_layers=layers)
        use_attention(model, True, False, "sdpa")
        with OtherDevice() as dev:
            engine = HFEngine(dev.move(model))
            before = len(dev.reads)
            engine.generate([[5, 6, 7, 8]], SamplingConfig(max_new_tokens=3, ignore_eos=True, seed=0))
        where = collections.Counter(w.split(" ")[0] for _, _, w in dev.reads[before:])
        reads_by_depth[layers] = sum(n for w, n in where.items() if w.startswith("sequences/packed_attention.py"))
    assert reads_by_depth == {2: 1, 4: 1}, reads_by_depth


def test_a_tool_in_a_busy_loop_is_stopped_at_its_timeout(monkeypatch):
    """A call past rollout.tool_timeout_s was answered in time, but its thread ran on for good: a busy loop (model-
    written code run by an exec tool) then took a share of the interpreter from the training loop for the rest of
    the run (16 such calls: the main thread's Python ran 4.2x slower). ToolTimeout is now raised in it, past a tool's
    own ``except Exception``; its thread ends and the call is not counted as stuck."""
    import threading

    from fastrlhf.rollout import tools as T
    from fastrlhf.rollout.tools import TIMEOUT, ToolCall, run_tool_call, stuck_calls

    monkeypatch.setattr(T, "_stuck", [], raising=False)
    release, threads, seen = threading.Event(), [], []

    def spin(x: int) -> str:
        threads.append(threading.current_thread())
        while not release.is_set():  # on the old code, released at the end of the test
            try:
                x += 1
            except Exception as exc:  # noqa: BLE001 -- a tool that swallows its errors
                seen.append(exc)
        return "released"

    try:
        assert run_tool_call(ToolCall("spin", {"x": 0}), {"spin": spin}, 0.05) == (
            "Error: spin did not return within 0.05 s",
            TIMEOUT,
        )
        (thread,) = threads
        thread.join(30)
        assert not thread.is_alive() and stuck_calls() == [] and seen == []
    finally:
        release.set()
        for t in threads:
            t.join(30)
