"""Configs that only the model folders they name make invalid (lengths, vocabularies, LoRA targets, a reward
model's head, weights that cannot load), and the config file itself (its encoding, duplicate keys, YAML 1.2
numbers): each refused in one line naming the key before any model loads. Models: tiny ones saved here."""

import dataclasses
import json
import os
import shutil

import pytest
import yaml
from helpers.model_folders import fake_model_folder

from fastrlhf.config import ConfigError, load_config, parse_config

VOCAB = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny model folders: a Llama (vocab 64, 1024 positions, pad 2), a smaller one (vocab 32, 128 positions),
    a Qwen2 with tied embeddings, reward classifiers of 2 labels and of 1, and a PPO critic's export."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForSequenceClassification

    from fastrlhf.modeling import CausalLMWithValueHead
    from fastrlhf.modeling.tiny import make_tiny_llama, save_tiny_llama, save_tiny_qwen2, tiny_llama_config

    root = tmp_path_factory.mktemp("models")
    shape = dict(hidden_size=32, num_layers=1, num_heads=1)
    save_tiny_llama(root / "llama", vocab_size=VOCAB, **shape)
    save_tiny_llama(root / "llama32", vocab_size=32, max_position_embeddings=128, **shape)
    save_tiny_qwen2(root / "qwen", vocab_size=VOCAB, tie_word_embeddings=True, **shape)
    for labels in (1, 2):
        torch.manual_seed(labels)
        LlamaForSequenceClassification(tiny_llama_config(vocab_size=VOCAB, num_labels=labels, **shape)).save_pretrained(
            root / f"rm{labels}")
    torch.manual_seed(3)
    critic = CausalLMWithValueHead(make_tiny_llama(seed=3, vocab_size=VOCAB, **shape))
    torch.nn.init.normal_(critic.v_head.weight)  # far from the fresh head's small init
    critic.lm.save_pretrained(root / "critic")
    save_file({k: v.contiguous() for k, v in critic.v_head.state_dict().items()},
              str(root / "critic" / "value_head.safetensors"))
    (root / "prompts.jsonl").write_text('{"prompt_ids": [3, 4]}\n')
    (root / "sft.jsonl").write_text('{"prompt_ids": [3], "response_ids": [4]}\n')
    return root


def train(models, **sections):
    raw = {"algorithm": "grpo", "output_dir": "out", "model": {"path": str(models / "llama")},
           "reward": {"function": "length"}, "data": {"prompts": str(models / "prompts.jsonl")},
           "rollout": {"n": 4, "max_new_tokens": 8}, "trainer": {"max_steps": 2, "prompts_per_step": 2,
                                                                 "minibatch_size": 8}}
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) and isinstance(value, dict) else value
    return raw


def small(models, **sections):
    """An sft or rm config."""
    raw = {"output_dir": "out", "model": {"path": str(models / "llama")}, "data": {"path": str(models / "sft.jsonl")},
           "trainer": {"max_steps": 2, "batch_size": 2}}
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) and isinstance(value, dict) else value
    return raw


def error(raw, command="train") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, command, on_gpu=False)
    message = str(info.value)
    assert "\n" not in message
    return message


def reward_model(models, folder, **reward):
    return {"function": None, "model_path": str(models / folder), **reward}


# ---- the rollout ----------------------------------------------------------------------------------------------


def test_greedy_completions_of_a_group_are_refused(models):
    """A1: n greedy completions are one completion n times: GRPO's advantages all 0 (and HF generate refuses)."""
    assert error(train(models, rollout={"temperature": 0.0})) == (
        "rollout.n: 4 greedy completions of a prompt are all the same (grpo compares them: every advantage would be "
        "0); set rollout.temperature > 0, or rollout.n: 1")
    rloo = error(train(models, rollout={"temperature": 0.0}, trainer={"adv_estimator": "rloo"}))
    assert rloo.startswith("rollout.n: 4 greedy completions") and "(rloo compares them" in rloo
    ppo = train(models, algorithm="ppo", critic={}, rollout={"temperature": 0.0, "n": 2},
                trainer={"minibatch_size": 2})
    assert error(ppo) == ("rollout.n: 2 greedy completions of a prompt are all the same; set rollout.temperature > 0, "
                          "or rollout.n: 1")
    ppo["rollout"]["n"] = 1  # one greedy completion: allowed before, then the first logprob pass raised unnamed
    assert error(ppo).startswith("rollout.temperature: 0 (greedy) samples nothing to learn from")


