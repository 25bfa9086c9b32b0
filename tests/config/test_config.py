"""Run configs: every class of bad config fails with one line naming the key; examples parse."""

import glob
import os

import pytest
import yaml
from helpers.model_folders import fake_classifier_folder, fake_model_folder
from helpers.paths import ROOT

from fastrlhf.config import (
    ConfigError,
    LoopConfig,
    SFTTrainerConfig,
    TrainConfig,
    TrainerConfig,
    check_world_size,
    load_config,
    parse_config,
)

DROP = "<drop>"
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture
def paths(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    return {"model": fake_model_folder(tmp_path / "model"), "prompts": str(prompts), "out": str(tmp_path / "out"),
            "reward_model": fake_classifier_folder(tmp_path / "rm")}


def grpo(paths, **sections):
    raw = {
        "algorithm": "grpo",
        "output_dir": paths["out"],
        "model": {"path": paths["model"]},
        "reward": {"function": "length"},
        "data": {"prompts": paths["prompts"]},
        "rollout": {"n": 4},
        "trainer": {"max_steps": 10, "prompts_per_step": 4, "minibatch_size": 8},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {k: v for k, v in {**raw[key], **value}.items() if v != DROP}
        elif value == DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def error_of(raw, command="train") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, command)
    message = str(info.value)
    assert "\n" not in message
    return info.value


def test_valid_grpo_config_has_defaults(paths):
    config = parse_config(grpo(paths))
    assert isinstance(config, TrainConfig)
    assert config.rollout_batch_size == 16
    assert config.trainer.lr == 1.0e-6 and config.trainer.kl_kind == "k3"
    assert config.deepspeed.zero_stage == 2 and config.critic is None
    with pytest.raises(AttributeError):
        config.trainer.lr = 1.0  # frozen


@pytest.mark.parametrize(
    "sections, key, phrase",
    [
        ({"algorithm": "ppo"}, "critic", "needs a critic section"),
        ({"trainer": {"minibatch_size": 3}}, "trainer.minibatch_size",
         "3 does not divide the rollout batch of 16 (trainer.prompts_per_step x rollout.n)"),
        ({"rollout": {"n": 1}}, "rollout.n", "rollout.n >= 2"),
        ({"reward": {"function": None}}, "reward", "neither"),
        ({"reward": {"function": "length", "model_path": "x"}}, "reward", "both"),
        ({"deepspeed": {"zero_stage": 4}}, "deepspeed.zero_stage", "0, 1, 2 or 3"),
        ({"trainer": {"lr": 0.0}}, "trainer.lr", "> 0"),
        ({"trainer": {"lr": -1e-5}}, "trainer.lr", "> 0"),
        ({"rollout": {"temperature": -0.5}}, "rollout.temperature", ">= 0"),
        ({"output_dir": DROP}, "output_dir", "missing required key"),
        ({"trainer": {"max_steps": DROP}}, "trainer.max_steps", "missing required key"),
        ({"trainer": {"max_steps": None}}, "trainer.max_steps", "expected an integer"),
        ({"model": {"path": "/nonexistent/model"}}, "model.path", "does not exist"),
        ({"data": {"prompts": "/nonexistent/p.jsonl"}}, "data.prompts", "does not exist"),
        ({"trainer": {"learning_rate": 1e-5}}, "trainer.learning_rate", "unknown key"),
        ({"trainer": {"lr": "fast"}}, "trainer.lr", "expected a number"),
        ({"trainer": {"lr": float("inf")}}, "trainer.lr", "expected a finite number"),
        ({"trainer": {"max_steps": 2.5}}, "trainer.max_steps", "expected an integer"),
        ({"algorithm": "dpo"}, "algorithm", "'grpo' | 'ppo'"),
        ({"deepspeed": {"offload_param": True}}, "deepspeed.offload_param", "zero_stage 3"),
        ({"model": {"lora_targets": "q_proj"}}, "model.lora_targets", "a list of a string"),
        ({"model": {"checkpoint_layers": 4}}, "model.checkpoint_layers",
         "needs gradient_checkpointing: true, got False"),
        ({"model": {"gradient_checkpointing": "auto", "checkpoint_layers": 4}}, "model.checkpoint_layers",
         "with auto the memory plan decides it: leave it null"),
        ({"model": {"gradient_checkpointing": True, "checkpoint_layers": 0}}, "model.checkpoint_layers", "> 0"),
        ({"trainer": {"dual_clip": 0.5}}, "trainer.dual_clip", "> 1"),
        ({"trainer": {"filter_groups": True, "adv_estimator": "reinforce_plus_plus"}}, "trainer.filter_groups",
         "reinforce_plus_plus does not (use gpg, grpo, grpo_passk, opo, reinforce_plus_plus_baseline, rloo)"),
        ({"trainer": {"max_sampling_rounds": 0}}, "trainer.max_sampling_rounds", "> 0"),
        ({"trainer": {"min_lr_ratio": 1.5}}, "trainer.min_lr_ratio", "must be in [0, 1] (of trainer.lr), got 1.5"),
        # the KL is in the advantage the entropy mask zeroes (REINFORCE++ takes it as a token reward)
        ({"trainer": {"top_entropy_quantile": 0.2, "kl_in_reward": True, "adv_estimator": "reinforce_plus_plus"}},
         "trainer.top_entropy_quantile", "which with trainer.kl_in_reward holds the token's KL too"),
        ({"reward": {"function": "length", "clip_range": [1.0, -1.0]}}, "reward.clip_range",
         "must be [low, high] with low < high, got [1.0, -1.0]"),
        ({"trainer": {"lr_schedule": "step"}}, "trainer.lr_schedule", "'constant' | 'linear' | 'cosine'"),
        # the KL would have stayed in the loss, silently (an OpenRLHF group_norm run ported with its KL in the rewards)
        ({"trainer": {"kl_in_reward": True}}, "trainer.kl_in_reward",
         "advantage estimator grpo takes no token rewards, so the KL would stay in the loss: set kl_in_reward false "
         "(the KL in the loss), or an estimator that takes it (gae, reinforce_plus_plus, "
         "reinforce_plus_plus_baseline)"),
        ({"trainer": {"kl_in_reward": True, "adv_estimator": "grpo_passk"}}, "trainer.kl_in_reward",
         "advantage estimator grpo_passk takes no token rewards"),
        ({"trainer": {"profile_step": 0}}, "trainer.profile_step", "> 0"),
        ({"trainer": {"profile_step": 1.5}}, "trainer.profile_step", "expected an integer"),
        ({"trainer": {"kl_target": 0.02, "kl_coef": 0.0}}, "trainer.kl_target", "which is 0 (no KL term"),
        ({"trainer": {"kl_target": -0.1}}, "trainer.kl_target", "> 0"),
        ({"trainer": {"kl_target": 0.02, "kl_horizon": 3}}, "trainer.kl_horizon",
         "must be > 0.2 x the 16 completions of a step, got 3"),
        ({"trainer": {"critic_warmup_steps": 5}}, "trainer.critic_warmup_steps", "algorithm grpo has none"),
        ({"trainer": {"critic_warmup_steps": -1}}, "trainer.critic_warmup_steps", ">= 0"),
        ({"trainer": {"tis_mode": "mask"}}, "trainer.tis_mode", "set trainer.tis_cap too"),
        ({"trainer": {"tis_level": "sequence"}}, "trainer.tis_level", "set trainer.tis_cap too"),
        ({"trainer": {"tis_level": "sentence", "tis_cap": 2.0}}, "trainer.tis_level", "'token' | 'sequence'"),
        ({"trainer": {"tis_cap": 2.0, "tis_floor": 2.5}}, "trainer.tis_floor",
         "must be below trainer.tis_cap (2.0), got 2.5"),
        ({"trainer": {"tis_cap": 2.0, "policy_loss": "kl_cov"}}, "trainer.tis_cap",
         "acts on each token's policy term through its advantage, which policy loss kl_cov does not scale with"),
        ({"trainer": {"top_entropy_quantile": 0.2, "policy_loss": "clip_cov"}}, "trainer.top_entropy_quantile",
         "which policy loss clip_cov does not scale with"),
        ({"trainer": {"tis_cap": 2.0, "tis_mode": "mask", "tis_floor": 2.0}}, "trainer.tis_floor",
         "must be below trainer.tis_cap (2.0), got 2.0"),
        ({"trainer": {"tis_cap": 2.0, "tis_mode": "mask", "tis_floor": 0.0}}, "trainer.tis_floor", "> 0"),
        ({"reward": {"function": "length", "overlong_buffer": 0}}, "reward.overlong_buffer",
         "must be in [1, rollout.max_new_tokens = 64] (or null), got 0"),
        ({"reward": {"function": "length", "overlong_buffer": 65}}, "reward.overlong_buffer", "got 65"),
        ({"reward": {"function": "length", "overlong_penalty": -1.0}}, "reward.overlong_penalty", ">= 0"),
        ({"reward": {"function": "length", "overlong_buffer": 8}, "rollout": {"tools": ["x:y"]}},
         "reward.overlong_buffer", "an episode's completion holds several turns"),
    ],
)
def test_impossible_train_configs_name_the_key(paths, sections, key, phrase):
    err = error_of(grpo(paths, **sections))
    assert err.key == key, str(err)
    assert str(err).startswith(f"{key}: ") and phrase in str(err), str(err)


def test_checkpoint_layers_are_at_most_the_models_layers(paths):
    with open(os.path.join(paths["model"], "config.json"), "w") as f:
        f.write('{"model_type": "llama", "num_hidden_layers": 2}')
    on = {"gradient_checkpointing": True}
    assert parse_config(grpo(paths, model={**on, "checkpoint_layers": 2})).model.checkpoint_layers == 2
    err = error_of(grpo(paths, model={**on, "checkpoint_layers": 3}))
    assert str(err) == "model.checkpoint_layers: must be at most the model's 2 decoder layers, got 3"


def test_ppo_with_critic_section_is_valid(paths):
    config = parse_config(grpo(paths, algorithm="ppo", critic={"lr": 2e-5}, rollout={"n": 1},
                               trainer={"minibatch_size": 4}))
    assert config.critic.path is None and config.critic.lr == 2e-5
    # An empty `critic:` means all defaults.
    assert parse_config(grpo(paths, algorithm="ppo", critic=None)).critic is not None


def write_yaml(path, raw):
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_set_overrides_parse_yaml_scalars(paths, tmp_path):
    path = write_yaml(tmp_path / "run.yaml", grpo(paths))
    config = load_config(path, "train", ["trainer.lr=1e-5", "rollout.n=8", "trainer.tis_cap=null",
                                         "trainer.minibatch_size=16", "deepspeed.bf16=true"])
    assert config.trainer.lr == 1e-5 and config.rollout.n == 8 and config.trainer.tis_cap is None
    assert config.deepspeed.bf16 is True
    with pytest.raises(ConfigError, match=r"^trainer\.lrr: unknown key"):
        load_config(path, "train", ["trainer.lrr=1"])
    with pytest.raises(ConfigError, match=r"^--set: expected key=value"):
        load_config(path, "train", ["trainer.lr"])
    with pytest.raises(ConfigError, match=r"^rollout.n: is 4, not a section"):
        load_config(path, "train", ["rollout.n.x=1"])


def test_yaml_floats_without_dot(paths, tmp_path):
    raw_text = yaml.safe_dump(grpo(paths)).replace("minibatch_size: 8", "minibatch_size: 8\n  lr: 3e-6")
    path = tmp_path / "run.yaml"
    path.write_text(raw_text)
    assert load_config(str(path)).trainer.lr == 3e-6


def test_bad_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algorithm: grpo\ntrainer: {max_steps: 1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.yaml"))


def test_sft_and_rm_schemas(paths):
    sft = {"output_dir": paths["out"], "model": {"path": paths["model"]}, "data": {"path": paths["prompts"]},
           "trainer": {"max_steps": 3, "batch_size": 4}}
    assert parse_config(sft, "sft").trainer.batch_size == 4
    assert error_of({**sft, "trainer": {"max_steps": 3, "batch_size": 4, "grad_accum": 3}}, "sft").key == \
        "trainer.grad_accum"
    assert error_of({**sft, "data": {"path": "/none"}}, "sft").key == "data.path"
    assert error_of({k: v for k, v in sft.items() if k != "output_dir"}, "sft").key == "output_dir"
    rm = {**sft, "kind": "classifier"}
    assert parse_config(rm, "rm").resolved_num_labels == 2
    assert parse_config({**sft}, "rm").resolved_num_labels == 1
    assert error_of({**rm, "kind": "pairwise", "num_labels": 3}, "rm").key == "num_labels"
    assert error_of({**rm, "kind": "ranking"}, "rm").key == "kind"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml"))))
def test_examples_parse(path, paths):
    command = {"grpo": "train", "ppo": "train", "sft": "sft", "rm": "rm"}[os.path.basename(path)[:-5]]
    overrides = [f"model.path={paths['model']}", f"output_dir={paths['out']}"]
    if os.path.basename(path) == "ppo.yaml":
        overrides.append(f"reward.model_path={paths['reward_model']}")
    cwd = os.getcwd()
    os.chdir(os.path.join(EXAMPLES, ".."))  # the examples' data paths are relative to the checkout root
    try:
        config = load_config(path, command, overrides)
    finally:
        os.chdir(cwd)
    assert config.output_dir == paths["out"]


def test_example_count():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(EXAMPLES, "*.yaml"))}
    assert {"grpo.yaml", "ppo.yaml", "sft.yaml", "rm.yaml"} <= names


