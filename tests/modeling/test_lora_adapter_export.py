"""The export of a LoRA model (``model.lora_r > 0``): ``final/`` is the merged model, as the export built it before
(a second, fp32 model merged by peft; now the weight sync's merge into the base model's state dict, no second
model), and ``final/adapter/`` is the adapter alone as peft saves it, which ``PeftModel.from_pretrained`` stacks on
the base model: for the actor, the reward model (its ``score`` head trained whole) and the PPO critic (its value head
beside), and once under ZeRO-3 on two ranks."""

import functools
import glob
import json
import os

import pytest
import torch
from helpers.hf_architectures import save_architecture
from safetensors.torch import load_file

from fastrlhf.config import ModelConfig
from fastrlhf.modeling import export_hf, load_causal_lm, load_sequence_classifier, load_value_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 1, 1]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
# bf16: the merged weights are rounded once, where the adapted forward rounds each product
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def randomize_trained(model, std=0.2):
    """Nonzero adapter factors (LoRA's B starts at zero, an embedding's A too) and a score copy that moved from the
    original (peft's modules_to_save), so that the merge and the adapter have something to get right."""
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name or "modules_to_save" in name or name.startswith("v_head"):
                param.normal_(0, std)


def fresh_model_export(model, out_dir) -> None:
    """The export as it was: the base model rebuilt in fp32, loaded with the state dict, merged by peft, cast back."""
    from peft import get_peft_model

    base = model.get_base_model()
    fresh = get_peft_model(type(base)(base.config), model.peft_config["default"])
    fresh.load_state_dict({k: v.detach() for k, v in model.state_dict().items()}, strict=True)
    merged = fresh.merge_and_unload().to(base.dtype)
    if getattr(base, "generation_config", None) is not None:
        merged.generation_config = base.generation_config
    merged.save_pretrained(out_dir, safe_serialization=True)


def assert_same_folder(got, want) -> None:
    saved, expected = (
        load_file(os.path.join(got, "model.safetensors")),
        load_file(os.path.join(want, "model.safetensors")),
    )
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(want, name)):
            assert json.loads(open(os.path.join(got, name)).read()) == json.loads(open(os.path.join(want, name)).read())


def read_adapter(final) -> tuple[dict, dict]:
    adapter = os.path.join(final, "adapter")
    return json.loads(open(os.path.join(adapter, "adapter_config.json")).read()), load_file(
        os.path.join(adapter, "adapter_model.safetensors")
    )