def test_stop_token_ids_are_in_the_vocabulary(models):
    """A18."""
    assert error(train(models, rollout={"stop_token_ids": [5, -5]})) == (
        "rollout.stop_token_ids[1]: must be in [0, 64) (model.path's vocabulary), got -5")
    assert error(train(models, rollout={"stop_token_ids": [VOCAB]})) == (
        "rollout.stop_token_ids[0]: must be in [0, 64) (model.path's vocabulary), got 64")
    assert parse_config(train(models, rollout={"stop_token_ids": [0, VOCAB - 1]}), on_gpu=False)


def test_eval_generates_at_most_what_the_engine_holds(models):
    """A11: the engine's context comes from rollout.max_new_tokens; longer eval completions were cut silently."""
    raw = train(models, eval={"data": str(models / "prompts.jsonl"), "max_new_tokens": 64})
    assert error(raw) == ("eval.max_new_tokens: must be at most rollout.max_new_tokens (8, which sizes the engine's "
                          "context), got 64")
    raw["eval"]["max_new_tokens"] = 8
    assert parse_config(raw, on_gpu=False).eval.max_new_tokens == 8


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
def test_lengths_fit_the_models_positions(models, command):
    """A10: 1024 positions (the Llama), 128 (llama32)."""
    if command == "train":
        assert error(train(models, rollout={"max_new_tokens": 2000})) == (
            "rollout.max_new_tokens: data.max_prompt_len + rollout.max_new_tokens = 2256 exceeds model.path's "
            "max_position_embeddings 1024")
        assert parse_config(train(models, rollout={"max_new_tokens": 768}), on_gpu=False)  # 256 + 768 = 1024
        smaller = train(models, reference={"path": str(models / "llama32")}, data={"max_prompt_len": 8})
        assert error(smaller).startswith("reference.path: its vocab_size 32 is smaller")  # checked first
        return
    assert error(small(models, data={"max_len": 5000}), command) == (
        "data.max_len: 5000 exceeds model.path's max_position_embeddings 1024")
    assert parse_config(small(models, data={"max_len": 1024}), command, on_gpu=False).data.max_len == 1024


@pytest.mark.parametrize("section, key", [("reference", "reference.path"), ("critic", "critic.path")])
def test_a_reference_or_critic_reads_the_actors_token_ids(models, section, key):
    """A15: vocab 32 under an actor of 64 would fail at the first forward (index out of range)."""
    extra = {"algorithm": "ppo", "rollout": {"n": 1}, "trainer": {"minibatch_size": 2}} if section == "critic" else {}
    reads = "the critic reads" if section == "critic" else "the reference scores"
    assert error(train(models, **{section: {"path": str(models / "llama32")}}, **extra)) == (
        f"{key}: its vocab_size 32 is smaller than model.path's 64: {reads} the actor's token ids, some of which it "
        "has no embedding for")
    assert parse_config(train(models, **{section: {"path": str(models / "qwen")}}, **extra), on_gpu=False)


def test_a_critic_section_without_a_critic_is_refused(models):
    """A19: under grpo it was ignored, invalid values and all."""
    assert error(train(models, critic={"path": "/nonexistent", "lr": -1.0})) == (
        "critic: algorithm grpo has no critic; remove the section (or use algorithm: ppo)")
    assert parse_config(train(models, critic=None), on_gpu=False).critic is None