def test_eval_section(paths):
    config = parse_config(grpo(paths, eval={"data": paths["prompts"], "every": 5, "group_by": "kind",
                                            "stop_at": 0.99}))
    assert config.eval.every == 5 and config.eval.stop_at == 0.99 and config.eval.reward is None
    assert (config.eval.n, config.eval.temperature, config.eval.before_train) == (1, 0.0, True)
    assert parse_config(grpo(paths)).eval.data is None  # no validation by default
    assert error_of(grpo(paths, eval={"stop_at": 0.9})).key == "eval.stop_at"
    assert "needs eval.data" in str(error_of(grpo(paths, eval={"group_by": "kind"})))
    assert error_of(grpo(paths, eval={"data": paths["prompts"], "every": 0})).key == "eval.every"
    assert error_of(grpo(paths, eval={"data": paths["out"] + "/nope.jsonl"})).key == "eval.data"
    # The old key name fails with the new one named.
    renamed = error_of(grpo(paths, eval={"prompts": paths["prompts"]}))
    assert renamed.key == "eval.prompts" and "renamed to eval.data" in str(renamed)
    # pass@n needs sampling: n greedy completions would all be the same.
    assert error_of(grpo(paths, eval={"data": paths["prompts"], "n": 4})).key == "eval.n"
    assert parse_config(grpo(paths, eval={"data": paths["prompts"], "n": 4, "temperature": 1.0})).eval.n == 4
    assert error_of(grpo(paths, eval={"data": paths["prompts"], "temperature": -1})).key == "eval.temperature"
    # A reward model or batch text rewards validate with the run's own reward: no eval.reward needed.
    learned = grpo(paths, reward={"function": DROP, "model_path": paths["reward_model"]},
                   eval={"data": paths["prompts"]})
    assert parse_config(learned).eval.reward is None
    learned["eval"]["reward"] = "length"
    assert parse_config(learned).eval.reward == "length"


