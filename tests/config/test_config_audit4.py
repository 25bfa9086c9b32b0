"""Configs the loader accepted although the run would fail later or silently do something else: each now fails at
load with one line naming the key."""

import importlib.machinery
import sys
import types

import pytest
from helpers.model_folders import fake_classifier_folder, fake_model_folder

from fastrlhf.config import ConfigError, parse_config

# A Llama whose positions and layers the checks can read (the helper's default names only its model_type).
LLAMA = {"model_type": "llama", "vocab_size": 1000, "max_position_embeddings": 128, "num_hidden_layers": 2,
         "pad_token_id": 0, "tie_word_embeddings": False}


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    return {"model": fake_model_folder(tmp_path / "model", LLAMA), "prompts": str(tmp_path / "p.jsonl"),
            "data": str(tmp_path / "d.jsonl"), "out": str(tmp_path / "out"), "tmp": tmp_path}


def grpo(paths, **sections):
    raw = {"algorithm": "grpo", "output_dir": paths["out"], "model": {"path": paths["model"]},
           "reward": {"function": "length"}, "data": {"prompts": paths["prompts"], "max_prompt_len": 32},
           "rollout": {"n": 4, "max_new_tokens": 16},
           "trainer": {"max_steps": 10, "prompts_per_step": 4, "minibatch_size": 8}}
    for name, section in sections.items():
        raw[name] = {**raw[name], **section} if isinstance(section, dict) and name in raw else section
    return raw


def sft(paths, **sections):
    raw = {"output_dir": paths["out"], "model": {"path": paths["model"]}, "data": {"path": paths["data"],
           "max_len": 64}, "trainer": {"max_steps": 10, "batch_size": 8}}
    for name, section in sections.items():
        raw[name] = {**raw[name], **section}
    return raw


def error(raw, command="train", on_gpu=False) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, command, on_gpu=on_gpu)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_an_episodes_tool_tokens_count_against_the_models_positions_where_vllm_may_run(paths):
    """32 + 16 + 256 (rollout.max_tool_tokens' default) = 304 tokens of context on a 128-position model was accepted;
    the vLLM engine then refused it with a ValueError once every rank had loaded its models."""
    tools = {"tools": ["calc:add"]}
    assert error(grpo(paths, rollout=tools)) == (
        "rollout.max_tool_tokens: data.max_prompt_len + rollout.max_new_tokens + rollout.max_tool_tokens = 304 "
        "exceeds model.path's max_position_embeddings 128")
    parse_config(grpo(paths, rollout={**tools, "max_tool_tokens": 80}), on_gpu=False)
    parse_config(grpo(paths, rollout={**tools, "engine": "hf"}), on_gpu=False)  # HF's generate has no such bound


def test_the_reward_models_positions_are_checked_too(paths):
    """The reward model scores prompt + completion: one of 20 positions was accepted for 48-token sequences."""
    small = fake_model_folder(paths["tmp"] / "rm", {**LLAMA, "architectures": ["LlamaForSequenceClassification"],
                                                    "id2label": {"0": "score"}, "max_position_embeddings": 20})
    assert error(grpo(paths, reward={"function": None, "model_path": small})) == (
        "rollout.max_new_tokens: data.max_prompt_len + rollout.max_new_tokens = 48 exceeds reward.model_path's "
        "max_position_embeddings 20")
    fits = fake_classifier_folder(paths["tmp"] / "rm2")
    parse_config(grpo(paths, reward={"function": None, "model_path": fits}), on_gpu=False)


@pytest.mark.parametrize("extra, key", [
    ({"gradient_accumulation_steps": 4}, "deepspeed.extra.gradient_accumulation_steps"),
    ({"train_micro_batch_size_per_gpu": 4}, "deepspeed.extra.train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 64}, "deepspeed.extra.train_batch_size"),
    ({"gradient_clipping": 0.5}, "deepspeed.extra.gradient_clipping"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-5}}}, "deepspeed.extra.optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, "deepspeed.extra.scheduler"),
    ({"bf16": {"enabled": True}}, "deepspeed.extra.bf16.enabled"),
    ({"zero_optimization": {"stage": 3}}, "deepspeed.extra.zero_optimization.stage"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "deepspeed.extra.zero_optimization.offload_optimizer"),
    ({"zero_optimization": 3}, "deepspeed.extra.zero_optimization"),
])
def test_deepspeed_extra_may_not_overrule_the_config(paths, extra, key):
    """Merged last into DeepSpeed's config, each of these won over the setting fastrlhf had made from its own keys,
    unseen by the memory plan, the checkpoints and the step (gradient_accumulation_steps 4 under grad_accum 1: one
    optimizer step every 4 micro-batches)."""
    assert error(grpo(paths, deepspeed={"extra": extra})).startswith(f"{key}: ")


def test_deepspeed_extra_still_tunes_deepspeed(paths):
    for extra in ({"zero_optimization": {"stage3_prefetch_bucket_size": 50_000_000}},
                  {"data_types": {"grad_accum_dtype": "bf16"}}, {"bf16": {"immediate_grad_update": True}}):
        parse_config(grpo(paths, deepspeed={"extra": extra}), on_gpu=False)
    pinned = {"offload_optimizer": True, "extra": {"zero_optimization": {"offload_optimizer": {"pin_memory": True}}}}
    parse_config(grpo(paths, deepspeed=pinned), on_gpu=False)