def assert_top_level_weights_are_the_model(final) -> None:
    """vLLM's loader globs ``<folder>/*.safetensors`` (not recursive) and transformers reads ``model.safetensors``:
    the adapter's weights in ``adapter/`` are no part of the model either loads."""
    assert [
        os.path.basename(f)
        for f in glob.glob(os.path.join(final, "*.safetensors"))
        if not f.endswith("value_head.safetensors")
    ] == ["model.safetensors"]
    assert not os.path.exists(os.path.join(final, "adapter_config.json"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_actors_adapter_stacks_on_the_base_model_as_the_trained_model(tmp_path, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = save_architecture(tmp_path / "model", "qwen2", dtype=getattr(torch, dtype))
    model = load_causal_lm(ModelConfig(path=source, dtype=dtype, lora_r=4, lora_alpha=8, lora_targets=["all-linear"]))
    randomize_trained(model)
    final = str(tmp_path / "final")
    export_hf(model, final)
    config, tensors = read_adapter(final)
    # what vLLM's LoRA serving reads (PEFTHelper): r, lora_alpha, target_modules; no bias, DoRA or modules_to_save
    assert (config["r"], config["lora_alpha"], config["bias"], config["use_dora"]) == (4, 8, "none", False)
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and not config["modules_to_save"]
    # peft writes all-linear out as the modules it matched (full names in a small model); vLLM requires the field
    # and checks the tensors' module names instead
    leaves = {name.rsplit(".", 1)[-1] for name in config["target_modules"]}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert tensors and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in tensors)
    assert_top_level_weights_are_the_model(final)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    stacked = PeftModel.from_pretrained(base, os.path.join(final, "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        trained = model.eval()(IDS).logits.float()
        torch.testing.assert_close(stacked(IDS).logits.float(), trained, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(IDS).logits.float(), trained, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize(
    "arch,dtype,targets",
    [
        ("qwen2", "float32", ["all-linear"]),
        ("qwen2", "bfloat16", ["all-linear"]),
        ("llama", "bfloat16", ["embed_tokens", "q_proj", "down_proj"]),
    ],
    ids=["qwen2-fp32", "qwen2-bf16", "llama-bf16-embedding"],
)
def test_the_merged_export_is_bit_for_bit_the_one_a_second_fp32_model_merged(tmp_path, arch, dtype, targets):
    """The merge of the weight sync into the state dict, saved through the base model: the same tensors, dtypes,
    config.json and generation_config.json as the second model's merge (an untied Llama's embedding adapted too,
    whose adapter stacks without the whole embedding saved)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = save_architecture(tmp_path / "model", arch, dtype=getattr(torch, dtype))
    model = load_causal_lm(ModelConfig(path=source, dtype=dtype, lora_r=4, lora_targets=targets))
    randomize_trained(model)
    export_hf(model, str(tmp_path / "final"))
    fresh_model_export(model, str(tmp_path / "reference"))
    assert_same_folder(str(tmp_path / "final"), str(tmp_path / "reference"))
    _, tensors = read_adapter(str(tmp_path / "final"))
    assert all("lora_" in name for name in tensors)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    stacked = PeftModel.from_pretrained(base, str(tmp_path / "final" / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(stacked(IDS).logits, model.eval()(IDS).logits, atol=1e-5, rtol=1e-5)


def test_the_export_builds_no_second_model(tmp_path, monkeypatch):
    """A second model was built on rank 0 in fp32 (about 32 GB of host memory for an 8B model)."""
    from transformers import Qwen2ForCausalLM

    source = save_architecture(tmp_path / "model", "qwen2")
    model = load_causal_lm(ModelConfig(path=source, dtype="bfloat16", lora_r=4, lora_targets=["all-linear"]))
    built = []
    real_init = Qwen2ForCausalLM.__init__

    def spy(self, *args, **kwargs):
        built.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Qwen2ForCausalLM, "__init__", spy)
    export_hf(model, str(tmp_path / "final"))
    assert built == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lora_reward_models_adapter_holds_its_trained_score_head(tmp_path, dtype):
    """``fastrlhf rm`` with LoRA: peft trains the ``score`` head whole (modules_to_save); the adapter holds the
    trained copy, and the merged export has it as ``score.weight``, bit for bit the second model's merge."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    source = save_architecture(tmp_path / "model", "qwen2", dtype=getattr(torch, dtype))
    model = load_sequence_classifier(
        ModelConfig(path=source, dtype=dtype, lora_r=4, lora_targets=["all-linear"]), num_labels=1
    )
    randomize_trained(model)
    final = str(tmp_path / "final")
    export_hf(model, final)
    fresh_model_export(model, str(tmp_path / "reference"))
    assert_same_folder(final, str(tmp_path / "reference"))
    trained_score = model.base_model.model.score.modules_to_save["default"].weight
    assert torch.equal(load_file(os.path.join(final, "model.safetensors"))["score.weight"], trained_score)
    config, tensors = read_adapter(final)
    assert config["task_type"] == "SEQ_CLS" and "score" in config["modules_to_save"]
    assert any("score" in k for k in tensors)
    assert_top_level_weights_are_the_model(final)
    base = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=getattr(torch, dtype))
    stacked = PeftModel.from_pretrained(base, os.path.join(final, "adapter")).eval()
    with torch.no_grad():
        trained = model.eval()(IDS, attention_mask=MASK).logits.float()
        torch.testing.assert_close(stacked(IDS, attention_mask=MASK).logits.float(), trained, atol=1e-5, rtol=1e-5)


def test_a_lora_critics_adapter_and_value_head_give_its_values(tmp_path):
    """The PPO critic's adapter (its causal LM backbone) with the value head beside it: stacked on the base model,
    the critic's values."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fastrlhf.modeling import CausalLMWithValueHead

    source = save_architecture(tmp_path / "model", "qwen2", dtype=torch.float32)
    critic = load_value_model(ModelConfig(path=source, dtype="float32", lora_r=4, lora_targets=["all-linear"]))
    randomize_trained(critic)
    final = str(tmp_path / "final")
    export_hf(critic, final)
    head = load_file(os.path.join(final, "adapter", "value_head.safetensors"))
    assert head.keys() == {"weight", "bias"}
    for name, tensor in load_file(os.path.join(final, "value_head.safetensors")).items():
        assert torch.equal(head[name], tensor)
    config, _ = read_adapter(final)
    assert config["task_type"] == "CAUSAL_LM"
    assert_top_level_weights_are_the_model(final)
    value_head = torch.nn.Linear(head["weight"].shape[1], 1)
    value_head.load_state_dict(head)
    stacked = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), os.path.join(final, "adapter"))
    rebuilt = CausalLMWithValueHead(stacked, value_head).eval()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(IDS, MASK), critic.eval()(IDS, MASK), atol=1e-5, rtol=1e-5)


def test_zero3_on_two_ranks_writes_one_adapter_of_the_gathered_factors(tmp_path):
    """Partitioned over two ranks, the adapter is written once, by rank 0, from the gathered state dict (the model's
    own parameters there are empty partitions), and stacked on the base model it is the merged export."""
    from helpers.launch import spawn_ranks
    from helpers.lora_export_ranks import zero3_lora_export
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = save_architecture(tmp_path / "model", "qwen2", dtype=torch.float32)
    out = spawn_ranks(functools.partial(zero3_lora_export, source, str(tmp_path / "final")))
    assert sorted(os.listdir(tmp_path)) == ["final", "model"]  # no rank's temporary or second folder left
    _, tensors = read_adapter(str(tmp_path / "final"))
    values = out["lora_B"]
    assert len(values) == 4  # q_proj and down_proj in each of 2 layers
    for name, value in values.items():
        saved = tensors[name.replace(".default.weight", ".weight")]
        assert torch.equal(saved, value) and saved.abs().sum() > 0, name
    stacked = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(source), str(tmp_path / "final" / "adapter")
    ).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    with torch.no_grad():
        torch.testing.assert_close(stacked(IDS).logits, merged(IDS).logits, atol=1e-5, rtol=1e-5)


def test_a_gpt2_conv1d_adapter_merges_transposed_in_the_export_and_the_weight_sync(tmp_path):
    """GPT-2's Conv1D stores its weight ``[in, out]`` (peft's fan_in_fan_out): the weight sync's merge added
    ``B @ A`` (``[out, in]``) untransposed, a RuntimeError on c_attn (and a wrong weight on a square layer). The export
    now merges as the weight sync does: both give the trained model, bit for bit the second model's merge."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from fastrlhf.rl.lora_sync import merged_lora_weights

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        tmp_path / "model"
    )
    model = load_causal_lm(
        ModelConfig(path=str(tmp_path / "model"), dtype="float32", lora_r=4, lora_targets=["c_attn", "c_proj"])
    )
    randomize_trained(model)
    synced = GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    synced.load_state_dict(dict(merged_lora_weights(model, model.state_dict().items())), strict=True)
    export_hf(model, str(tmp_path / "final"))
    fresh_model_export(model, str(tmp_path / "reference"))
    assert_same_folder(str(tmp_path / "final"), str(tmp_path / "reference"))
    with torch.no_grad():
        trained = model.eval()(IDS).logits
        torch.testing.assert_close(synced(IDS).logits, trained, atol=1e-5, rtol=1e-5)