def sft_raw(paths, **trainer):
    return {"output_dir": paths["out"], "model": {"path": paths["model"]}, "data": {"path": paths["prompts"]},
            "trainer": {"max_steps": 3, "batch_size": 4, **trainer}}


def test_trainers_share_the_loop_settings_once():
    import dataclasses

    loop = [f.name for f in dataclasses.fields(LoopConfig)]
    for cls in (TrainerConfig, SFTTrainerConfig):
        assert issubclass(cls, LoopConfig)
        assert [f.name for f in dataclasses.fields(cls)][: len(loop)] == loop  # loop settings first, in one order
    assert "fused_loss" in loop and "use_fused_loss" not in {f.name for f in dataclasses.fields(SFTTrainerConfig)}
    assert TrainerConfig(max_steps=1).lr == 1.0e-6 and SFTTrainerConfig(max_steps=1).lr == 1.0e-5


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_sft_and_rm_fused_loss_and_its_old_name(paths, tmp_path, command):
    assert parse_config(sft_raw(paths), command).trainer.fused_loss is True
    assert parse_config(sft_raw(paths, fused_loss=False), command).trainer.fused_loss is False
    err = error_of(sft_raw(paths, use_fused_loss=False), command)
    assert err.key == "trainer.use_fused_loss"
    assert str(err) == "trainer.use_fused_loss: was renamed to trainer.fused_loss; use that key instead"
    # The same through --set.
    path = write_yaml(tmp_path / "run.yaml", sft_raw(paths))
    with pytest.raises(ConfigError, match=r"^trainer\.use_fused_loss: was renamed to trainer\.fused_loss"):
        load_config(path, command, ["trainer.use_fused_loss=false"])