# ---- LoRA -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
def test_a_lora_target_typo_is_refused_before_the_model_loads(models, command):
    """A5: peft found it only after the load (NoMatchingPeftModuleError); the plan's rule, for every command."""
    def raw(targets):
        lora = {"lora_r": 8, "lora_targets": targets}
        return train(models, model=lora) if command == "train" else small(models, model=lora)

    assert error(raw(["q_proj", "qproj"]), command) == (
        "model.lora_targets: 'qproj' is no module of a llama model; expected some of q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj, embed_tokens or lm_head")
    assert error(raw([""]), command).startswith("model.lora_targets: '' is no module name; expected some of q_proj")
    assert error(raw(["all-linear", "q_proj"]), command).startswith(
        "model.lora_targets: all-linear stands alone (every Linear of the decoder layers); list the modules instead: "
        "[q_proj, k_proj")
    assert parse_config(raw(["all-linear"]), command, on_gpu=False).model.lora_targets == ["all-linear"]
    assert parse_config(raw(["q_proj", "down_proj"]), command, on_gpu=False).model.lora_targets == ["q_proj",
                                                                                                    "down_proj"]


def test_the_trainer_does_not_downgrade_a_lora_target_error_to_a_warning(models):
    """A5: the launch plan's ConfigErrors are warnings (a model it cannot count), but not this one."""
    from fastrlhf.rl.trainer import _memory_plan

    config = parse_config(train(models, model={"lora_r": 8}), on_gpu=False)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, lora_targets=["qproj"]))
    with pytest.raises(ConfigError, match=r"^model.lora_targets: 'qproj' is no module of a llama model"):
        _memory_plan(config, 1)


@pytest.mark.parametrize("alpha", [0, -16])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_lora_alpha_is_positive(models, alpha, command):
    """A6: the adapter's scale is alpha / r: alpha 0 trained nothing (a flat loss)."""
    lora = {"lora_r": 8, "lora_alpha": alpha}
    raw = train(models, model=lora) if command == "train" else small(models, model=lora)
    assert error(raw, command) == f"model.lora_alpha: must be > 0, got {alpha}"


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_lora_on_tied_embeddings_is_refused(models, target, command):
    """A7: merging an adapter of a tied lm_head (or embed_tokens) changes both: the export differs from the model
    trained (by 3.15 in the logits, the audit measured)."""
    lora = {"path": str(models / "qwen"), "lora_r": 4, "lora_targets": ["q_proj", target]}
    unfused = {"fused_loss": False}
    raw = train(models, model=lora, trainer=unfused) if command == "train" else small(models, model=lora,
                                                                                      trainer=unfused)
    assert error(raw, command) == (
        f"model.lora_targets: {target}: {models / 'qwen'} ties lm_head to embed_tokens (tie_word_embeddings: true), so "
        "merging the adapter at export would write its delta into the shared weight and the exported model would not "
        "be the trained one; leave lm_head and embed_tokens out")
    untied = {**lora, "path": str(models / "llama")}  # the Llama's lm_head is its own
    raw = train(models, model=untied, trainer=unfused) if command == "train" else small(models, model=untied,
                                                                                        trainer=unfused)
    assert target in parse_config(raw, command, on_gpu=False).model.lora_targets


def test_a_reward_model_has_no_lm_head_to_adapt(models):
    lora = {"lora_r": 4, "lora_targets": ["q_proj", "lm_head"]}
    assert error(small(models, model=lora, trainer={"fused_loss": False}), "rm").startswith(
        "model.lora_targets: lm_head: a reward model has a score head, no lm_head")


def test_a_reference_path_with_lora_is_refused(models):
    """A8: with LoRA the reference is the actor with its adapter disabled; reference.path was ignored (kl 0)."""
    raw = train(models, model={"lora_r": 8}, reference={"path": str(models / "llama32")}, trainer={"kl_coef": 0.1})
    assert error(raw) == ("reference.path: is not used with model.lora_r > 0 (the reference is the actor with its "
                          "adapter disabled); remove it, or train without LoRA")


