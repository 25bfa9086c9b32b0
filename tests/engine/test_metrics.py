"""What a run prints per step where there is no terminal, and how it opens its W&B run (issue 44, item 7)."""

import json
import os
import sys
import types

import pytest

from fastrlhf.engine.metrics import MetricsLogger, progress_bar_wanted, step_line

RL_LINE = (("reward", "reward_mean"), ("kl", "kl"), ("loss", "policy_loss"), ("tokens/s", "tokens_per_second"),
           ("s/step", "wall_time"))


def test_without_a_terminal_each_logged_step_is_one_text_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FASTRLHF_NO_PROGRESS", raising=False)
    assert not progress_bar_wanted()  # captured: stdout and stderr are not terminals
    logger = MetricsLogger(str(tmp_path), total_steps=20, enabled=True, bar_keys=("reward_mean",), line_keys=RL_LINE)
    logger.log(3, {"reward_mean": 0.40625, "kl": 0.0012345, "policy_loss": -0.0341, "tokens_per_second": 812.37,
                   "wall_time": 1.9234, "skipped": 0.0, "other": 5})
    logger.log(4, {"reward_mean": float("nan"), "kl": 0.0, "skipped": 1.0})
    logger.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 3/20 reward=0.4062 kl=0.001234 loss=-0.0341 tokens/s=812.4 s/step=1.923",
        "step 4/20 reward=nan kl=0 skipped"]
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [3, 4]


def test_no_progress_forces_lines_even_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(isatty=lambda: True))
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(isatty=lambda: True))
    monkeypatch.delenv("FASTRLHF_NO_PROGRESS", raising=False)
    assert progress_bar_wanted()
    monkeypatch.setenv("FASTRLHF_NO_PROGRESS", "1")
    assert not progress_bar_wanted()


def test_step_line_keeps_large_numbers_whole():
    keys = (("loss", "loss"), ("tokens/s", "tokens_per_second"))
    assert step_line(1, 2, {"tokens_per_second": 81234.5, "loss": 2}, keys) == "step 1/2 loss=2 tokens/s=81234"


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` package recording what ``wandb.init`` was asked."""
    calls = []

    class Run:
        id = "run-1"

        def log(self, metrics, step):
            calls.append(("log", step, metrics))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


@pytest.mark.parametrize("mode, expected", [(True, "offline"), ("offline", "offline"), ("online", "online")])
def test_wandb_mode_project_and_run_name(tmp_path, fake_wandb, mode, expected):
    out = tmp_path / "grpo-run"
    logger = MetricsLogger(str(out), total_steps=1, enabled=True, wandb=mode, run_config={"seed": 3})
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert fake_wandb[0] == ("init", {"mode": expected, "project": "fastrlhf", "name": "grpo-run", "dir": str(out),
                                      "config": {"seed": 3}})
    assert fake_wandb[1:] == [("log", 1, {"loss": 1.0}), ("finish",)]
    fake_wandb.clear()
    MetricsLogger(str(out), total_steps=1, enabled=True, wandb=mode, wandb_project="rlhf",
                  wandb_run_name="try-3").close()
    assert fake_wandb[0][1]["project"] == "rlhf" and fake_wandb[0][1]["name"] == "try-3"


def test_a_resumed_run_goes_on_in_the_wandb_run_it_began(tmp_path, fake_wandb):
    MetricsLogger(str(tmp_path), total_steps=4, enabled=True, wandb="offline").close()
    assert "id" not in fake_wandb[0][1]
    assert (tmp_path / "wandb" / "fastrlhf-run-id").read_text() == "run-1\n"
    fake_wandb.clear()
    MetricsLogger(str(tmp_path), total_steps=4, start_step=2, enabled=True, wandb="offline", resume=True).close()
    assert fake_wandb[0][1]["id"] == "run-1" and fake_wandb[0][1]["resume"] == "allow"
    fake_wandb.clear()  # a resume with no run id recorded (W&B was off before) opens a new run
    MetricsLogger(str(tmp_path / "other"), total_steps=4, enabled=True, wandb="offline", resume=True).close()
    assert "id" not in fake_wandb[0][1]


def test_wandb_off_opens_no_run(tmp_path, fake_wandb):
    MetricsLogger(str(tmp_path), total_steps=1, enabled=True, wandb=False, wandb_project="rlhf").close()
    assert fake_wandb == [] and os.path.exists(tmp_path / "metrics.jsonl")