def test_policy_loss(paths):
    assert parse_config(grpo(paths)).trainer.policy_loss == "vanilla"
    assert parse_config(grpo(paths, trainer={"policy_loss": "gspo"})).trainer.policy_loss == "gspo"
    assert error_of(grpo(paths, trainer={"policy_loss": ""})).key == "trainer.policy_loss"
    assert error_of(grpo(paths, trainer={"policy_loss": 3})).key == "trainer.policy_loss"
    assert "unknown policy loss 'ppo2'; registered: cispo, clip_cov, gpg, gspo, kl_cov, sapo, vanilla" in str(
        error_of(grpo(paths, trainer={"policy_loss": "ppo2"})))


def test_policy_loss_args_are_the_losss_own_options_checked_before_any_work(paths, tmp_path):
    sapo = parse_config(grpo(paths, trainer={"policy_loss": "sapo", "policy_loss_args": {"tau_neg": 1.2}}))
    assert sapo.trainer.policy_loss_args == {"tau_neg": 1.2}
    path = write_yaml(tmp_path / "run.yaml", grpo(paths, trainer={"policy_loss": "sapo"}))
    assert load_config(path, "train", ["trainer.policy_loss_args.tau_pos=0.9"]).trainer.policy_loss_args == {
        "tau_pos": 0.9}
    for trainer, key, phrase in [
        ({"policy_loss": "sapo", "policy_loss_args": {"tau": 1.0}}, "trainer.policy_loss_args.tau",
         "is not an option of policy loss sapo (its options: tau_neg, tau_pos)"),
        ({"policy_loss_args": {"tau_pos": 1.0}}, "trainer.policy_loss_args.tau_pos",
         "is not an option of policy loss vanilla (it takes none)"),
        ({"policy_loss": "sapo", "policy_loss_args": {"tau_pos": "warm"}}, "trainer.policy_loss_args.tau_pos",
         "expected a number, got 'warm'"),
        ({"policy_loss": "sapo", "policy_loss_args": {"tau_pos": float("inf")}}, "trainer.policy_loss_args.tau_pos",
         "expected a finite number, got inf"),
        ({"policy_loss": "sapo", "policy_loss_args": {"tau_pos": True}}, "trainer.policy_loss_args.tau_pos",
         "expected a number, got True"),
        ({"policy_loss": "sapo", "policy_loss_args": {"tau_neg": -1.0}}, "trainer.policy_loss_args",
         "tau_pos and tau_neg must be > 0, got 1.0 and -1.0"),
    ]:
        err = error_of(grpo(paths, trainer=trainer))
        assert err.key == key and phrase in str(err), str(err)