def test_an_adapted_embedding_is_refused_under_zero3(models):
    """peft's embedding factors sit where ZeRO-3's hooks never gather them: the first forward failed
    (``Padding_idx must be within num_embeddings``), after every model had loaded."""
    lora = {"lora_r": 8, "lora_targets": ["q_proj", "embed_tokens"]}
    assert error(train(models, model=lora, deepspeed={"zero_stage": 3})) == (
        "model.lora_targets: embed_tokens cannot be adapted under deepspeed.zero_stage 3 (its LoRA factors are never "
        "gathered); leave it out or use ZeRO 0-2")
    assert parse_config(train(models, model=lora, deepspeed={"zero_stage": 2}), on_gpu=False).model.lora_r == 8


def test_a_reference_path_without_a_kl_term_is_refused(models):
    """With kl_coef 0 the trainer loads no reference: the folder named was never read, and no KL was applied."""
    raw = train(models, reference={"path": str(models / "llama")}, trainer={"kl_coef": 0.0})
    assert error(raw) == ("reference.path: is not used with trainer.kl_coef 0 (no KL term); remove it, or set "
                          "kl_coef > 0")
    raw = train(models, reference={"path": str(models / "llama")}, trainer={"kl_coef": 0.1})
    assert parse_config(raw, on_gpu=False).reference.path == str(models / "llama")


# ---- the reward model -----------------------------------------------------------------------------------------


def test_a_causal_lm_is_no_classifier_reward_model(models):
    """A3: its score head would be fresh and random (the run trained against noise, exit 0)."""
    assert error(train(models, reward=reward_model(models, "llama"))) == (
        f"reward.model_path: {models / 'llama'}'s config.json names no *ForSequenceClassification architecture "
        "(architectures: ['LlamaForCausalLM']); model_kind classifier would score with a fresh, random head (train "
        "one with fastrlhf rm)")
    assert parse_config(train(models, reward=reward_model(models, "rm2")), on_gpu=False).reward.label_index == 0


def test_label_index_is_one_of_the_reward_models_labels(models):
    """A4: found at the first scoring, after every model loaded."""
    assert error(train(models, reward=reward_model(models, "rm2", label_index=5))) == (
        f"reward.label_index: must be below the 2 labels of {models / 'rm2'}, got 5")
    assert parse_config(train(models, reward=reward_model(models, "rm2", label_index=1)), on_gpu=False)
    assert error(train(models, reward=reward_model(models, "rm1", label_index=1))).startswith(
        "reward.label_index: must be below the 1 labels")


def test_a_value_head_reward_model_needs_a_value_head(models):
    """A2: a critic's export or a one-label classifier; a causal LM or a classifier of several labels would score
    with a fresh head."""
    for folder in ("critic", "rm1"):
        config = parse_config(train(models, reward=reward_model(models, folder, model_kind="value_head")), on_gpu=False)
        assert config.reward.model_kind == "value_head"
    for folder in ("llama", "rm2"):
        assert error(train(models, reward=reward_model(models, folder, model_kind="value_head"))) == (
            f"reward.model_path: {models / folder} has no value head for model_kind value_head: neither "
            "value_head.safetensors (as a PPO run's final/critic has, with critic.export) nor a one-label "
            "*ForSequenceClassification score head")
    assert error(train(models, reward=reward_model(models, "critic", model_kind="value_head", label_index=1))) == (
        "reward.label_index: picks a classifier's label; model_kind value_head reads one value, got 1")


