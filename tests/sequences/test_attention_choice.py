"""model.attention: the backend of packed rows, chosen once per run (fastrlhf/sequences/attention.py), printed by
--dry-run, and refused in the fast config checks where the machine cannot run it."""

import subprocess
import sys

import pytest
import yaml
from helpers.launch import ROOT
from helpers.model_folders import fake_model_folder

from fastrlhf.config import ConfigError, parse_config
from fastrlhf.sequences import attention


@pytest.fixture
def flash_attn(monkeypatch):
    """flash_attn importable (it is not installed on a CPU machine)."""
    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: True)


@pytest.mark.parametrize("on_gpu,dtype,shared,want", [
    (False, "float32", False, "sdpa"), (False, "float32", True, "sdpa"), (False, "bfloat16", False, "sdpa"),
    (True, "bfloat16", False, "flex"), (True, "bfloat16", True, "flex"), (True, "float32", False, "flex"),
])
def test_auto_follows_the_table_without_flash_attn(on_gpu, dtype, shared, want, monkeypatch):
    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: False)
    assert attention.choose("auto", on_gpu, dtype, shared) == want


@pytest.mark.parametrize("on_gpu,dtype,shared,want", [
    (True, "bfloat16", False, "flash_attention_2"), (True, "float16", False, "flash_attention_2"),
    (True, "float32", False, "flex"),  # flash-attn runs half precision only
    (True, "bfloat16", True, "flex"),  # it cannot express a shared prefix
    (False, "bfloat16", False, "sdpa"),
])
def test_auto_takes_flash_attn_where_it_can_run(on_gpu, dtype, shared, want, flash_attn):
    assert attention.choose("auto", on_gpu, dtype, shared) == want


@pytest.mark.parametrize("requested,on_gpu,dtype,shared,phrase", [
    ("flex", False, "float32", False, "no FlexAttention backward on a CPU"),
    ("flash_attention_2", False, "bfloat16", False, "needs a GPU"),
    ("flash_attention_2", True, "bfloat16", False, "needs the flash_attn package"),
    ("flash_attention_2", True, "bfloat16", True, "cannot run shared prompts"),
    ("eager", True, "bfloat16", False, "expected one of auto, flex, flash_attention_2, sdpa"),
])
def test_a_choice_the_machine_cannot_run_is_one_config_error(requested, on_gpu, dtype, shared, phrase, monkeypatch):
    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: False)
    with pytest.raises(ConfigError, match=phrase) as info:
        attention.choose(requested, on_gpu, dtype, shared)
    assert str(info.value).startswith("model.attention") and "\n" not in str(info.value)


def test_explicit_choices_that_can_run_are_kept(flash_attn):
    assert attention.choose("flash_attention_2", True, "bfloat16") == "flash_attention_2"
    assert attention.choose("flex", True, "float32", True) == "flex"
    assert attention.choose("sdpa", True, "bfloat16", True) == "sdpa"  # one sdpa call per sequence, on a GPU too
    with pytest.raises(ConfigError, match="needs bf16 or fp16"):
        attention.choose("flash_attention_2", True, "float32")


def train_config(tmp_path, **model):
    fake_model_folder(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    return {"algorithm": "grpo", "output_dir": str(tmp_path / "out"),
            "model": {"path": str(tmp_path / "model"), **model}, "reward": {"function": "length"},
            "data": {"prompts": str(tmp_path / "prompts.jsonl")}, "rollout": {"n": 4},
            "trainer": {"max_steps": 2, "prompts_per_step": 4, "minibatch_size": 8, "packing": True,
                        "share_prompts": True}}


def test_the_config_carries_the_resolved_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: False)
    raw = train_config(tmp_path)
    assert parse_config(raw, on_gpu=False).model.attention == "sdpa"
    assert parse_config(raw, on_gpu=True).model.attention == "flex"  # bf16 by default on a GPU, shared prompts
    with pytest.raises(ConfigError, match="model.attention"):
        parse_config(train_config(tmp_path, attention="flash_attention_2"), on_gpu=True)


def test_dry_run_prints_the_backend_and_a_bad_one_is_refused_in_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(train_config(tmp_path)))
    command = [sys.executable, "-m", "fastrlhf", "train", "--config", str(path), "--dry-run"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["model"]["attention"] == "sdpa" and resolved["trainer"]["share_prompts"] is True
    proc = subprocess.run(command + ["--set", "model.attention=flex"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("config error: model.attention"), lines
