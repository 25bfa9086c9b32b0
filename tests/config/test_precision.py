"""Precision as a GPU run resolves it (bf16 compute, fp32 master weights, TF32, bf16 rollouts), checked
on CPU by resolving for a GPU explicitly; pure bf16 only on request; the GPU example configs."""

import glob
import os
import subprocess
import sys

import pytest
import torch
from helpers.model_folders import fake_model_folder
from helpers.paths import ROOT

from fastrlhf.config import ConfigError, load_config, parse_config
from fastrlhf.engine.deepspeed import deepspeed_config

GPU_EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "gpu", "*.yaml")))


def raw_train(tmp_path, model=None, deepspeed=None, rollout=None):
    fake_model_folder(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    return {"algorithm": "grpo", "output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model"),
                                                                               **(model or {})},
            "reward": {"function": "length"}, "data": {"prompts": str(tmp_path / "prompts.jsonl")},
            "rollout": {"n": 2, **(rollout or {})}, "trainer": {"max_steps": 1, "prompts_per_step": 2,
                                                               "minibatch_size": 4},
            "deepspeed": deepspeed or {}}


def test_defaults_resolve_to_bf16_with_fp32_master_weights_on_a_gpu(tmp_path):
    config = parse_config(raw_train(tmp_path), on_gpu=True)
    assert (config.model.dtype, config.deepspeed.bf16, config.rollout.dtype) == ("bfloat16", True, "bfloat16")
    # DeepSpeed's bf16 mode is what keeps fp32 master weights and moments.
    assert deepspeed_config(config.deepspeed)["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert config.model.tf32 is True


def test_bf16_at_stage_0_trains_as_zero_1(tmp_path):
    """DeepSpeed's stage-0 bf16 wrapper reads each parameter's gradient on the host every step
    (tests/engine/test_deepspeed_reads.py); the trainable engine runs ZeRO-1 instead, a frozen one stays at 0."""
    config = parse_config(raw_train(tmp_path, deepspeed={"zero_stage": 0}), on_gpu=True)
    assert config.deepspeed.zero_stage == 0 and config.deepspeed.bf16 is True
    assert deepspeed_config(config.deepspeed)["zero_optimization"]["stage"] == 1
    assert deepspeed_config(config.deepspeed, trainable=False)["zero_optimization"]["stage"] == 0
    cpu = parse_config(raw_train(tmp_path, deepspeed={"zero_stage": 0}), on_gpu=False)  # fp32: no wrapper
    assert deepspeed_config(cpu.deepspeed)["zero_optimization"]["stage"] == 0


def test_defaults_stay_fp32_on_a_cpu(tmp_path):
    config = parse_config(raw_train(tmp_path), on_gpu=False)
    assert (config.model.dtype, config.deepspeed.bf16, config.rollout.dtype) == ("float32", False, "float32")
    assert deepspeed_config(config.deepspeed)["bf16"]["enabled"] is False


def test_explicit_fp32_master_weights_choices_resolve_as_asked(tmp_path):
    # bf16 switched off: auto weights become fp32, never pure bf16.
    config = parse_config(raw_train(tmp_path, deepspeed={"bf16": False}), on_gpu=True)
    assert (config.model.dtype, config.deepspeed.bf16) == ("float32", False)
    # fp32 weights with DeepSpeed bf16 on a CPU: the actor computes in bf16, so does its rollout copy.
    config = parse_config(raw_train(tmp_path, model={"dtype": "float32"}, deepspeed={"bf16": True}), on_gpu=False)
    assert (config.model.dtype, config.deepspeed.bf16, config.rollout.dtype) == ("float32", True, "bfloat16")


def test_pure_bf16_is_refused_with_one_line_unless_asked_for(tmp_path):
    raw = raw_train(tmp_path, model={"dtype": "bfloat16"}, deepspeed={"bf16": False})
    with pytest.raises(ConfigError) as err:
        parse_config(raw, on_gpu=True)
    assert err.value.key == "deepspeed.bf16" and "master weights" in str(err.value) and "\n" not in str(err.value)
    raw["deepspeed"]["pure_bf16"] = True
    config = parse_config(raw, on_gpu=True)
    assert (config.model.dtype, config.deepspeed.bf16) == ("bfloat16", False)
    with pytest.raises(ConfigError, match="deepspeed.pure_bf16: conflicts"):
        parse_config(raw_train(tmp_path, deepspeed={"bf16": True, "pure_bf16": True}), on_gpu=True)


def test_float16_training_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.dtype: float16 training needs loss scaling"):
        parse_config(raw_train(tmp_path, model={"dtype": "float16"}), on_gpu=True)


def test_the_engine_builder_refuses_bf16_weights_without_master_weights():
    """Models and configs made in code skip parse_config: the engine builder checks again."""
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.deepspeed import build_train_engine

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="without fp32 master weights"):
        build_train_engine(model, DeepSpeedConfig(bf16=False), lr=1e-3)


def test_tf32_is_switched_on_for_cuda_runs(tmp_path, monkeypatch):
    from fastrlhf.config.precision import apply_matmul_precision

    config = parse_config(raw_train(tmp_path), on_gpu=True)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        apply_matmul_precision(config)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture
def gpu_example_dir(tmp_path, monkeypatch):
    """A working directory holding the local folders and files the GPU examples name."""
    from fastrlhf.modeling.tiny_chat import build_chat_tokenizer

    (tmp_path / "data").mkdir()
    # The 1.5B's config.json (the dry run runs the run's checks: head size, lengths) and a chat tokenizer
    shape = {"model_type": "qwen2", "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2,
             "num_hidden_layers": 28, "intermediate_size": 8960, "vocab_size": 151936,
             "max_position_embeddings": 32768, "tie_word_embeddings": True, "eos_token_id": 151645}
    policy = fake_model_folder(tmp_path / "models/Qwen2.5-1.5B-Instruct",
                               {**shape, "architectures": ["Qwen2ForCausalLM"]})
    build_chat_tokenizer().save_pretrained(policy)
    fake_model_folder(tmp_path / "models/rm-qwen2.5-1.5b",  # a pairwise reward model: one label
                      {**shape, "architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}})
    for name in ("data/gsm8k_train.jsonl", "data/prompts.jsonl"):
        (tmp_path / name).write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_gpu_examples_exist():
    assert {os.path.basename(p) for p in GPU_EXAMPLES} == {"grpo_qwen2.5_1.5b.yaml", "ppo_qwen2.5_1.5b.yaml"}


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=os.path.basename)
def test_gpu_example_resolves_for_an_8_gpu_node(path, gpu_example_dir):
    from fastrlhf.config import check_world_size

    config = load_config(path, "train", on_gpu=True)
    assert (config.model.dtype, config.deepspeed.bf16, config.rollout.dtype) == ("bfloat16", True, "bfloat16")
    assert config.model.gradient_checkpointing and config.rollout.engine == "vllm"
    assert config.deepspeed.zero_stage in (2, 3)
    check_world_size(config, 8)  # batch sizes split over 8 ranks and grad_accum
    assert config.trainer.minibatch_size % (8 * config.trainer.grad_accum) == 0


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=os.path.basename)
def test_gpu_example_passes_the_cli_dry_run_on_cpu(path, gpu_example_dir):
    proc = subprocess.run([sys.executable, "-m", "fastrlhf", "train", "--config", path, "--dry-run"],
                          cwd=gpu_example_dir, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dtype: float32" in proc.stdout  # resolved for this (CPU) machine
    assert "algorithm:" in proc.stdout
