"""The command line as a user coming from TRL, OpenRLHF or verl meets it: ``--set`` with a mapping, and
``--dry-run`` under a launcher (one printed config; a failed check on several nodes waits for no gate)."""

import pytest
import yaml
from helpers.model_folders import fake_model_folder, fake_train_yaml

from fastrlhf import cli
from fastrlhf.config import ConfigError, load_config


@pytest.fixture
def train_yaml(tmp_path):
    return fake_train_yaml(tmp_path, engine="hf", temperature=0.7, max_new_tokens=32)


def test_a_mapping_set_on_a_section_keeps_the_files_other_keys(train_yaml):
    """Hydra (verl) merges ``key={...}`` into the section: the file's rollout.temperature and max_new_tokens
    must not fall back to their defaults (1.0 and 64) because --set named rollout.n."""
    config = load_config(train_yaml, "train", ["rollout={n: 8}"], on_gpu=False)
    assert (config.rollout.n, config.rollout.temperature, config.rollout.max_new_tokens) == (8, 0.7, 32)
    config = load_config(train_yaml, "train", ["rollout.top_k=5", "rollout={temperature: 0.5}"], on_gpu=False)
    assert (config.rollout.top_k, config.rollout.temperature, config.rollout.n) == (5, 0.5, 4)
    # Nested mappings merge too; a value that is no mapping still replaces.
    config = load_config(
        train_yaml,
        "train",
        ["trainer={max_steps: 3}", "reward={function: null, functions: [{function: length}]}"],
        on_gpu=False,
    )
    assert (config.trainer.max_steps, config.trainer.prompts_per_step, config.trainer.minibatch_size) == (3, 4, 8)
    assert config.reward.function is None and [f.function for f in config.reward.functions] == ["length"]


def test_a_dry_run_under_a_launcher_prints_the_config_once(train_yaml, monkeypatch, capsys):
    """Every rank checks; only rank 0 prints (eight ranks' YAML interleaved on one stdout is no config)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli.main(["train", "--config", train_yaml, "--dry-run"]) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cli.main(["train", "--config", train_yaml, "--dry-run"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["n"] == 4


@pytest.mark.parametrize(
    "override",
    ["trainer.minibatch_size=3", "data.prompts=missing.jsonl", "data.max_prompt_len=1"],
    ids=["config-at-load", "config-in-preflight", "data-in-preflight"],
)
def test_a_failed_dry_run_on_several_nodes_waits_at_no_start_gate(train_yaml, monkeypatch, capsys, override):
    """A dry run's ranks never go to the start gate, so rank 0 posting a failure there (as a real run's does)
    waited FASTRLHF_DIST_TIMEOUT (default 30 minutes) for ranks that had already left."""
    from fastrlhf.distributed import multinode

    gate = []
    monkeypatch.setattr(multinode, "start_gate", lambda *a, **k: gate.append(k))
    # Before the process group, as a launched rank is (an earlier in-process test may have left one up here)
    monkeypatch.setattr(cli, "_group_started", lambda: False)
    for name, value in {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    assert multinode.is_multi_node()
    assert cli.main(["train", "--config", train_yaml, "--dry-run", "--set", override]) == 2
    assert gate == []
    assert capsys.readouterr().err.splitlines()[-1].startswith(("config error: ", "data error: "))
    # A real run's failed check still tells the other nodes at the gate.
    assert cli.main(["train", "--config", train_yaml, "--set", "trainer.minibatch_size=3"]) == 2
    assert len(gate) == 1 and gate[0]["failure"].startswith("config error: trainer.minibatch_size")


def test_plan_takes_import_as_train_does(tmp_path, capsys):
    """A config whose policy loss a module registers (``fastrlhf train --import my_loss``) is planned with the
    same flag; without it the plan refuses the loss as unknown."""
    from helpers.paths import ROOT
    from helpers.plan_cases import QWEN25_1_5B, model_folder
    from helpers.plugins import user_plugins

    raw = yaml.safe_load(open(f"{ROOT}/examples/gpu/grpo_qwen2.5_1.5b.yaml"))
    raw["model"]["path"] = model_folder(tmp_path / "model", QWEN25_1_5B)
    raw["trainer"]["policy_loss"] = "audit6_loss"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    args = ["plan", "--config", str(tmp_path / "run.yaml"), "--gpus", "8", "--gpu-memory", "80GiB"]
    with user_plugins(tmp_path / "plugins") as make:
        module = make(
            "from fastrlhf.algorithms import POLICY_LOSSES, register_policy_loss\n\n"
            "register_policy_loss('audit6_loss')(POLICY_LOSSES['vanilla'].fn)\n"
        )
        assert cli.main([*args, "--import", module]) == 0
        assert "actor optimizer states" in capsys.readouterr().out
    assert cli.main(args) == 2
    assert "unknown policy loss 'audit6_loss'" in capsys.readouterr().err


def test_ctrl_c_during_a_dry_run_is_one_line_and_130(train_yaml, monkeypatch, capsys):
    """The dry run's checks read the data and the tokenizer, which can take minutes: Ctrl-C there ends as it
    does before a run starts (it was a KeyboardInterrupt traceback)."""
    from fastrlhf.engine import outputs

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "check_writable", interrupted)
    assert cli.main(["train", "--config", train_yaml, "--dry-run"]) == cli.EXIT_INTERRUPTED
    captured = capsys.readouterr()
    assert captured.err == "interrupted (Ctrl-C) before the run started\n" and captured.out == ""


def test_a_missing_local_model_folder_shaped_like_a_hub_id_names_where_it_was_looked_for(tmp_path, monkeypatch):
    """Every example reads runs/tiny-chat: before it is made (or from another directory) the line said only to
    download ``runs/tiny-chat`` from the model hub, which has no such model."""
    from helpers.paths import ROOT

    from fastrlhf.config import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(f"{ROOT}/examples/grpo.yaml", "train", on_gpu=False)
    message = str(info.value)
    assert message.startswith("model.path: runs/tiny-chat is not a local folder")
    assert message.endswith(f"; no folder {tmp_path / 'runs' / 'tiny-chat'} exists either")


@pytest.mark.parametrize(
    "command, example, expected",
    [
        (
            "train",
            "sft",
            "algorithm: missing required key, and data.path is the data of `fastrlhf sft` or `fastrlhf rm`",
        ),
        ("train", "rm", "kind: is a key of `fastrlhf rm` configs: run this config with `fastrlhf rm`"),
        ("sft", "grpo", "algorithm: is a key of `fastrlhf train` configs: run this config with `fastrlhf train`"),
        ("rm", "ppo", "algorithm: is a key of `fastrlhf train` configs"),
        ("sft", "rm", "kind: is a key of `fastrlhf rm` configs"),
    ],
)
def test_a_config_given_to_another_command_is_named_as_such(command, example, expected):
    """``fastrlhf train --config examples/sft.yaml`` said ``algorithm: missing required key``, and
    ``fastrlhf sft --config examples/grpo.yaml`` ``algorithm: unknown key``: neither says the command is wrong."""
    from helpers.paths import ROOT

    from fastrlhf.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(f"{ROOT}/examples/{example}.yaml", command, on_gpu=False)
    assert str(info.value).startswith(expected)


def test_set_on_a_yaml_alias_leaves_its_anchor_alone(tmp_path):
    """``critic: *sft`` shares the mapping of ``reference: &sft {...}``: --set critic.path changed the reference
    model too (the KL term would have read the critic's folder)."""
    for name in ("sft", "rm", "policy"):
        fake_model_folder(tmp_path / name)
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [3, 4]}\n')
    (tmp_path / "ppo.yaml").write_text(
        f"algorithm: ppo\noutput_dir: {tmp_path / 'out'}\nmodel: {{path: {tmp_path / 'policy'}}}\n"
        f"reference: &sft {{path: {tmp_path / 'sft'}}}\ncritic: *sft\nreward: {{function: length}}\n"
        f"data: {{prompts: {tmp_path / 'prompts.jsonl'}}}\nrollout: {{n: 4}}\n"
        "trainer: {max_steps: 2, prompts_per_step: 4, minibatch_size: 8}\n"
    )
    config = load_config(str(tmp_path / "ppo.yaml"), "train", [f"critic.path={tmp_path / 'rm'}"], on_gpu=False)
    assert (config.reference.path, config.critic.path) == (str(tmp_path / "sft"), str(tmp_path / "rm"))