def world_error(config, world) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check_world_size(config, world)
    assert "\n" not in str(info.value)
    return info.value


def test_check_world_size_prompts_per_step(paths):
    config = parse_config(grpo(paths, rollout={"n": 2}, trainer={"prompts_per_step": 6, "minibatch_size": 6}))
    check_world_size(config, 3)
    err = world_error(config, 4)
    assert err.key == "trainer.prompts_per_step"
    assert str(err) == ("trainer.prompts_per_step: 6 does not split over 4 ranks (each rank samples whole groups "
                        "for its own prompts)")


def test_check_world_size_minibatch_size(paths):
    config = parse_config(grpo(paths, trainer={"prompts_per_step": 4, "minibatch_size": 8, "grad_accum": 2}))
    check_world_size(config, 2)  # 8 = 2 ranks x 2 micro-steps x 2
    check_world_size(config, 4)
    err = world_error(parse_config(grpo(paths, trainer={"prompts_per_step": 4, "minibatch_size": 4,
                                                        "grad_accum": 2})), 4)
    assert err.key == "trainer.minibatch_size"
    assert str(err) == ("trainer.minibatch_size: 4 sequences per optimizer step do not split over 4 ranks x "
                        "trainer.grad_accum 2")


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_check_world_size_batch_size(paths, command):
    config = parse_config(sft_raw(paths, batch_size=8, grad_accum=2), command)
    check_world_size(config, 1)
    check_world_size(config, 4)
    err = world_error(config, 3)
    assert err.key == "trainer.batch_size"
    assert str(err) == "trainer.batch_size: 8 does not split over 3 ranks x trainer.grad_accum 2"


def test_importing_config_stays_cheap():
    import subprocess
    import sys

    code = "import sys, fastrlhf.config; sys.exit(1 if 'torch' in sys.modules else 0)"
    root = ROOT
    assert subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60).returncode == 0


def test_reward_functions_batch_text_rewards(paths):
    raw = grpo(paths, reward={"function": None, "functions": [{"function": "mod:exact", "weight": 2.0},
                                                              {"function": "length"}]})
    config = parse_config(raw)
    assert [(f.function, f.weight) for f in config.reward.functions] == [("mod:exact", 2.0), ("length", 1.0)]
    bad = grpo(paths, reward={"function": None, "functions": [{"function": "a:b:c"}]})
    assert error_of(bad).key == "reward.functions[0].function"
    assert error_of(grpo(paths, reward={"function": None, "functions": [{"weight": 1.0}]})).key == \
        "reward.functions[0].function"
    assert "set reward.function, reward.functions or reward.model_path" in str(
        error_of(grpo(paths, reward={"function": None, "functions": []})))
    # Validation scores with the run's reward, text rewards included.
    with_eval = grpo(paths, reward={"function": None, "functions": [{"function": "length"}]},
                     eval={"data": paths["prompts"]})
    assert parse_config(with_eval).eval.reward is None


# ---- imports, trainer.adv_estimator, W&B (issue 44, items 4 and 7) -------------------------------------------