def test_a_value_head_reward_model_scores_with_its_own_head(models):
    """A2: the trainer loaded every reward model as a classifier, whose pooled [B, labels] logits the value-head
    scoring then indexed per position (IndexError). Now a critic's export scores as that critic, and a one-label
    classifier as itself."""
    import torch
    from helpers.packing_case import PAD, ragged_batch
    from transformers import AutoModelForSequenceClassification

    from fastrlhf.config import model_checks
    from fastrlhf.modeling import CausalLMWithValueHead, load_causal_lm
    from fastrlhf.modeling.loading import VALUE_HEAD_FILE
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.forward import reward_model_scores
    from fastrlhf.rl.trainer import _reward_model

    assert model_checks.VALUE_HEAD_FILE == VALUE_HEAD_FILE
    prompts, completions = ragged_batch(seed=4)
    for group in completions:
        for c in group:
            c.token_ids = [t % VOCAB for t in c.token_ids]
    prompts = [[t % VOCAB for t in p] for p in prompts]
    exp = build_experience(prompts, completions, PAD)

    config = parse_config(train(models, reward=reward_model(models, "critic", model_kind="value_head")), on_gpu=False)
    loaded = _reward_model(config, torch.device("cpu"))
    assert isinstance(loaded, CausalLMWithValueHead) and not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    from safetensors.torch import load_file

    head = torch.nn.Linear(32, 1)
    head.load_state_dict(load_file(str(models / "critic" / VALUE_HEAD_FILE)))
    critic = CausalLMWithValueHead(load_causal_lm(config.model, str(models / "critic"), trainable=False), head).eval()
    expected = reward_model_scores(critic, exp, "value_head")
    torch.testing.assert_close(reward_model_scores(loaded, exp, "value_head"), expected)
    assert expected.abs().max() > 0.1  # its own head, not a fresh one's near-zero values

    config = parse_config(train(models, reward=reward_model(models, "rm1", model_kind="value_head")), on_gpu=False)
    classifier = AutoModelForSequenceClassification.from_pretrained(str(models / "rm1")).eval()
    classifier.config.fastrlhf_score_position = "last_token"  # read at the last token, as the value head is
    torch.testing.assert_close(reward_model_scores(_reward_model(config, torch.device("cpu")), exp, "value_head"),
                               reward_model_scores(classifier, exp, "classifier"), rtol=1e-5, atol=1e-5)


# ---- model folders --------------------------------------------------------------------------------------------


def copy_model(models, tmp_path, name="m", **config):
    folder = tmp_path / name
    shutil.copytree(models / "llama", folder)
    if config:
        data = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**data, **config}))
    return folder


@pytest.mark.parametrize("pad", [-1, VOCAB])
def test_a_pad_token_outside_the_vocabulary_is_refused(models, tmp_path, pad):
    """A13: every command failed at the first padded forward (IndexError in the embedding)."""
    folder = copy_model(models, tmp_path, pad_token_id=pad)
    assert error(train(models, model={"path": str(folder)})) == (
        f"model.path: {folder / 'config.json'}: pad_token_id {pad} is outside the vocabulary [0, 64)")
    assert error(small(models, model={"path": str(folder)}), "sft").startswith("model.path: ")
    assert parse_config(train(models, model={"path": str(copy_model(models, tmp_path, "ok", pad_token_id=None))}),
                        on_gpu=False)


