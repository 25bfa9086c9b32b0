"""Audit of model loading and LoRA: ``model.lora_targets: [all-linear]`` (peft's shorthand, which it expands only
from a string) is accepted, adapts every decoder Linear but no tied head, counts in the plan as peft does and trains;
a LoRA export keeps the dtype trained in and holds base + scale * B @ A."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from helpers.paths import ROOT

from fastrlhf.config import ConfigError, ModelConfig, parse_config
from fastrlhf.memory import read_shape
from fastrlhf.modeling import export_hf, load_causal_lm, load_sequence_classifier
from fastrlhf.modeling.tiny import save_tiny_qwen2

SHAPE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=48)
LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2 with tied embeddings (as Qwen2.5-1.5B), and prompts for a run."""
    root = tmp_path_factory.mktemp("qwen")
    save_tiny_qwen2(root / "model", tie_word_embeddings=True, **SHAPE)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": [5 + i, 6, 7]}) + "\n" for i in range(4)))
    (root / "sft.jsonl").write_text('{"prompt_ids": [3], "response_ids": [4]}\n')
    return root


def train_raw(root, targets, output_dir="out"):
    return {"algorithm": "grpo", "output_dir": str(root / output_dir), "seed": 3,
            "model": {"path": str(root / "model"), "lora_r": 4, "lora_targets": targets},
            "reward": {"function": "length"}, "data": {"prompts": str(root / "prompts.jsonl"), "max_prompt_len": 8},
            "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 4},
            "trainer": {"max_steps": 2, "prompts_per_step": 2, "minibatch_size": 4, "lr": 1e-2},
            "deepspeed": {"zero_stage": 1}}


def adapted(model) -> list[str]:
    return sorted({name.split(".lora_")[0].split(".")[-1] for name, _ in model.named_parameters() if ".lora_" in name})


def test_all_linear_adapts_every_decoder_linear_but_not_the_tied_head_and_counts_as_peft(qwen):
    """peft read ["all-linear"] as a module name (NoMatchingPeftModuleError after the load), so the config check
    refused it; as a string peft takes every Linear but the output layer."""
    config = parse_config(train_raw(qwen, ["all-linear"]), on_gpu=False)
    assert config.model.lora_targets == ["all-linear"]
    model = load_causal_lm(config.model)
    assert adapted(model) == LINEARS
    hf = model.get_base_model()
    assert type(hf.lm_head) is torch.nn.Linear and type(hf.model.embed_tokens) is torch.nn.Embedding
    assert hf.lm_head.weight is hf.model.embed_tokens.weight and not hf.lm_head.weight.requires_grad
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert read_shape(str(qwen / "model")).lora_params(4, ["all-linear"]) == trainable == 2 * 4 * (
        (32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 48) + (48 + 32))


def test_all_linear_on_a_reward_model_leaves_its_score_head_whole(qwen):
    model_cfg = ModelConfig(path=str(qwen / "model"), dtype="float32", lora_r=4, lora_targets=["all-linear"])
    parse_config({"output_dir": str(qwen / "rm"), "model": {"path": model_cfg.path, "lora_r": 4,
                  "lora_targets": ["all-linear"]}, "data": {"path": str(qwen / "sft.jsonl")},
                  "trainer": {"max_steps": 2, "batch_size": 2}}, "rm", on_gpu=False)
    model = load_sequence_classifier(model_cfg, num_labels=1)
    assert adapted(model) == LINEARS
    score = {name: p.requires_grad for name, p in model.named_parameters() if ".score." in name}
    assert score == {"base_model.model.score.original_module.weight": False,  # peft trains a copy of it whole
                     "base_model.model.score.modules_to_save.default.weight": True}


@pytest.mark.parametrize("targets", [["all-linear", "q_proj"], ["q_proj", "all-linear"]])
def test_all_linear_beside_other_modules_is_refused(qwen, targets):
    """In a list, peft would take all-linear for a module name and adapt the others only."""
    with pytest.raises(ConfigError) as info:
        parse_config(train_raw(qwen, targets), on_gpu=False)
    assert str(info.value).startswith("model.lora_targets: all-linear stands alone")


def test_a_run_with_all_linear_trains_every_decoder_linear(qwen):
    path = qwen / "all-linear.yaml"
    path.write_text(yaml.safe_dump(train_raw(qwen, ["all-linear"])))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTRLHF_NO_PROGRESS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-m", "fastrlhf", "train", "--config", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from safetensors.torch import load_file

    before, after = load_file(str(qwen / "model" / "model.safetensors")), load_file(
        str(qwen / "out" / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = sorted({k.split(".")[-2] for k in before if not torch.equal(before[k], after[k])})
    assert changed == LINEARS  # the embedding (and with it the tied head) and the norms as they were


def test_a_lora_export_keeps_the_dtype_trained_in_and_merges_base_plus_scaled_delta(tmp_path):
    """A bf16 LoRA model was exported in fp32 (twice the bytes, config.json dtype float32): the merge model was
    built in the default dtype and saved as it was."""
    save_tiny_qwen2(tmp_path / "base", dtype=torch.bfloat16, tie_word_embeddings=True, **SHAPE)
    model_cfg = ModelConfig(path=str(tmp_path / "base"), dtype="bfloat16", lora_r=4, lora_alpha=8,
                            lora_targets=["q_proj", "down_proj"])
    model = load_causal_lm(model_cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    layers = model.get_base_model().model.layers
    q = layers[1].self_attn.q_proj
    expected = (q.base_layer.weight.float() + 2.0 * q.lora_B["default"].weight.float()
                @ q.lora_A["default"].weight.float()).to(torch.bfloat16)
    export_hf(model, str(tmp_path / "out"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.equal(saved["model.layers.1.self_attn.q_proj.weight"], expected)
    assert "lm_head.weight" not in saved  # tied: saved once, as the embedding
    base = load_file(str(tmp_path / "base" / "model.safetensors"))
    assert torch.equal(saved["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(saved["model.layers.1.self_attn.k_proj.weight"], base["model.layers.1.self_attn.k_proj.weight"])


def test_a_lora_export_keeps_the_checkpoints_generation_config(tmp_path):
    """The merge model was built from config.json alone: the export's generation_config.json held its one eos and
    no sampling defaults (Qwen2-Instruct's eos [151645, 151643] lost, so a served export ran past its turns)."""
    from transformers import GenerationConfig

    save_tiny_qwen2(tmp_path / "base", tie_word_embeddings=True, **SHAPE)
    GenerationConfig(eos_token_id=[7, 9], top_p=0.8, do_sample=True).save_pretrained(tmp_path / "base")
    model = load_causal_lm(ModelConfig(path=str(tmp_path / "base"), lora_r=4, lora_targets=["q_proj"]))
    export_hf(model, str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [7, 9] and saved["top_p"] == 0.8, saved
