"""The command line: help, one-line config errors with exit code 2 in well under a second, data errors
with line numbers, and dispatch of ``train`` to the RL trainer."""

import json
import os
import subprocess
import sys
import time
import types

import pytest
import yaml
from helpers.model_folders import fake_model_folder
from helpers.paths import ROOT

from fastrlhf import cli
from fastrlhf.config import ConfigError

ENV = {**os.environ, "FASTRLHF_DIST_TIMEOUT": "60", "FASTRLHF_NO_PROGRESS": "1"}


def run_cli(*args, timeout=120):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "fastrlhf", *args], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=timeout)
    return result, time.monotonic() - started


@pytest.fixture
def train_yaml(tmp_path):
    fake_model_folder(tmp_path / "model")  # checked, never loaded
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [3, 4]}\n')
    raw = {"algorithm": "grpo", "output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
           "reward": {"function": "length"}, "data": {"prompts": str(tmp_path / "prompts.jsonl")},
           "rollout": {"n": 4}, "trainer": {"max_steps": 2, "prompts_per_step": 4, "minibatch_size": 8}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_help_lists_the_commands():
    result, _ = run_cli("--help")
    assert result.returncode == 0
    for command in ("train", "sft", "rm"):
        assert command in result.stdout
    sub, _ = run_cli("sft", "--help")
    assert "--config" in sub.stdout and "--set" in sub.stdout and "--resume" in sub.stdout


@pytest.mark.parametrize("override, expected", [
    ("trainer.minibatch_size=3", "config error: trainer.minibatch_size: 3 does not divide the rollout batch of 16 "
                                 "(trainer.prompts_per_step x rollout.n)"),
    ("rollout.n=1", "config error: rollout.n: grpo compares completions"),
    ("trainer.bogus=1", "config error: trainer.bogus: unknown key"),
])
def test_config_errors_are_one_line_exit_2(train_yaml, override, expected):
    # --local_rank=0 first, as the deepspeed launcher passes it.
    result, _ = run_cli("--local_rank=0", "train", "--config", train_yaml, "--set", override)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
    assert "Traceback" not in result.stderr


def test_config_error_in_process(train_yaml, capsys):
    assert cli.main(["train", "--config", train_yaml, "--set", "deepspeed.zero_stage=5"]) == 2
    assert capsys.readouterr().err.strip() == "config error: deepspeed.zero_stage: must be 0, 1, 2 or 3, got 5"


def test_dry_run_on_a_cpu_says_what_the_weight_sync_does_on_this_cpu(train_yaml, capsys, cpu_probe_answer):
    """The CPU probe's answer under the resolved config, as a YAML comment; none for an HF engine."""
    assert cli.main(["train", "--config", train_yaml, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["rollout"]["engine"] == "auto"
    (line,) = [line for line in out.splitlines() if line.startswith("#")]
    assert line == f"# {cpu_probe_answer.summary()}"
    assert ("forced off by FASTRLHF_CPU_FAST_PATHS=off" in line) == cpu_probe_answer.forced_off
    assert cli.main(["train", "--config", train_yaml, "--dry-run", "--set", "rollout.engine=hf"]) == 0
    assert "#" not in capsys.readouterr().out


def test_missing_config_file(tmp_path, capsys):
    assert cli.main(["sft", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config error: --config: cannot read" in capsys.readouterr().err


def test_train_dispatches_to_the_rl_trainer(train_yaml, monkeypatch):
    seen = {}
    fake = types.ModuleType("fastrlhf.rl.trainer")

    def run(config, resume=False):
        seen.update(config=config, resume=resume)

    fake.run = run
    monkeypatch.setitem(sys.modules, "fastrlhf.rl.trainer", fake)
    assert cli.main(["train", "--config", train_yaml, "--set", "trainer.lr=2e-6", "--resume"]) == 0
    assert seen["config"].trainer.lr == 2e-6 and seen["resume"] is True


@pytest.mark.slow
def test_bad_data_lines_are_reported_before_training(tmp_path):
    from fastrlhf.modeling.tiny import save_tiny_llama

    save_tiny_llama(tmp_path / "model", vocab_size=32, hidden_size=64, num_layers=1)
    lines = [{"prompt_ids": [3], "response_ids": [4]}, "{oops", {"prompt_ids": [], "response_ids": [4]},
             {"prompt_ids": [3], "response_ids": [40]}]
    (tmp_path / "sft.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    raw = {"output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
           "data": {"path": str(tmp_path / "sft.jsonl")}, "trainer": {"max_steps": 1, "batch_size": 1}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(raw))
    result, _ = run_cli("sft", "--config", str(tmp_path / "sft.yaml"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("data error:")]
    assert errors[0].startswith("data error: sft.jsonl:2: invalid JSON")
    assert errors[1] == "data error: sft.jsonl:3: empty prompt"
    assert errors[2] == "data error: sft.jsonl:4: token id 40 in response is outside the vocabulary [0, 32)"
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


EXIT_SCRIPT = """
import atexit, sys
import torch.distributed as dist
from fastrlhf.cli import exit_with
if sys.argv[1] == "group":
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
atexit.register(lambda: print("exit handlers ran", flush=True))
print("leaving", flush=True)
exit_with(3)
"""


@pytest.mark.parametrize("group", [True, False], ids=["launched-rank", "no-group"])
def test_exit_with_runs_the_exit_handlers_and_keeps_the_code(group):
    """A launched rank leaves through os._exit after Python's exit handlers: torch's c10d stores abort the
    process in their C++ destructors about one exit in three on two CPU ranks (measured with fastrlhf's
    init_distributed: 5 of 12 two-rank exits aborted; 0 of 16 through exit_with), so `python -m fastrlhf`
    ends with exit_with."""
    from fastrlhf.distributed import free_port

    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, "group" if group else "none", str(free_port())],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["leaving", "exit handlers ran"], result.stdout
    assert open(os.path.join(ROOT, "fastrlhf", "__main__.py")).read().strip().endswith("entry()")


def test_a_launched_rank_that_crashes_leaves_with_1_through_exit_with(monkeypatch, capsys):
    codes = []

    def crash(argv=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "main", crash)
    monkeypatch.setattr(cli, "exit_with", codes.append)
    monkeypatch.setattr(cli, "_group_started", lambda: True)
    cli.entry()
    assert codes == [cli.EXIT_FAILED] and "RuntimeError: boom" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_group_started", lambda: False)  # before any group: an ordinary crash
    with pytest.raises(RuntimeError, match="boom"):
        cli.entry()


# ---- a used output_dir (issue 44, item 3) -------------------------------------------------------------------


@pytest.fixture
def command_yaml(tmp_path, train_yaml):
    """``command -> config path`` for train, sft and rm, all with output_dir ``tmp_path/out``."""
    (tmp_path / "sft.jsonl").write_text('{"prompt_ids": [3], "response_ids": [4]}\n')
    (tmp_path / "rm.jsonl").write_text('{"chosen_ids": [3, 4], "rejected_ids": [3, 5]}\n')
    paths = {"train": train_yaml}
    for command in ("sft", "rm"):
        raw = {"output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
               "data": {"path": str(tmp_path / f"{command}.jsonl")}, "trainer": {"max_steps": 1, "batch_size": 1}}
        paths[command] = str(tmp_path / f"{command}.yaml")
        (tmp_path / f"{command}.yaml").write_text(yaml.safe_dump(raw))
    return paths


@pytest.fixture
def dispatched(monkeypatch):
    """The commands the CLI dispatched (no model loads): ``[(command, resume), ...]``; each passes its checks
    and reaches the start of its process group (``init_distributed`` runs what must come first there)."""
    from fastrlhf.distributed.launch import run_before_group

    calls = []

    def dispatch(command, config, resume):
        calls.append((command, resume))
        run_before_group()

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    return calls


def _use(out, entry):
    out.mkdir(exist_ok=True)
    if entry.endswith("/"):
        (out / entry).mkdir()
        (out / entry / "x").write_text("")
    else:
        (out / entry).write_text("{}\n")


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
@pytest.mark.parametrize("entry", ["metrics.jsonl", "checkpoints/", "final/", "config.yaml"])
def test_a_used_output_dir_is_refused_in_one_line_before_any_model_loads(command_yaml, tmp_path, capsys, dispatched,
                                                                         command, entry):
    _use(tmp_path / "out", entry)
    assert cli.main([command, "--config", command_yaml[command]]) == 2
    assert dispatched == []  # refused before the command ran: no model loaded (not a wall-clock bound)
    out = tmp_path / "out"
    assert capsys.readouterr().err.splitlines() == [
        f"config error: output_dir: {out} holds an earlier run ({entry}): add --resume to continue it, --overwrite to "
        "delete it and start again, or choose another output_dir"]
    assert sorted(os.listdir(out)) == [entry.rstrip("/")]  # untouched


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
def test_overwrite_deletes_the_earlier_run_and_nothing_else(command_yaml, tmp_path, capsys, dispatched, command):
    out = tmp_path / "out"
    for entry in ("metrics.jsonl", "config.yaml", "checkpoints/", "final/", "eval/"):
        _use(out, entry)
    (out / "notes.txt").write_text("mine")
    assert cli.main([command, "--config", command_yaml[command], "--overwrite"]) == 0
    assert dispatched == [(command, False)]
    assert os.listdir(out) == ["notes.txt"]
    assert capsys.readouterr().err.strip() == (f"note: --overwrite: removed the earlier run in {out} (config.yaml, "
                                               "metrics.jsonl, checkpoints/, final/, eval/)")


def test_resume_a_new_folder_and_one_with_other_files_are_not_refused(train_yaml, tmp_path, dispatched):
    out = tmp_path / "out"
    assert cli.main(["train", "--config", train_yaml]) == 0  # no folder yet
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli.main(["train", "--config", train_yaml]) == 0  # only files of the user's
    _use(out, "checkpoints/")
    assert cli.main(["train", "--config", train_yaml, "--resume"]) == 0
    assert cli.main(["train", "--config", train_yaml, "--dry-run"]) == 0  # a dry run neither checks nor deletes
    assert dispatched == [("train", False), ("train", False), ("train", True)]
    assert sorted(os.listdir(out)) == ["checkpoints", "notes.txt"]


def test_overwrite_deletes_nothing_when_the_run_fails_its_checks(train_yaml, tmp_path, monkeypatch, capsys):
    from fastrlhf.data import DataError
    from fastrlhf.distributed.launch import run_before_group

    out = tmp_path / "out"
    _use(out, "checkpoints/")

    def bad_data(command, config, resume):
        raise DataError(["prompts.jsonl:3: empty prompt"])  # found before the process group starts

    monkeypatch.setattr(cli, "_dispatch", bad_data)
    assert cli.main(["train", "--config", train_yaml, "--overwrite"]) == 2
    assert capsys.readouterr().err.strip() == "data error: prompts.jsonl:3: empty prompt"
    run_before_group()  # what a later group start in this process would run: nothing is left pending
    assert os.listdir(out) == ["checkpoints"]


def test_overwrite_with_resume_is_refused(train_yaml, capsys, dispatched):
    assert cli.main(["train", "--config", train_yaml, "--overwrite", "--resume"]) == 2
    assert capsys.readouterr().err.strip() == ("config error: --overwrite: conflicts with --resume (--resume continues "
                                               "the run in output_dir, --overwrite deletes it)")


def test_under_a_launcher_only_rank_0_deletes_the_earlier_run(train_yaml, tmp_path, monkeypatch, capsys, dispatched):
    """Rank 0 deletes before it joins the process group, where the other ranks wait for it: they neither
    delete (a race on the same files) nor check (they could see it half deleted)."""
    out = tmp_path / "out"
    _use(out, "checkpoints/")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli.main(["train", "--config", train_yaml, "--overwrite"]) == 0
    assert os.listdir(out) == ["checkpoints"]
    assert cli.main(["train", "--config", train_yaml]) == 2  # without --overwrite every rank refuses (rank 0 says it)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cli.main(["train", "--config", train_yaml, "--overwrite"]) == 0
    assert not out.exists() or os.listdir(out) == []
    assert dispatched == [("train", False), ("train", False)]


# ---- --overwrite loses nothing until the new run is under way; output_dir that cannot be written ---------------


def _earlier_run(out):
    """A finished run in ``out`` (and a file of the user's): ``{relative path: content}`` of its files."""
    files = {"config.yaml": "seed: 1\n", "metrics.jsonl": '{"step": 1}\n', "checkpoints/latest": "step-1\n",
             "checkpoints/step-1/rank-0.pt": "state", "final/model.safetensors": "weights"}
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    (out / "notes.txt").write_text("mine")
    return files


def _files(out) -> dict:
    return {os.path.relpath(os.path.join(d, f), out): open(os.path.join(d, f)).read()
            for d, _, names in os.walk(out) for f in names}


@pytest.mark.parametrize("failure, code", [(RuntimeError("crash at step 1"), None), (KeyboardInterrupt(), 130),
                                           (ConfigError("reward", "late"), 2)], ids=["crash", "ctrl-c", "late-check"])
def test_overwrite_puts_the_earlier_run_back_when_the_run_ends_before_its_first_step(train_yaml, tmp_path,
                                                                                     monkeypatch, capsys, failure,
                                                                                     code):
    from fastrlhf.distributed.launch import run_before_group
    from fastrlhf.engine.outputs import ASIDE

    out = tmp_path / "out"
    out.mkdir()
    earlier = _earlier_run(out)

    def models_load_then_the_first_step_fails(command, config, resume):
        run_before_group()
        assert sorted(os.listdir(out)) == [ASIDE, "notes.txt"]  # set aside, not deleted
        (out / "config.yaml").write_text("seed: 2\n")  # what the new run writes before its first step
        (out / "metrics.jsonl").write_text("")
        (out / "checkpoints" / ".tmp-step-1").mkdir(parents=True)
        raise failure

    monkeypatch.setattr(cli, "_dispatch", models_load_then_the_first_step_fails)
    if code is None:
        with pytest.raises(RuntimeError, match="crash at step 1"):
            cli.main(["train", "--config", train_yaml, "--overwrite"])
    else:
        assert cli.main(["train", "--config", train_yaml, "--overwrite"]) == code
    assert _files(out) == {**earlier, "notes.txt": "mine"}
    back = "(config.yaml, metrics.jsonl, checkpoints/, final/)"
    err = capsys.readouterr().err.strip()
    if isinstance(failure, KeyboardInterrupt):
        assert err == f"interrupted (Ctrl-C) before this run's first step; the earlier run in {out} is back {back}"
    else:
        assert err.splitlines()[-1] == (f"note: --overwrite: this run ended before its first step; the earlier run "
                                        f"in {out} is back {back}")


def test_overwrite_deletes_the_earlier_run_once_the_run_has_logged_a_step(train_yaml, tmp_path, monkeypatch, capsys):
    """Deleted while the run goes on (the disk holds one run, not two, for the rest of it), so a later failure
    keeps this run's files, which --resume continues."""
    from fastrlhf.distributed.launch import run_before_group
    from fastrlhf.engine.outputs import ASIDE, Overwrite

    monkeypatch.setattr(Overwrite, "poll_s", 0.01)
    out = tmp_path / "out"
    out.mkdir()
    _earlier_run(out)

    def one_step_then_crash(command, config, resume):
        run_before_group()
        assert (out / ASIDE / "checkpoints" / "step-1").is_dir()
        (out / "metrics.jsonl").write_text('{"step": 1, "new": true}\n')
        deadline = time.monotonic() + 10
        while (out / ASIDE).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not (out / ASIDE).exists()  # deleted before the run ends
        raise RuntimeError("crash at step 2")

    monkeypatch.setattr(cli, "_dispatch", one_step_then_crash)
    with pytest.raises(RuntimeError, match="crash at step 2"):
        cli.main(["train", "--config", train_yaml, "--overwrite"])
    assert _files(out) == {"metrics.jsonl": '{"step": 1, "new": true}\n', "notes.txt": "mine"}
    assert capsys.readouterr().err.strip() == (f"note: --overwrite: removed the earlier run in {out} (config.yaml, "
                                               "metrics.jsonl, checkpoints/, final/)")


def test_an_earlier_run_left_aside_by_a_killed_overwrite_is_kept_until_a_run_is_under_way(train_yaml, tmp_path,
                                                                                          monkeypatch, capsys):
    from fastrlhf.distributed.launch import run_before_group
    from fastrlhf.engine.outputs import ASIDE

    out = tmp_path / "out"
    (out / ASIDE).mkdir(parents=True)
    earlier = _earlier_run(out / ASIDE)
    (out / ASIDE / "notes.txt").unlink()
    (out / "config.yaml").write_text("seed: 2\n")  # the killed run's, which never logged a step
    assert cli.main(["train", "--config", train_yaml]) == 2
    assert f"holds an earlier run (config.yaml, {ASIDE}/)" in capsys.readouterr().err

    def fails(command, config, resume):
        run_before_group()
        raise ConfigError("reward", "late")

    monkeypatch.setattr(cli, "_dispatch", fails)
    assert cli.main(["train", "--config", train_yaml, "--overwrite"]) == 2
    assert _files(out) == earlier  # the run set aside is back; the killed run's file is gone


def test_only_rank_0_sets_aside_and_puts_back(train_yaml, tmp_path, monkeypatch):
    from fastrlhf.distributed.launch import run_before_group

    out = tmp_path / "out"
    out.mkdir()
    earlier = _earlier_run(out)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")

    def fails(command, config, resume):
        run_before_group()
        assert _files(out) == {**earlier, "notes.txt": "mine"}
        raise ConfigError("reward", "late")

    monkeypatch.setattr(cli, "_dispatch", fails)
    assert cli.main(["train", "--config", train_yaml, "--overwrite"]) == 2
    assert _files(out) == {**earlier, "notes.txt": "mine"}


@pytest.mark.parametrize("command", ["train", "sft", "rm"])
@pytest.mark.parametrize("where, expected", [
    ("", "output_dir: is empty; expected the path of a folder (new or of this run)"),
    ("{tmp}/notes.txt/out", "output_dir: cannot create {tmp}/notes.txt/out: {tmp}/notes.txt is not a folder"),
    ("{tmp}/ro/out", "output_dir: cannot create {tmp}/ro/out: no write access to {tmp}/ro (permission denied or a "
                     "read-only file system)"),
], ids=["empty", "under-a-file", "not-writable"])
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_an_output_dir_that_cannot_be_written_is_one_line_before_any_work(command_yaml, tmp_path, monkeypatch,
                                                                          capsys, dispatched, command, where,
                                                                          expected, dry_run):
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "ro").mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(tmp_path / "ro") and access(path, mode))
    where, expected = where.format(tmp=tmp_path), expected.format(tmp=tmp_path)
    args = [command, "--config", command_yaml[command], "--set", f"output_dir={json.dumps(where)}"]
    assert cli.main([*args, *(["--dry-run"] if dry_run else [])]) == 2
    assert capsys.readouterr().err.splitlines() == [f"config error: {expected}"]
    assert dispatched == [] and not os.path.exists(tmp_path / "ro" / "out")


@pytest.mark.parametrize("command, setting, expected", [
    ("train", "reward.function=no_such_reward", "config error: reward.function: unknown reward function "
                                                "'no_such_reward'"),
    ("train", "data.prompts={bad}", "data error: bad.jsonl:2: not valid UTF-8 (byte 0xe9 at column 13)"),
    ("sft", "data.path={bad}", "data error: bad.jsonl:2: not valid UTF-8 (byte 0xe9 at column 13)"),
    ("rm", "data.path={bad}", "data error: bad.jsonl:2: not valid UTF-8 (byte 0xe9 at column 13)"),
])
def test_dry_run_refuses_what_the_run_refuses_before_a_model_loads(command_yaml, tmp_path, capsys, dispatched,
                                                                   command, setting, expected):
    good = {"train": b'{"prompt_ids": [3]}', "sft": b'{"prompt_ids": [3], "response_ids": [4]}',
            "rm": b'{"chosen_ids": [3], "rejected_ids": [4]}'}[command]
    (tmp_path / "bad.jsonl").write_bytes(good + b'\n{"prompt": "\xe9"}\n')
    args = [command, "--config", command_yaml[command], "--set", setting.format(bad=tmp_path / "bad.jsonl")]
    assert cli.main([*args, "--dry-run"]) == 2
    dry = capsys.readouterr()
    assert dry.out == "" and dry.err.splitlines()[-1].startswith(expected) and dispatched == []


# ---- --import (issue 44, item 4) ----------------------------------------------------------------------------------


def test_import_registers_a_policy_loss_before_the_config_is_checked(train_yaml, tmp_path, capsys):
    from helpers.plugins import user_plugins

    with user_plugins(tmp_path / "plugins") as make:
        name = make('from fastrlhf.algorithms import register_policy_loss, vanilla_policy_loss\n'
                    'register_policy_loss("cli_test_loss")(vanilla_policy_loss)\n')
        unknown = ["train", "--config", train_yaml, "--set", "trainer.policy_loss=cli_test_loss", "--dry-run"]
        assert cli.main(unknown) == 2
        assert "unknown policy loss 'cli_test_loss'" in capsys.readouterr().err
        assert cli.main(["train", "--config", train_yaml, "--import", name, "--set",
                         "trainer.policy_loss=cli_test_loss", "--dry-run"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["imports"] == [name] and resolved["trainer"]["policy_loss"] == "cli_test_loss"


def test_an_import_that_fails_is_one_line_exit_2(train_yaml):
    result, _ = run_cli("train", "--config", train_yaml, "--import", "no_such_plugin_module")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["config error: --import: cannot import 'no_such_plugin_module': "
                                          "ModuleNotFoundError: No module named 'no_such_plugin_module'"]


def readme_policy_loss() -> tuple[str, list[str]]:
    """README's policy-loss example: the fenced block that registers it, and the command it is run with."""
    import re
    import shlex

    text = open(os.path.join(ROOT, "README.md")).read()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "@register_policy_loss(" in b]
    (command,) = re.findall(r"`(fastrlhf train --config run\.yaml [^`]*)`", text)
    return code, shlex.split(command)


# Wraps the README's loss (imported before it: --import order) to record, per rank, that training called it.
SPY = """
import os
from fastrlhf.algorithms import POLICY_LOSSES, PolicyLoss

_loss = POLICY_LOSSES["my_loss"]

def _spy(*args, **kwargs):
    open(f"called-by-rank-{os.environ.get('RANK', '0')}", "w").close()
    return _loss.fn(*args, **kwargs)

POLICY_LOSSES["my_loss"] = PolicyLoss(_spy, _loss.token_level)
"""


def _readme_workdir(tmp_path, imports=None):
    from helpers.rl_runs import grpo_config, make_tiny

    code, command = readme_policy_loss()
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_loss.py").write_text(code)
    (work / "spy.py").write_text(SPY)
    make_tiny(tmp_path)
    extra = {"imports": imports} if imports else {}
    config = grpo_config(tmp_path, tmp_path / "out", reward="length", trainer={"max_steps": 2, "save_every": 0},
                         **extra)
    os.replace(config, work / "run.yaml")
    return work, command


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_policy_loss_example_runs_through_the_cli_as_written(tmp_path):
    """README's `@register_policy_loss("my_loss")` block, saved as my_loss.py, trained with README's own
    command (the `fastrlhf` console script, which does not put the current directory on sys.path)."""
    from helpers.rl_runs import launch_env, metrics_by_step

    work, command = _readme_workdir(tmp_path)
    assert command[:3] == ["fastrlhf", "train", "--config"] and "--import" in command
    script = os.path.join(os.path.dirname(sys.executable), "fastrlhf")
    result = subprocess.run([script, *command[1:], "--import", "spy"], cwd=work, env=launch_env(),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (work / "called-by-rank-0").exists()
    assert sorted(metrics_by_step(tmp_path / "out")) == [1, 2]
    saved = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert saved["imports"] == ["my_loss", "spy"] and saved["trainer"]["policy_loss"] == "my_loss"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_imports_and_overwrite_under_the_deepspeed_launcher_on_every_rank(tmp_path):
    """The config's `imports` on both ranks of `deepspeed --module fastrlhf` (a rank without them would
    refuse trainer.policy_loss: my_loss), and --overwrite of a used output_dir: rank 0 clears it, and
    the run that follows is this one alone."""
    from helpers.launch import run_group
    from helpers.rl_runs import DEEPSPEED, launch_env, metrics_by_step

    from fastrlhf.distributed import free_port

    work, _ = _readme_workdir(tmp_path, imports=["my_loss", "spy"])
    out = tmp_path / "out"
    (out / "checkpoints" / "step-99").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-99\n")
    (out / "metrics.jsonl").write_text('{"step": 99}\n')
    train = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "fastrlhf", "train",
             "--config", "run.yaml", "--set", "trainer.policy_loss=my_loss"]
    rc, log = run_group(train, env=launch_env(), timeout=300, cwd=str(work))
    assert rc == 2, log[-3000:]
    assert "config error: output_dir: " in log and "holds an earlier run" in log
    rc, log = run_group([*train, "--overwrite"], env=launch_env(), timeout=300, cwd=str(work))
    assert rc == 0, log[-4000:]
    assert (work / "called-by-rank-0").exists() and (work / "called-by-rank-1").exists()
    assert sorted(metrics_by_step(out)) == [1, 2]
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-2"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overwrite_under_the_launcher_puts_the_earlier_run_back_when_the_first_step_fails(tmp_path):
    """Two ranks of `deepspeed --module fastrlhf`: rank 0 sets the earlier run aside before the group starts,
    the models load on both ranks, the first step's reward function raises, and the earlier run is back."""
    from helpers.launch import run_group
    from helpers.rl_runs import DEEPSPEED, launch_env

    from fastrlhf.distributed import free_port

    work, _ = _readme_workdir(tmp_path)
    (work / "boom.py").write_text("def boom(*args, **kwargs):\n    raise RuntimeError('boom')\n")
    out = tmp_path / "out"
    out.mkdir()
    earlier = _earlier_run(out)
    train = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "fastrlhf", "train",
             "--config", "run.yaml", "--set", "reward.function=boom:boom", "--overwrite"]
    rc, log = run_group(train, env=launch_env(), timeout=300, cwd=str(work))
    assert rc == 1 and "reward error: reward function 'boom' raised RuntimeError" in log, log[-3000:]
    assert "the earlier run in " in log and " is back (config.yaml, metrics.jsonl, checkpoints/, final/)" in log
    assert _files(out) == {**earlier, "notes.txt": "mine"}


# ---- logs without a terminal, the engine used, Ctrl-C (issue 44, item 7) --------------------------------------------


@pytest.mark.parametrize("checkpoint, world", [(True, "1"), (False, "1"), (True, "2")])
def test_ctrl_c_ends_with_one_line_naming_the_checkpoint_and_the_resume_command(train_yaml, tmp_path, monkeypatch,
                                                                                capsys, checkpoint, world):
    out = tmp_path / "out"

    def interrupted(command, config, resume):
        if checkpoint:
            (out / "checkpoints" / "step-2").mkdir(parents=True)
            (out / "checkpoints" / "latest").write_text("step-2\n")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_dispatch", interrupted)
    monkeypatch.setenv("WORLD_SIZE", world)
    assert cli.main(["train", "--config", train_yaml, "--set", "trainer.lr=2e-6", "--overwrite"]) == 130
    where = (f"the last checkpoint is {out}/checkpoints/step-2" if checkpoint else
             "no checkpoint was written yet (--resume then starts again at step 0)")
    command = f"train --config {train_yaml} --set trainer.lr=2e-6 --resume"
    command = f"deepspeed <the same options> --module fastrlhf {command}" if world == "2" else f"fastrlhf {command}"
    assert capsys.readouterr().err.splitlines() == [f"interrupted (Ctrl-C): {where}; continue with `{command}`"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_without_a_terminal_logs_each_step_names_its_engine_and_stops_cleanly_on_ctrl_c(tmp_path):
    """stdout is a pipe (as under a launcher writing a log file): one line per step, the engine `auto` chose
    in the log and in config.yaml; Ctrl-C in step 3 (after the step-2 checkpoint) ends the run with one
    line whose --resume command then finishes it."""
    import shlex

    from helpers.rl_runs import TRAIN, grpo_config, launch_env, make_tiny, metrics_by_step

    make_tiny(tmp_path)
    out = tmp_path / "out"
    config = grpo_config(tmp_path, out, rollout={"engine": "auto", "n": 2, "max_new_tokens": 5})
    env = {k: v for k, v in launch_env(FASTRLHF_TEST_INTERRUPT_AFTER_CALLS="8").items()
           if k != "FASTRLHF_NO_PROGRESS"}
    result = subprocess.run([*TRAIN, config], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 130, result.stderr[-3000:]
    assert "rollout.engine: hf (auto)" in result.stdout.splitlines()
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout"]["engine"] == "hf"
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/4", "2/4"], result.stdout
    for line in steps:
        assert [w.split("=")[0] for w in line.split()[2:]] == ["reward", "kl", "loss", "tokens/s", "s/step"], line
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"interrupted (Ctrl-C): the last checkpoint is {out}/checkpoints/step-2; continue with "
                    f"`fastrlhf train --config {config} --resume`")
    resume = shlex.split(last.split("`")[1])
    env.pop("FASTRLHF_TEST_INTERRUPT_AFTER_CALLS")
    result = subprocess.run([sys.executable, "-m", *resume], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(metrics_by_step(out)) == [1, 2, 3, 4]


def test_dry_run_decides_the_auto_settings_as_the_run_will(train_yaml, tmp_path, capsys):
    """``model.gradient_checkpointing`` and ``trainer.max_tokens_per_microbatch`` ``auto`` come out of --dry-run
    decided, with the plan's reasons."""
    tiny = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 1024}
    fake_model_folder(tmp_path / "tiny", tiny)
    args = ["train", "--config", train_yaml, "--dry-run", "--set", "model.gradient_checkpointing=auto",
            "--set", "rollout.engine=hf", "--set", "trainer.max_tokens_per_microbatch=auto",
            "--set", "trainer.grad_accum=1"]
    assert cli.main([*args, "--set", f"model.path={tmp_path / 'tiny'}"]) == 0
    out = capsys.readouterr().out
    decided = yaml.safe_load(out)
    assert decided["model"]["gradient_checkpointing"] is False  # a tiny model fits without it
    assert "# model.gradient_checkpointing auto: off: the run fits without it" in out
    tokens = decided["trainer"]["max_tokens_per_microbatch"]  # the whole share fits: a multiple of one sequence
    assert isinstance(tokens, int) and f"# trainer.max_tokens_per_microbatch auto: {tokens:,}: the whole" in out
    assert cli.main(args) == 0  # a config.json the plan cannot count: on, one sequence, and why
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["model"]["gradient_checkpointing"] is True
    assert "# model.gradient_checkpointing auto: on: no plan (" in out
    assert "(one sequence): no plan (" in out


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_auto_gradient_checkpointing_is_for_train_only(tmp_path, capsys, command):
    fake_model_folder(tmp_path / "model")
    (tmp_path / "data.jsonl").write_text("")
    raw = {"output_dir": str(tmp_path / "out"), "data": {"path": str(tmp_path / "data.jsonl")},
           "model": {"path": str(tmp_path / "model"), "gradient_checkpointing": "auto"}, "trainer": {"max_steps": 1}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main([command, "--config", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.strip() == ("config error: model.gradient_checkpointing: auto is decided by the "
                                               "memory plan of `fastrlhf train`; here set true or false")


@pytest.mark.parametrize("exit_code", [1, 2])
def test_an_environment_that_fails_to_start_ends_in_one_line_with_its_exit_code(train_yaml, monkeypatch, capsys,
                                                                                 exit_code):
    """Agreed by every rank (EpisodeRunner.start_on_every_rank), it ended in a traceback, and on several ranks a
    sandbox's "Connection reset by peer" in its message read as a lost peer."""
    from fastrlhf.rollout.tools import EnvironmentResetError

    def fails(command, config, resume):
        raise EnvironmentResetError("rollout.environment: Box reset() raised ConnectionResetError: Connection reset by "
                                    "peer (prompt 0 of the rollout batch)", exit_code=exit_code)

    monkeypatch.setattr(cli, "_dispatch", fails)
    assert cli.main(["train", "--config", train_yaml]) == exit_code
    assert capsys.readouterr().err.strip() == ("environment error: rollout.environment: Box reset() raised "
                                               "ConnectionResetError: Connection reset by peer (prompt 0 of the "
                                               "rollout batch)")