def sharded(models, tmp_path):
    """The Llama saved in two safetensors shards with an index."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(models / "llama")).save_pretrained(folder, max_shard_size="30KB")
    assert (folder / "model.safetensors.index.json").exists()
    return folder


def broken_folders(models, tmp_path) -> dict:
    """``name -> (folder, the end of its one-line error)``."""
    partial = sharded(models, tmp_path)
    shards = sorted(p.name for p in partial.glob("model-*.safetensors"))
    (partial / shards[0]).unlink()
    empty = copy_model(models, tmp_path, "empty")
    (empty / "model.safetensors").write_bytes(b"")
    headless = copy_model(models, tmp_path, "headless")
    (headless / "model.safetensors").write_bytes(b"\xff" * 64)
    garbled = copy_model(models, tmp_path, "garbled")
    (garbled / "model.safetensors").write_bytes((4).to_bytes(8, "little") + b"{{{{")
    unknown = copy_model(models, tmp_path, "unknown", model_type="llamax")
    from importlib.metadata import version

    return {
        "index": (partial, f"{partial / 'model.safetensors.index.json'} names 1 weight file that is missing "
                           f"({shards[0]}): an incomplete download?"),
        "empty": (empty, f"{empty / 'model.safetensors'} is empty (0 bytes): an incomplete download?"),
        "headless": (headless, f"{headless / 'model.safetensors'} is not a safetensors file (no header in its 64 "
                               "bytes): an incomplete download?"),
        "garbled": (garbled, f"{garbled / 'model.safetensors'} is not a safetensors file (its header is not JSON): an "
                             "incomplete download?"),
        "unknown": (unknown, f"{unknown / 'config.json'} names model_type 'llamax', which transformers "
                             f"{version('transformers')} does not know"),
    }


def test_weights_that_cannot_load_are_refused_for_every_model_key(models, tmp_path):
    """A14: a partial download, an empty or header-less safetensors file, an unknown model_type passed the folder
    check and failed with a traceback as they loaded (a reward model's only after the actor was built)."""
    assert parse_config(train(models, model={"path": str(sharded(models, tmp_path / "whole"))}), on_gpu=False)
    for folder, message in broken_folders(models, tmp_path).values():
        path = str(folder)
        assert error(train(models, model={"path": path})) == f"model.path: {message}"
        assert error(small(models, model={"path": path}), "sft") == f"model.path: {message}"
        assert error(train(models, reference={"path": path})) == f"reference.path: {message}"
        assert error(train(models, reward=reward_model(models, "x", model_path=path))) == (
            f"reward.model_path: {message}")
        ppo = train(models, algorithm="ppo", critic={"path": path}, rollout={"n": 1}, trainer={"minibatch_size": 2})
        assert error(ppo) == f"critic.path: {message}"


def test_a_model_type_outside_the_common_four_is_looked_up(models, tmp_path):
    folder = fake_model_folder(tmp_path / "gpt2", {"model_type": "gpt2"})
    assert parse_config(train(models, model={"path": folder}), on_gpu=False).model.path == folder


# ---- numbers and ranges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
def test_seed_is_an_unsigned_32_bit_number(models, command):
    """A17: numpy refused it after the data was read."""
    def raw(seed):
        return train(models, seed=seed) if command == "train" else small(models, seed=seed)

    for seed in (-1, 2**32, 99999999999999999999999):
        assert error(raw(seed), command) == f"seed: must be in [0, 4294967295], got {seed}"
    assert parse_config(raw(2**32 - 1), command, on_gpu=False).seed == 2**32 - 1


@pytest.mark.parametrize("value", [0, -1])
def test_forward_micro_batch_is_positive_or_null(models, value):
    """A20: 0 silently meant the micro-batch, -1 one sequence per forward."""
    assert error(train(models, trainer={"forward_micro_batch": value})) == (
        f"trainer.forward_micro_batch: must be > 0 (or null), got {value}")


def test_clip_low_keeps_the_ratios_lower_bound_above_zero(models):
    """C: 1 - clip_low <= 0 clips nothing."""
    for value in (1.0, 1.5, -0.1):
        assert error(train(models, trainer={"clip_low": value})) == f"trainer.clip_low: must be in [0, 1), got {value}"
    assert parse_config(train(models, trainer={"clip_low": 0.0, "clip_high": 5.0}), on_gpu=False)
    assert error(train(models, trainer={"clip_high": -0.1})) == "trainer.clip_high: must be >= 0, got -0.1"


@pytest.mark.parametrize("command", ["train", "sft"])
def test_profile_step_is_a_step_of_the_run(models, command):
    """C: a step past max_steps was never profiled."""
    raw = train(models, trainer={"profile_step": 3}) if command == "train" else small(models,
                                                                                   trainer={"profile_step": 3})
    assert error(raw, command) == ("trainer.profile_step: must be at most trainer.max_steps (2), got 3: that step "
                                   "never runs")
    raw["trainer"]["profile_step"] = 2
    assert parse_config(raw, command, on_gpu=False).trainer.profile_step == 2


def test_plan_gpu_memory_0_says_it_must_be_positive(models, tmp_path, capsys):
    """C: --gpu-memory 0 read as "not given" ("--gpu-memory is required: this machine has no CUDA device")."""
    from fastrlhf import cli
    from fastrlhf.memory.plan import PlanError, plan_memory

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(train(models)))
    for size in ("0", "0GiB", "0.1B"):
        assert cli.main(["plan", "--config", str(path), "--gpu-memory", size]) == 2
        assert capsys.readouterr().err.strip() == f"plan: --gpu-memory: must be > 0, got '{size}'"
    with pytest.raises(PlanError, match=r"^plan: --gpu-memory: must be > 0, got 0 bytes$"):
        plan_memory(parse_config(train(models), on_gpu=False), 1, 0, "cpu")