def test_set_reaches_a_lists_item_by_its_index(tmp_path):
    """verl's and Hydra's users write ``reward.functions[0].weight=2``; it was an unknown key (a bracket in a name).
    An item merges like a section; an index past the list, or into what is no list, is one line naming the key."""
    raw = yaml.safe_load(open(fake_train_yaml(tmp_path, engine="hf")))
    raw["reward"] = {"functions": [{"function": "length", "weight": 1.0}, {"function": "length", "weight": 0.5}]}
    raw["rollout"]["stop"] = ["\n\n"]
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_config(str(path), "train", ["reward.functions[1].weight=2", "rollout.stop[0]=END"], on_gpu=False)
    assert [(f.function, f.weight) for f in config.reward.functions] == [("length", 1.0), ("length", 2.0)]
    assert config.rollout.stop == ["END"]
    config = load_config(str(path), "train", ["reward.functions[0]={weight: 3}"], on_gpu=False)
    assert [(f.function, f.weight) for f in config.reward.functions] == [("length", 3.0), ("length", 0.5)]
    for override, message in [
        ("reward.functions[2].weight=2", "reward.functions: has 2 items, so --set reward.functions[2].weight cannot"),
        ("rollout.n[0]=1", "rollout.n: is 4, not a list, so --set rollout.n[0] cannot apply"),
        ("reward.functions[x]=1", "--set: expected key=value (a list's item as key[0]), got 'reward.functions[x]=1'"),
        ("rollout.stop_token_ids[0]=5", "rollout.stop_token_ids: is not set in the config, so --set "
                                        "rollout.stop_token_ids[0] cannot apply: set the whole list"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(str(path), "train", [override], on_gpu=False)
        assert str(info.value).startswith(message), str(info.value)
    assert raw["reward"]["functions"][1]["weight"] == 0.5  # the file's mapping is left as it was
