"""Atomic checkpoints, exact RNG/optimizer restore, the NaN/inf step guard, metrics.jsonl."""

import json
import math
import os
import random

import numpy as np
import pytest
import torch

from fastrlhf.data import EpochSampler
from fastrlhf.engine.checkpoint import CheckpointError, checkpoint_root, latest_checkpoint, load_latest, save_checkpoint
from fastrlhf.engine.guards import GuardedAdamW, StepGuard, TooManySkippedSteps
from fastrlhf.engine.metrics import MetricsLogger, read_metrics, truncate_metrics


def make_training(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    guard = StepGuard(3)
    optimizer = GuardedAdamW(model.parameters(), lr=0.1, guard=guard)
    return model, optimizer, guard


def train_step(model, optimizer, guard, step, poison=False):
    x = torch.randn(8, 4)  # from the global RNG: resuming must restore it
    loss = ((model(x) - 1.0) ** 2).mean() + random.random() * 0 + float(np.random.rand()) * 0
    if poison:
        loss = loss * float("nan")
    guard.note_loss(loss)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    skipped = guard.end_step()
    guard.check_budget(step)
    return skipped, loss.item()


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    model, opt, guard = make_training()
    sampler = EpochSampler(5, seed=1)
    for step in range(1, 4):
        train_step(model, opt, guard, step, poison=step == 3)  # a skipped step: the guard has state to restore
        sampler.next_indices(2)
    guard_state = guard.state_dict()
    assert guard_state == {"skipped_total": 1, "skipped_in_row": 1}
    save_checkpoint(str(tmp_path), 3, {"model": model, "optimizer": opt, "sampler": sampler, "guard": guard})
    expected = []
    for step in range(4, 7):
        expected.append((train_step(model, opt, guard, step)[1], sampler.next_indices(2)))

    model2, opt2, guard2 = make_training(seed=123)
    sampler2 = EpochSampler(5, seed=1)
    torch.manual_seed(999)  # scrambled RNG: the checkpoint must restore it
    restored = load_latest(str(tmp_path), {"model": model2, "optimizer": opt2, "sampler": sampler2, "guard": guard2})
    assert restored["step"] == 3 and guard2.state_dict() == guard_state
    got = [(train_step(model2, opt2, guard2, step)[1], sampler2.next_indices(2)) for step in range(4, 7)]
    assert got == expected


def test_layout_latest_pointer_and_crash_leftovers(tmp_path):
    model, opt, guard = make_training()
    out = str(tmp_path)
    assert latest_checkpoint(out) is None and load_latest(out, {"model": model}) is None
    save_checkpoint(out, 2, {"model": model})
    root = checkpoint_root(out)
    # A save killed half way leaves a .tmp dir that is never mistaken for a checkpoint.
    os.makedirs(os.path.join(root, ".tmp-step-4"))
    assert latest_checkpoint(out).endswith("step-2")
    save_checkpoint(out, 4, {"model": model})  # replaces the leftover
    assert open(os.path.join(root, "latest")).read().strip() == "step-4"
    assert sorted(os.listdir(root)) == ["latest", "step-2", "step-4"]
    # A crash between the rename and the pointer update: the newest complete step dir wins.
    os.remove(os.path.join(root, "latest"))
    assert latest_checkpoint(out).endswith("step-4")
    save_checkpoint(out, 6, {"model": model}, keep_last=2)
    assert sorted(os.listdir(root)) == ["latest", "step-4", "step-6"]
    # A pointer naming a folder that is gone (deleted by hand): the newest complete step dir, not a missing path.
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step-9\n")
    assert latest_checkpoint(out) == os.path.join(root, "step-6")
    with pytest.raises(CheckpointError, match="no state for 'optimizer'"):
        load_latest(out, {"model": model, "optimizer": opt})


def test_resuming_with_another_world_size_is_refused(tmp_path, monkeypatch):
    from fastrlhf import distributed

    model, _, _ = make_training()
    save_checkpoint(str(tmp_path), 1, {"model": model})
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(CheckpointError, match=r"step-1 was saved by 1 ranks, this run has 2"):
        load_latest(str(tmp_path), {"model": model})


def test_guard_skips_non_finite_steps_without_touching_weights():
    model, opt, guard = make_training()
    before = [p.detach().clone() for p in model.parameters()]
    skipped, _ = train_step(model, opt, guard, 1, poison=True)
    assert skipped and guard.skipped_total == 1 and guard.skipped_in_row == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.state  # AdamW moments untouched: the step never happened
    skipped, _ = train_step(model, opt, guard, 2)
    assert not skipped and guard.skipped_in_row == 0 and guard.skipped_total == 1
    assert not torch.equal(before[0], model.weight)


def test_guard_catches_inf_gradients_with_a_finite_loss():
    model, opt, guard = make_training()
    loss = model(torch.ones(1, 4)).sum()
    loss.backward()
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    opt.step()
    assert guard.end_step() and torch.equal(before, model.weight)


def test_too_many_skipped_steps_in_a_row_stop_the_run():
    model, opt, guard = make_training()
    train_step(model, opt, guard, 1, poison=True)
    train_step(model, opt, guard, 2, poison=True)
    expected = r"stopping at step 3: 3 steps in a row .*\(trainer.max_skipped_steps = 3\)"
    with pytest.raises(TooManySkippedSteps, match=expected):
        train_step(model, opt, guard, 3, poison=True)


def test_metrics_jsonl_and_truncation_on_resume(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=5, enabled=True, bar_keys=("reward", "kl"))
    for step in range(1, 5):
        logger.log(step, {"loss": torch.tensor(0.5 * step), "reward": 1.0, "kl": float("nan")})
    # Flushed every step: readable while the run is still going.
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[1]["loss"] == 1.0
    assert isinstance(records[0]["kl"], float) and math.isnan(records[0]["kl"])  # a number (NaN), not a string
    logger.close()
    with open(os.path.join(tmp_path, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "lo')  # torn by a kill
    truncate_metrics(os.path.join(tmp_path, "metrics.jsonl"), 2)
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))] == [1, 2]
    resumed = MetricsLogger(str(tmp_path), total_steps=5, start_step=3, enabled=True, resume=True)
    resumed.log(4, {"loss": 2.0})
    resumed.close()
    lines = open(os.path.join(tmp_path, "metrics.jsonl")).read().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 4]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(str(tmp_path / "x"), total_steps=1, enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not os.path.exists(tmp_path / "x")


def test_optional_tensorboard_and_wandb_degrade_to_a_warning(tmp_path, capsys):
    import importlib.util

    logger = MetricsLogger(str(tmp_path), total_steps=1, enabled=True, tensorboard=True, wandb=True)
    logger.log(1, {"loss": 1.0})
    logger.close()
    err = capsys.readouterr().err
    for name in ("tensorboard", "wandb"):
        installed = importlib.util.find_spec(name) is not None
        assert (f"trainer.{name} is on but the {name} package is not installed" in err) != installed
    assert read_metrics(os.path.join(tmp_path, "metrics.jsonl")) == [{"step": 1, "loss": 1.0}]


class RecordingCuda:
    """Stands in for ``torch.cuda`` on a GPU node: records which devices' RNG states are touched.

    ``get_rng_state_all`` / ``set_rng_state_all`` raise: on an 8-GPU node each would open a CUDA
    context on every visible GPU from every rank.
    """

    def __init__(self):
        self.touched = []

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_rng_state(self, device="cuda"):
        self.touched.append(("get", torch.device(device)))
        return torch.tensor([torch.device(device).index], dtype=torch.uint8)

    def set_rng_state(self, state, device="cuda"):
        self.touched.append(("set", torch.device(device), int(state[0])))

    def get_rng_state_all(self):
        raise AssertionError("get_rng_state_all opens a context on every GPU")

    def set_rng_state_all(self, states):
        raise AssertionError("set_rng_state_all opens a context on every GPU")


def test_rng_state_is_saved_and_restored_for_the_ranks_own_gpu_only(monkeypatch):
    import fastrlhf.engine.checkpoint as checkpoint

    fake = RecordingCuda()
    monkeypatch.setattr(checkpoint.torch, "cuda", fake)
    monkeypatch.setenv("LOCAL_RANK", "3")
    state = checkpoint.capture_rng()
    checkpoint.restore_rng(state)
    assert fake.touched == [("get", torch.device("cuda", 3)), ("set", torch.device("cuda", 3), 3)]
    # A checkpoint written by the old code holds every device's state: this rank takes its own.
    fake.touched.clear()
    checkpoint.restore_rng({**state, "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(8)]})
    assert fake.touched == [("set", torch.device("cuda", 3), 3)]