@pytest.mark.parametrize("name, value", [("lora_targets", ["q_proj", "k_proj"]), ("lora_alpha", 32),
                                         ("lora_dropout", 0.1)])
def test_lora_settings_without_a_rank_are_refused(paths, name, value):
    """lora_r 0 (the default) with LoRA settings trained every weight, silently."""
    assert error(grpo(paths, model={name: value})).startswith(f"model.{name}: sets up a LoRA adapter, which "
                                                              "model.lora_r 0 turns off")
    parse_config(grpo(paths, model={name: value, "lora_r": 8}), on_gpu=False)


@pytest.mark.parametrize("section, override", [
    ("trainer", {"kl_coef": 0.0, "kl_kind": "k1", "kl_in_reward": True}), ("trainer", {"max_sampling_rounds": 5}),
    ("reward", {"overlong_penalty": 2.0}), ("reward", {"model_kind": "value_head"}),
    ("eval", {"every": 5, "n": 4, "temperature": 0.5, "before_train": False})])
def test_switching_a_feature_off_leaves_its_settings_allowed(paths, section, override):
    """An ablation sets kl_coef 0, filter_groups false, eval.data null on a config that tunes them: refusing the
    settings that then do nothing would make every such switch a hunt for the keys that go with it."""
    parse_config(grpo(paths, **{section: override}), on_gpu=False)


@pytest.mark.parametrize("warmup", [10, 20])
def test_a_critic_warmup_over_every_step_is_refused(paths, warmup):
    """critic_warmup_steps >= max_steps: the actor never trained, the run reported success."""
    raw = grpo(paths, algorithm="ppo", critic={}, rollout={"n": 2}, trainer={"prompts_per_step": 8,
                                                                             "critic_warmup_steps": warmup})
    assert error(raw) == (f"trainer.critic_warmup_steps: must be below trainer.max_steps (10), got {warmup}: the actor "
                          "would never train")
    raw["trainer"]["critic_warmup_steps"] = 9
    parse_config(raw, on_gpu=False)


def test_sft_max_prompt_len_must_leave_room_for_a_response(paths):
    assert error(sft(paths, data={"max_prompt_len": 64}), "sft") == (
        "data.max_prompt_len: must be below data.max_len (64, prompt and response), got 64")
    parse_config(sft(paths, data={"max_prompt_len": 48}), "sft", on_gpu=False)


def test_an_empty_model_path_is_named_as_such(paths):
    """"" resolved to the current directory: 'model.path:  is not a model folder' (an empty name, two spaces)."""
    assert error(grpo(paths, model={"path": ""})) == "model.path: expected the path of a model folder, got ''"


def test_auto_attention_is_checked_once_resolved(paths):
    """Gemma-2's attention softcap in packed rows: auto resolves to sdpa on a CPU, which drops it; the loader passed
    it and the first packed forward raised a ValueError on every rank."""
    gemma2 = fake_model_folder(paths["tmp"] / "gemma2", {**LLAMA, "model_type": "gemma2",
                                                         "attn_logit_softcapping": 50.0})
    raw = grpo(paths, model={"path": gemma2}, trainer={"packing": True})
    assert error(raw) == ("model.attention: sdpa drops the attn_logit_softcapping (50.0) of model.path in packed rows: "
                          "set model.attention: flex (a GPU) or trainer.packing: false")
    assert parse_config(raw, on_gpu=True).model.attention in ("flex", "flash_attention_2")
    parse_config(grpo(paths, model={"path": gemma2}), on_gpu=False)  # unpacked rows keep the model's own attention


@pytest.fixture
def liger(monkeypatch):
    """An installed liger_kernel whose kernels know Llama only."""
    package = types.ModuleType("liger_kernel")
    package.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": object()}
    for name, module in (("liger_kernel", package), ("liger_kernel.transformers", types.ModuleType("x")),
                         ("liger_kernel.transformers.monkey_patch", patch)):
        monkeypatch.setitem(sys.modules, name, module)


def test_liger_kernels_for_an_unknown_model_type_fail_at_load(paths, liger):
    """Refused in each rank's model loading, after the process group started: said once per rank, on 8 ranks 8
    times. Now at load, before any rank starts."""
    parse_config(grpo(paths, model={"liger_kernels": True}), on_gpu=True)
    other = fake_model_folder(paths["tmp"] / "mistral", {**LLAMA, "model_type": "mistral"})
    raw = grpo(paths, model={"liger_kernels": True}, algorithm="ppo", critic={"path": other}, rollout={"n": 2},
               trainer={"prompts_per_step": 8})
    assert error(raw, on_gpu=True) == ("model.liger_kernels: Liger-Kernel has no kernels for model_type 'mistral' "
                                       "(critic.path); it has llama")


@pytest.mark.parametrize("environment", ["", "envs", "envs:", ":Env", "a:b:C"])
def test_an_environment_not_module_colon_class_is_named(paths, environment):
    """``rollout.environment: ""`` was taken as set (the error then named rollout.max_tool_tokens, a context limit
    the user never set); one not ``module:Class`` failed in preflight, after the config was accepted."""
    assert error(grpo(paths, rollout={"environment": environment})) == (
        f"rollout.environment: expected 'module:Class' (or null for none), got {environment!r}")