@pytest.fixture
def plugin(tmp_path):
    """``plugin(source) -> module name``: a module of the user's (tests/helpers/plugins.py)."""
    from helpers.plugins import user_plugins

    with user_plugins(tmp_path / "plugins") as make:
        yield make


LOSS_PLUGIN = """
from fastrlhf.algorithms import register_policy_loss, vanilla_policy_loss

@register_policy_loss("{name}")
def loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, dual_clip):
    return vanilla_policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=clip_low, clip_high=clip_high)
"""

ESTIMATOR_PLUGIN = """
from fastrlhf.algorithms import register_adv_est, grpo_token_advantages

register_adv_est("{name}")(grpo_token_advantages)
"""


def test_imports_register_a_policy_loss_and_an_estimator_before_the_config_is_checked(paths, plugin, tmp_path):
    loss, estimator = plugin(LOSS_PLUGIN.format(name="test_loss")), plugin(ESTIMATOR_PLUGIN.format(name="test_est"))
    raw = grpo(paths, imports=[loss, estimator], trainer={"policy_loss": "test_loss", "adv_estimator": "test_est"})
    config = parse_config(raw)
    assert config.imports == [loss, estimator] and config.trainer.adv_estimator == "test_est"
    assert parse_config(grpo(paths)).imports == [] and parse_config(grpo(paths)).trainer.adv_estimator == "auto"
    # --import (load_config's imports) comes first in the config's imports, once.
    path = write_yaml(tmp_path / "run.yaml", grpo(paths, imports=[estimator], trainer={"policy_loss": "test_loss"}))
    assert load_config(path, "train", imports=[loss, estimator]).imports == [loss, estimator]
    for command in ("sft", "rm"):
        assert parse_config({**sft_raw(paths), "imports": [loss]}, command).imports == [loss]


@pytest.mark.parametrize("imports, message", [
    (["no_such_module_here"], "imports[0]: cannot import 'no_such_module_here': ModuleNotFoundError: No module named "
                              "'no_such_module_here'"),
    (["plugins/my_loss.py"], "imports[0]: 'plugins/my_loss.py' is a path; give a module name (e.g. my_loss) importable "
                             "from the current directory or PYTHONPATH"),
    ("my_loss", "imports: expected a list of module names, got 'my_loss'"),
])
def test_an_import_that_fails_is_one_line_naming_it(paths, imports, message):
    assert str(error_of(grpo(paths, imports=imports))) == message


def test_an_import_that_raises_names_the_line_of_the_users_file(paths, plugin, tmp_path):
    name = plugin("x = 1\nraise RuntimeError('not configured')\n")
    where = os.path.relpath(tmp_path / "plugins" / f"{name}.py")
    assert str(error_of(grpo(paths, imports=[name]))) == (f"imports[0]: cannot import '{name}': RuntimeError: not "
                                                          f"configured ({where}:2)")


def test_adv_estimator_names_a_registered_one(paths):
    unknown = error_of(grpo(paths, trainer={"adv_estimator": "nope"}))
    assert ("unknown advantage estimator 'nope'; registered: gae, gpg, grpo, grpo_passk, opo, reinforce_plus_plus, "
            "reinforce_plus_plus_baseline, rloo (or auto)") in str(unknown)
    assert str(error_of(grpo(paths, trainer={"adv_estimator": "gae"}))) == ("trainer.adv_estimator: gae needs a "
                                                                           "critic's values: algorithm ppo")


def test_adv_estimator_fits_the_algorithm_and_the_group_size(paths):
    def with_(algorithm, estimator, n):
        extra = {"critic": None} if algorithm == "ppo" else {}
        return grpo(paths, algorithm=algorithm, rollout={"n": n}, **extra,
                    trainer={"adv_estimator": estimator, "max_steps": 1, "prompts_per_step": 4, "minibatch_size": 4})

    for name in ("rloo", "reinforce_plus_plus_baseline"):
        assert parse_config(with_("grpo", name, 2)).trainer.adv_estimator == name
        assert str(error_of(with_("grpo", name, 1))) == (f"rollout.n: {name} compares completions within a group and "
                                                         "needs rollout.n >= 2, got 1")
    # REINFORCE++ needs no group: one completion per prompt is a valid run.
    assert parse_config(with_("grpo", "reinforce_plus_plus", 1)).rollout.n == 1
    assert str(error_of(with_("ppo", "rloo", 2))) == (
        "trainer.adv_estimator: rloo gives no returns for algorithm ppo's critic to train on; run it with algorithm "
        "grpo (no critic)")
    assert parse_config(with_("ppo", "gae", 1)).trainer.adv_estimator == "gae"


