"""Engine audit 3: a resumed run's TensorBoard curves, the checkpoint a failed step leaves, fp16 through
``deepspeed.extra``."""

import dataclasses
import sys
import types

import pytest

from fastrlhf.config import DeepSpeedConfig
from fastrlhf.config.errors import ConfigError
from fastrlhf.engine.deepspeed import deepspeed_config
from fastrlhf.engine.guards import StepFailed, StepGuard
from fastrlhf.engine.metrics import MetricsLogger
from tests.helpers.loggers import NullLogger


@pytest.fixture
def fake_tensorboard(monkeypatch):
    """A stand-in ``torch.utils.tensorboard`` recording how each SummaryWriter was opened."""
    opened = []

    class SummaryWriter:
        def __init__(self, log_dir, **kwargs):
            opened.append(kwargs)

        def add_scalar(self, *args):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    return opened


def test_a_resumed_run_has_tensorboard_hide_the_steps_it_rewrites(tmp_path, fake_tensorboard):
    """A run killed at step 5 after its step-3 checkpoint logs steps 4 and 5 again when resumed: the writer must
    purge the killed run's events from step 4 on. Before: no purge_step, and TensorBoard showed both runs' steps
    4 and 5 (7 points for 5 steps, the curve doubling back)."""
    MetricsLogger(str(tmp_path), total_steps=5, enabled=True, tensorboard=True).close()
    MetricsLogger(str(tmp_path), total_steps=5, start_step=3, enabled=True, tensorboard=True, resume=True).close()
    # --resume where no checkpoint was written: the run starts over, and all of the killed run's events go
    MetricsLogger(str(tmp_path), total_steps=5, start_step=0, enabled=True, tensorboard=True, resume=True).close()
    assert [kwargs.get("purge_step") for kwargs in fake_tensorboard] == [None, 4, 0]


def test_a_run_resumed_without_a_checkpoint_logs_its_step_0_validation_once(tmp_path, monkeypatch):
    """Killed in step 3 before its first checkpoint and resumed: the run starts over at step 0 and validates again
    (``eval.before_train``). Before: the killed run's step-0 record was kept, metrics.jsonl held steps [0, 0, 1]."""
    from fastrlhf.engine.metrics import read_metrics

    monkeypatch.setenv("FASTRLHF_NO_PROGRESS", "1")
    logger = MetricsLogger(str(tmp_path), total_steps=5, enabled=True)
    for step in range(3):
        logger.log(step, {"reward_mean": 0.1 * step})
    logger.close()
    logger = MetricsLogger(str(tmp_path), total_steps=5, start_step=0, enabled=True, resume=True)
    for step in range(2):
        logger.log(step, {"reward_mean": 0.2 * step})
    logger.close()
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0, 1]
    logger = MetricsLogger(str(tmp_path), total_steps=5, start_step=1, enabled=True, resume=True)  # a checkpoint at 1
    logger.close()
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0, 1]


