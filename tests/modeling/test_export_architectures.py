"""Audit of loading local checkpoints and writing them back: each architecture users load (tiny, random) round-trips
through the export into plain ``transformers`` with the same logits, its ties, dtype and generation_config; a LoRA
reward model exports (it has no generation_config); an adapter on a head tied without config.json saying so is
refused; the export says ``use_cache: true`` after gradient checkpointing; and it is on disk before it replaces
``final/``."""

import json
import os

import pytest
import torch
from helpers.hf_architectures import ARCHITECTURES, EOS_IDS, save_architecture
from safetensors import safe_open

from fastrlhf.config import ConfigError, ModelConfig
from fastrlhf.modeling import export_hf, load_causal_lm, load_sequence_classifier, use_attention

PHI3_MODULES = "down_proj, embed_tokens, gate_up_proj, lm_head, o_proj, qkv_proj, or all-linear"
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 1, 1]])


def randomize_adapter(model, std=0.2):
    """LoRA's B starts at zero (an embedding's A does): nonzero factors, so that the merge has a delta to get right."""
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:
                param.normal_(0, std)


def weight_names(folder) -> set[str]:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_round_trips_through_the_export_into_plain_transformers(tmp_path, arch):
    """Trained bf16 with gradient checkpointing and packed attention: the export is what transformers loads back
    with the same logits, ties kept (a tied head written once), bf16 in config.json, the checkpoint's eos ids, and no
    fastrlhf attention named in config.json (plain transformers and vLLM would not know it)."""
    from transformers import AutoModelForCausalLM

    source = save_architecture(tmp_path / "model", arch)
    model = load_causal_lm(ModelConfig(path=source, dtype="bfloat16", gradient_checkpointing=True))
    use_attention(model, packing=True, backend="sdpa")
    export_hf(model, str(tmp_path / "final"), tokenizer_from=source)
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    generation = json.loads((tmp_path / "final" / "generation_config.json").read_text())
    assert config["dtype"] == "bfloat16" and "fastrlhf" not in json.dumps(config)
    assert generation["eos_token_id"] == EOS_IDS
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.bfloat16).eval()
    tied = ARCHITECTURES[arch][1].get("tie_word_embeddings", arch == "gemma")
    assert (reloaded.lm_head.weight is reloaded.get_input_embeddings().weight) == tied
    assert ("lm_head.weight" in weight_names(tmp_path / "final")) == (not tied)
    with torch.no_grad():
        assert torch.equal(model.eval()(IDS).logits, reloaded(IDS).logits)


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_a_lora_export_is_the_trained_model_in_fp32(tmp_path, arch):
    """all-linear on Qwen2 (tied) and Phi-3 (fused qkv_proj, gate_up_proj): merged, the export gives the logits of
    the adapted model."""
    from transformers import AutoModelForCausalLM

    source = save_architecture(tmp_path / "model", arch, dtype=torch.float32)
    model = load_causal_lm(ModelConfig(path=source, dtype="float32", lora_r=4, lora_targets=["all-linear"]))
    randomize_adapter(model)
    export_hf(model, str(tmp_path / "final"))
    assert not any("lora" in name for name in weight_names(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(IDS).logits, reloaded(IDS).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_lora_reward_model_exports_and_transformers_scores_it_the_same(tmp_path, dtype):
    """``fastrlhf rm`` with model.lora_r > 0: the export copied the base model's generation_config, which a
    sequence classifier does not have (AttributeError after the whole training). Its merged score head and adapter
    give the scores of the trained model, and it pads batches with a pad id."""
    from transformers import AutoModelForSequenceClassification

    source = save_architecture(tmp_path / "model", "qwen2")
    model = load_sequence_classifier(
        ModelConfig(path=source, dtype=dtype, lora_r=4, lora_targets=["all-linear"], gradient_checkpointing=True),
        num_labels=1,
    )
    randomize_adapter(model)
    export_hf(model, str(tmp_path / "final"))
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["dtype"] == dtype
    assert config["pad_token_id"] == 2
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final", dtype=getattr(torch, dtype))
    with torch.no_grad():
        trained, exported = model.eval()(IDS).logits.float(), reloaded.eval()(IDS).logits.float()
    # bf16: the merged weights are rounded once, where the adapted forward rounds each product
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(trained, exported, atol=tolerance, rtol=tolerance)


def test_lora_on_the_embedding_of_a_model_that_ties_without_saying_so_is_refused(tmp_path):
    """Gemma ties lm_head to embed_tokens by its config class's default; a config.json without the key passed the
    config check, and the merged export wrote the adapter's delta into the head as well: logits 166 apart from the
    trained model's. The loader refuses it in one line naming the setting."""
    source = save_architecture(tmp_path / "model", "gemma", dtype=torch.float32)
    config_file = tmp_path / "model" / "config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("tie_word_embeddings", None)
    config_file.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"^model\.lora_targets: embed_tokens: .* ties lm_head to embed_tokens"):
        load_causal_lm(ModelConfig(path=source, dtype="float32", lora_r=4, lora_targets=["q_proj", "embed_tokens"]))
    adapted = load_causal_lm(ModelConfig(path=source, dtype="float32", lora_r=4, lora_targets=["q_proj"]))
    assert adapted.get_base_model().lm_head.weight is adapted.get_base_model().model.embed_tokens.weight


def test_lora_targets_that_a_model_does_not_have_are_refused_naming_the_setting_and_its_modules(tmp_path):
    """Phi-3 fuses q, k, v into qkv_proj: the default targets [q_proj, v_proj] passed the config check (it knows
    fastrlhf's own architectures' modules) and peft failed after the load with an error naming no setting; a target
    beside one that matches was dropped without a word."""
    source = save_architecture(tmp_path / "model", "phi3", dtype=torch.float32)
    for targets in (["q_proj", "v_proj"], ["qkv_proj", "v_proj"]):
        with pytest.raises(
            ConfigError,
            match=rf"^model\.lora_targets: '(q|v)_proj' is no module of .* \(a phi3 "
            rf"model\); its Linear and Embedding modules: {PHI3_MODULES}$",
        ):
            load_causal_lm(ModelConfig(path=source, dtype="float32", lora_r=4, lora_targets=targets))
    adapted = load_causal_lm(ModelConfig(path=source, dtype="float32", lora_r=4, lora_targets=["qkv_proj"]))
    assert any("qkv_proj.lora_A" in name for name, _ in adapted.named_parameters())


@pytest.mark.parametrize("lora_r", [0, 4])
def test_the_export_of_a_gradient_checkpointed_model_keeps_the_kv_cache_on(tmp_path, lora_r):
    """Gradient checkpointing turns the training model's cache off; config.json said ``use_cache: false`` after
    the export, so the reloaded model's forward returned no past_key_values. The trained model keeps it off."""
    from transformers import AutoModelForCausalLM

    source = save_architecture(tmp_path / "model", "llama", dtype=torch.float32)
    model = load_causal_lm(ModelConfig(path=source, dtype="float32", gradient_checkpointing=True, lora_r=lora_r))
    export_hf(model, str(tmp_path / "final"))
    assert json.loads((tmp_path / "final" / "config.json").read_text())["use_cache"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    with torch.no_grad():
        assert reloaded(IDS).past_key_values is not None
    hf = model.get_base_model() if lora_r else model
    assert hf.config.use_cache is False and hf.is_gradient_checkpointing


def test_the_export_is_on_disk_before_it_replaces_the_previous_one(tmp_path, monkeypatch):
    """``final/`` is replaced by renames; without an fsync of the new files first, a power cut after the renames
    could leave them empty where the old export is already deleted (the checkpoints fsync theirs)."""
    source = save_architecture(tmp_path / "model", "qwen2", dtype=torch.float32)
    model = load_causal_lm(ModelConfig(path=source, dtype="float32"))
    out = tmp_path / "final"
    export_hf(model, str(out))
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(src), str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    export_hf(model, str(out), tokenizer_from=source)
    published = events.index(("rename", f"{out}.tmp", str(out)))
    synced = {e[1] for e in events[:published] if e[0] == "fsync"}
    names = sorted(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(names)
    assert {os.path.join(f"{out}.tmp", name) for name in names} | {f"{out}.tmp"} <= synced
    assert ("fsync", str(tmp_path)) in events[published:]  # the renames themselves