def test_scale_by_std_is_a_switch_or_batch(paths):
    assert parse_config(grpo(paths, trainer={"scale_by_std": "batch"})).trainer.scale_by_std == "batch"
    assert parse_config(grpo(paths, trainer={"scale_by_std": False})).trainer.scale_by_std is False
    assert error_of(grpo(paths, trainer={"scale_by_std": "group"})).key == "trainer.scale_by_std"


def test_the_adaptive_kl_and_the_critic_warmup_parse(paths):
    t = parse_config(grpo(paths, trainer={"kl_target": 0.02, "kl_horizon": 4})).trainer  # 4 > 0.2 x 16
    assert (t.kl_target, t.kl_horizon, t.critic_warmup_steps) == (0.02, 4, 0)
    ppo = parse_config(grpo(paths, algorithm="ppo", critic={}, trainer={"critic_warmup_steps": 5}))
    assert ppo.trainer.critic_warmup_steps == 5 and ppo.trainer.kl_target is None


def test_filter_groups_runs_with_the_estimators_that_compare_a_group(paths):
    for estimator in ("auto", "rloo", "reinforce_plus_plus_baseline"):
        config = parse_config(grpo(paths, trainer={"filter_groups": True, "adv_estimator": estimator}))
        assert config.trainer.filter_groups and config.trainer.max_sampling_rounds == 3
    ppo = error_of(grpo(paths, algorithm="ppo", critic={}, trainer={"filter_groups": True}))
    assert str(ppo).startswith("trainer.filter_groups: ") and "gae does not" in str(ppo)


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
def test_wandb_mode_project_and_run_name(paths, command):
    def raw(**trainer):
        if command == "train":
            return grpo(paths, trainer=trainer)
        return sft_raw(paths, **trainer)

    assert parse_config(raw(), command).trainer.wandb is False
    for mode in (True, "offline", "online"):
        t = parse_config(raw(wandb=mode, wandb_project="p", wandb_run_name="r"), command).trainer
        assert (t.wandb, t.wandb_project, t.wandb_run_name) == (mode, "p", "r")
    assert str(error_of(raw(wandb="cloud"), command)) == ("trainer.wandb: expected true or false or 'offline' | "
                                                          "'online', got 'cloud'")
    assert str(error_of(raw(wandb_project="p"), command)) == ("trainer.wandb_project: needs trainer.wandb (offline or "
                                                              "online), which is off")
    assert str(error_of(raw(wandb_projekt="p"), command)) == ("trainer.wandb_projekt: unknown key; did you mean "
                                                              "trainer.wandb_project?")  # a typo
    err = str(error_of(raw(wandb_host="p"), command))
    assert err.startswith("trainer.wandb_host: unknown key (known keys here: ")  # nothing close: every key named
    assert "wandb, wandb_project, wandb_run_name" in err


def test_liger_kernels_are_refused_where_they_cannot_run(paths, monkeypatch):
    raw = grpo(paths, model={"path": paths["model"], "liger_kernels": True})
    with pytest.raises(ConfigError, match="model.liger_kernels: needs a CUDA device"):
        parse_config(raw, "train", on_gpu=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="model.liger_kernels: needs the liger-kernel package"):
        parse_config(raw, "train", on_gpu=True)
    assert parse_config(grpo(paths), "train", on_gpu=False).model.liger_kernels is False


def test_compile_is_refused_with_zero3_and_with_liger(paths):
    compiled = {"path": paths["model"], "compile": True}
    assert parse_config(grpo(paths, model=compiled), "train", on_gpu=False).model.compile is True
    assert parse_config(grpo(paths), "train", on_gpu=False).model.compile is False
    with pytest.raises(ConfigError, match=r"^model.compile: needs deepspeed.zero_stage 0, 1 or 2 .*got 3$"):
        parse_config(grpo(paths, model=compiled, deepspeed={"zero_stage": 3}), "train", on_gpu=False)
    with pytest.raises(ConfigError, match=r"^model.compile: needs deepspeed.zero_stage"):
        parse_config(sft_raw(paths) | {"model": compiled, "deepspeed": {"zero_stage": 3}}, "sft", on_gpu=False)
    with pytest.raises(ConfigError, match=r"^model.compile: cannot be combined with model.liger_kernels"):
        parse_config(grpo(paths, model={**compiled, "liger_kernels": True}), "train", on_gpu=True)