def test_resumed_tensorboard_curves_hold_each_step_once(tmp_path, monkeypatch):
    """The same, read back by TensorBoard itself (where the package is installed)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("FASTRLHF_NO_PROGRESS", "1")
    logger = MetricsLogger(str(tmp_path), total_steps=5, enabled=True, tensorboard=True)
    for step in range(1, 6):
        logger.log(step, {"loss": float(step)})
    logger.close()
    logger = MetricsLogger(str(tmp_path), total_steps=5, start_step=3, enabled=True, tensorboard=True, resume=True)
    for step in (4, 5):
        logger.log(step, {"loss": 10.0 * step})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]


def _config(tmp_path, **trainer):
    from helpers.rl_case import GRPO, make_config

    config = make_config(GRPO, seed=3)
    return dataclasses.replace(config, output_dir=str(tmp_path), trainer=dataclasses.replace(config.trainer, **trainer))


def _run_failing(config, fail_at: int, start_step: int = 0, completed: bool = False) -> list[int]:
    """The checkpoints run_steps writes when step ``fail_at`` raises StepFailed."""
    import fastrlhf.engine.loop as loop

    saved = []

    def step_fn(step):
        if step == fail_at:
            exc = StepFailed("the reward function raised")
            exc.completed_step = completed
            raise exc
        return {"skipped": False}

    save = loop.save_checkpoint
    loop.save_checkpoint = lambda *args, **kwargs: saved.append(args[1])
    try:
        with pytest.raises(StepFailed):
            loop.run_steps(
                config,
                step_fn,
                start_step=start_step,
                stateful={},
                logger=NullLogger(),
                guard=StepGuard(3),
                skip_reason="",
                export_engine=None,
            )
    finally:
        loop.save_checkpoint = save
    return saved


def test_a_failed_step_does_not_rewrite_the_checkpoint_just_saved(tmp_path):
    """save_every: 2 and step 3 fails: step 2's checkpoint exists. Before: it was written a second time (minutes for
    a 1.5B model's optimizer state), replacing the copy taken when step 3 began with one holding what the failed
    step consumed (its RNG draws)."""
    assert _run_failing(_config(tmp_path, save_every=2, max_steps=6), fail_at=3) == [2]


def test_a_failed_step_still_keeps_the_last_good_step_when_unsaved(tmp_path):
    assert _run_failing(_config(tmp_path, save_every=0, max_steps=6), fail_at=3) == [2]
    assert _run_failing(_config(tmp_path, save_every=2, max_steps=6), fail_at=4, completed=True) == [2, 4]
    assert _run_failing(_config(tmp_path, save_every=0, max_steps=6), fail_at=3, start_step=2) == []


@pytest.mark.parametrize("enabled", [True, "auto"])
def test_fp16_through_deepspeed_extra_is_refused_naming_the_field(enabled):
    """fp16 in ``deepspeed.extra`` turns on DeepSpeed's dynamic loss scaler, whose calibration overflows (one per
    halving of the 2**16 initial scale) the guard counted as bad steps. Before: a healthy ZeRO-1 run (finite losses
    of about 300) stopped at step 3 with TooManySkippedSteps, "lower trainer.lr or check the data"."""
    ds = DeepSpeedConfig(zero_stage=1, extra={"fp16": {"enabled": enabled, "initial_scale_power": 16}})
    with pytest.raises(ConfigError, match=r"^deepspeed\.extra\.fp16: .*bf16"):
        deepspeed_config(ds)


def test_other_extra_settings_and_fp16_off_pass_through():
    extra = {"fp16": {"enabled": False}, "prescale_gradients": True}
    config = deepspeed_config(DeepSpeedConfig(zero_stage=2, extra=extra))
    assert config["fp16"] == {"enabled": False} and config["prescale_gradients"] is True


def test_to_device_blocks_on_a_copy_to_the_host(monkeypatch):
    """A non-blocking device-to-host copy returns before its data has arrived (CUDA writes into pinned memory
    later): ``StepGuard.inputs_ok`` stacks and reads such a copy at once when its checked tensors are on the host
    and a ``largest`` value on the device. Before: every copy was non-blocking, the host's too."""
    import torch

    from fastrlhf.engine.device import to_device

    asked = []
    to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        asked.append((str(args[0]), kwargs.get("non_blocking")))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    to_device({"a": torch.ones(2), "b": [torch.ones(1)]}, "cpu")
    to_device(torch.ones(2), torch.device("cpu"))
    to_device(torch.ones(2), torch.device("meta"))
    assert asked == [("cpu", False), ("cpu", False), ("cpu", False), ("meta", True)]


def test_a_validated_step_is_logged_off_the_log_cadence(tmp_path, monkeypatch):
    """``eval.every`` 2 with ``trainer.log_every`` 5 over 4 steps: step 2's validation figures reach the log (before,
    only steps 4 (the last) and multiples of 5 were logged, and step 2's eval/* figures were lost)."""
    import fastrlhf.engine.loop as loop

    class Recorder(NullLogger):
        steps = []

        def log(self, step, metrics):
            self.steps.append(step)

    monkeypatch.setattr(loop, "save_checkpoint", lambda *args, **kwargs: None)
    config = _config(tmp_path, save_every=0, max_steps=4, log_every=5, save_final=False)
    loop.run_steps(config, lambda step: {"skipped": False, **({"eval/reward_mean": 0.5} if step == 2 else {})},
                   start_step=0, stateful={}, logger=Recorder(), guard=StepGuard(3), skip_reason="",
                   export_engine=None)
    assert Recorder.steps == [2, 4]