# ---- the config file ------------------------------------------------------------------------------------------


def test_duplicate_keys_name_the_file_and_line(models, tmp_path):
    """A9: the later section silently replaced the earlier one (lr 1e-3 trained at the default 1e-6)."""
    text = yaml.safe_dump(train(models, trainer={"lr": 1.0e-3}), sort_keys=False)
    path = tmp_path / "dup.yaml"
    path.write_text(text + "trainer:\n  max_steps: 2\n")
    line = len(text.splitlines()) + 1
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == f"{path}:{line}: duplicate key trainer"
    path.write_text(text.replace("  lr: 0.001\n", "  lr: 0.001\n  lr: 0.002\n"))
    with pytest.raises(ConfigError, match=r"dup\.yaml:\d+: duplicate key lr$"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"^--set trainer:1: duplicate key lr$"):
        load_config(str(_write(tmp_path, models)), overrides=["trainer={max_steps: 2, lr: 1, lr: 2}"])


def _write(tmp_path, models):
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(train(models)))
    return path


def test_a_config_that_is_not_utf8_is_one_line(models, tmp_path):
    """B1: a UnicodeDecodeError traceback."""
    path = tmp_path / "bad_enc.yaml"
    path.write_bytes(b"algorithm: grpo\n# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == f"--config: cannot read {path}: not valid UTF-8 (line 2, byte 0xe9)"


def test_yaml_integers_are_yaml_1_2s(models, tmp_path):
    """B2: YAML 1.1 read 010 as 8 (octal) and 1:30 as 90 (base 60)."""
    path = _write(tmp_path, models)
    assert load_config(str(path), overrides=["trainer.max_steps=010"]).trainer.max_steps == 10
    with pytest.raises(ConfigError, match=r"^trainer.max_steps: expected an integer, got '1:30'$"):
        load_config(str(path), overrides=["trainer.max_steps=1:30"])
    assert load_config(str(path), overrides=["rollout.sync_bucket_bytes=0x1000"]).rollout.sync_bucket_bytes == 4096
    assert load_config(str(path), overrides=["trainer.max_steps=1_000"]).trainer.max_steps == 1000
    path.write_text(path.read_text().replace("max_steps: 2", "max_steps: 010"))
    assert load_config(str(path)).trainer.max_steps == 10


def test_the_plan_command_still_needs_only_config_json(models, tmp_path):
    """``fastrlhf plan`` is made before the weights are downloaded: the folder checks that read them stay off."""
    from fastrlhf.memory.plan_command import load_plan_config

    folder = tmp_path / "only_config"
    folder.mkdir()
    shutil.copy(models / "llama" / "config.json", folder / "config.json")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(train(models, model={"path": str(folder)})))
    assert load_plan_config(str(path), device="cpu").model.path == str(folder)
    assert os.listdir(folder) == ["config.json"]