def test_fp32_logits_need_the_fused_loss_and_an_rl_run(paths):
    fp32 = {"path": paths["model"], "fp32_logits": True}
    assert parse_config(grpo(paths, model=fp32), "train", on_gpu=False).model.fp32_logits is True
    assert parse_config(grpo(paths), "train", on_gpu=False).model.fp32_logits is False
    with pytest.raises(ConfigError, match=r"^model.fp32_logits: needs trainer.fused_loss: true"):
        parse_config(grpo(paths, model=fp32, trainer={"max_steps": 1, "fused_loss": False}), "train", on_gpu=False)
    with pytest.raises(ConfigError, match=r"^model.fp32_logits: .*sft has no engine"):
        parse_config(sft_raw(paths) | {"model": fp32}, "sft", on_gpu=False)
    with pytest.raises(ConfigError, match=r"^model.fp32_logits: a reward model has a score head"):
        parse_config(sft_raw(paths) | {"model": fp32}, "rm", on_gpu=False)


def test_lora_on_the_lm_head_is_refused_with_the_fused_kernels(paths):
    """The fused kernels read the head's weight: an adapter on lm_head would be skipped, its logprobs off by nats
    (tests/rl/test_rl_step.py shows it)."""
    lora = {"path": paths["model"], "lora_r": 4, "lora_targets": ["q_proj", "lm_head"]}
    with pytest.raises(ConfigError, match=r"^model.lora_targets: lm_head: the fused kernels read"):
        parse_config(grpo(paths, model=lora), "train", on_gpu=False)
    with pytest.raises(ConfigError, match=r"^model.lora_targets: lm_head"):
        parse_config(sft_raw(paths) | {"model": lora}, "sft", on_gpu=False)
    unfused = parse_config(grpo(paths, model=lora, trainer={"max_steps": 1, "fused_loss": False}), "train",
                           on_gpu=False)
    assert "lm_head" in unfused.model.lora_targets


@pytest.mark.parametrize("rollout, trainer, key, said", [
    # greedy with one completion: nothing sampled to learn from, and the trainer's logprobs at T=0 raised later
    (dict(n=1, temperature=0), {}, "rollout.temperature", "0 (greedy) samples nothing to learn from"),
    # vLLM raises a temperature below 0.01 to 0.01 with only a log line: its logprobs then are not the trainer's
    (dict(temperature=0.005, engine="vllm"), {}, "rollout.temperature", "vLLM samples at 0.01 at least"),
    (dict(temperature=0.005), {}, "rollout.temperature", "vLLM samples at 0.01 at least"),  # auto may pick vLLM
    # top-p/top-k: the engines' logprobs are renormalised over the kept tokens (TIS weights of 0.80 at top_p 0.8)
    (dict(top_p=0.9), dict(tis_cap=2.0), "trainer.tis_cap", "over the kept tokens only"),
    (dict(top_k=20), dict(tis_cap=2.0), "trainer.tis_cap", "over the kept tokens only"),
])
def test_sampling_the_trainer_cannot_score_alike_is_refused(paths, rollout, trainer, key, said):
    err = error_of(grpo(paths, rollout={"n": 1 if rollout.get("n") == 1 else 4, **rollout},
                        trainer={"prompts_per_step": 4, "minibatch_size": 4 if rollout.get("n") == 1 else 8,
                                 **trainer}, **({"algorithm": "ppo", "critic": {}} if rollout.get("n") == 1 else {})))
    assert err.key == key and said in str(err), err


def test_a_low_temperature_runs_on_hf_and_tis_without_truncation(paths):
    parse_config(grpo(paths, rollout={"temperature": 0.005, "engine": "hf"}))
    parse_config(grpo(paths, trainer={"tis_cap": 2.0}))


def test_chat_template_kwargs_are_the_templates_own_variables(paths):
    config = parse_config(grpo(paths, data={"chat_template_kwargs": {"enable_thinking": False}}))
    assert config.data.chat_template_kwargs == {"enable_thinking": False}
    err = error_of(grpo(paths, data={"chat_template_kwargs": {"tools": []}}))
    assert err.key == "data.chat_template_kwargs" and "'tools' is set by fastrlhf" in str(err), err
    err = error_of(grpo(paths, data={"chat_template_kwargs": ["enable_thinking"]}))
    assert err.key == "data.chat_template_kwargs", err


def test_fp16_through_deepspeed_extra_is_refused_before_anything_starts(paths):
    """DeepSpeed's loss scaler skips its calibration steps, which the step guard counted as bad steps: a healthy run
    stopped at step 3. fastrlhf.engine.deepspeed refused it only once the models had loaded."""
    err = error_of(grpo(paths, deepspeed={"extra": {"fp16": {"enabled": True}}}))
    assert err.key == "deepspeed.extra.fp16", err
    parse_config(grpo(paths, deepspeed={"extra": {"fp16": {"enabled": False}}}))
