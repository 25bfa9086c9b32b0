"""The optimizer's settings. ``trainer.lr_schedule``: after the linear warmup the learning rate stays (constant), or
decays over the run's optimizer steps to ``min_lr_ratio`` of ``trainer.lr``, linearly (TRL's default, transformers'
linear schedule) or on a half cosine (OpenRLHF's ``cosine_with_min_lr``); there was no decay at all, so a TRL or
OpenRLHF recipe moved over trained at its peak rate to the end. ``trainer.adam_betas`` and ``adam_eps``."""

import math
import subprocess

import pytest
import torch
from helpers.rl_runs import TRAIN, grpo_config, launch_env, make_tiny, metrics_by_step

from fastrlhf.engine.deepspeed import lr_factor


def transformers_factors(schedule: str, warmup: int, total: int, min_ratio: float) -> list[float]:
    from transformers import get_cosine_with_min_lr_schedule_with_warmup, get_linear_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    if schedule == "linear":
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total)
    else:
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total, min_lr_rate=min_ratio)
    factors = []
    for _ in range(total):
        factors.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return factors


@pytest.mark.parametrize("schedule, min_ratio", [("linear", 0.0), ("cosine", 0.0), ("cosine", 0.1)])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_decay_is_transformers_own(schedule, min_ratio, warmup):
    """After warmup, each optimizer step's rate is transformers' schedule's (its warmup starts at 0, fastrlhf's at
    1 / warmup_steps, so that no step is wasted at rate 0: compared after it)."""
    total = 12
    ours = [lr_factor(s, warmup, schedule, total, min_ratio) for s in range(total)]
    theirs = transformers_factors(schedule, warmup, total, min_ratio)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], abs=1e-12)
    assert ours[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])


def test_a_linear_decay_to_a_floor_and_constant():
    assert [lr_factor(s, 0, "linear", 4, 0.2) for s in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert {lr_factor(s, 2, "constant", 4, 0.2) for s in range(2, 9)} == {1.0}
    assert lr_factor(100, 0, "cosine", 10, 0.1) == pytest.approx(0.1)  # past the end (a longer resumed run): floor


def test_an_rl_run_decays_over_its_optimizer_steps(tmp_path):
    """GRPO with 2 optimizer steps per step (4 completions, minibatches of 2) over 4 steps: 8 steps of decay, the
    logged rate after step s is lr x the factor of optimizer step 2s, down to min_lr_ratio at the end."""
    tiny = make_tiny(tmp_path)
    out = tmp_path / "run"
    config = grpo_config(tiny, out, trainer={"lr_schedule": "cosine", "min_lr_ratio": 0.1, "save_every": 0})
    result = subprocess.run([*TRAIN, config], env=launch_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [metrics_by_step(out)[s]["lr"] for s in (1, 2, 3, 4)]
    expected = [1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 * s / 8))) for s in (1, 2, 3, 4)]
    assert logged == pytest.approx(expected, rel=1e-6)
    assert logged[-1] == pytest.approx(1e-3)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_adams_betas_and_eps_reach_the_optimizer(zero_stage):
    """``trainer.adam_betas`` / ``adam_eps`` (OpenRLHF trains with betas 0.9, 0.95): torch's defaults were fixed."""
    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.deepspeed import build_train_engine
    from fastrlhf.modeling.tiny import make_tiny_llama

    D.init_distributed(timeout_s=60)
    engine = build_train_engine(make_tiny_llama(vocab_size=32, hidden_size=32, num_layers=1).train(),
                                DeepSpeedConfig(zero_stage=zero_stage), lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    groups = engine.basic_optimizer.param_groups
    assert {(tuple(g["betas"]), g["eps"]) for g in groups} == {((0.9, 0.95), 1e-6)}


def test_adam_settings_are_checked():
    from fastrlhf.config import ConfigError
    from fastrlhf.config.checks import _check_loop
    from fastrlhf.config.schema import SFTTrainerConfig

    for bad, message in [({"adam_betas": [0.9]}, "trainer.adam_betas: must be two numbers in [0, 1), got [0.9]"),
                         ({"adam_betas": [0.9, 1.0]}, "trainer.adam_betas: must be two numbers in [0, 1)"),
                         ({"adam_eps": 0.0}, "trainer.adam_eps: must be > 0")]:
        with pytest.raises(ConfigError) as info:
            _check_loop(SFTTrainerConfig(max_steps=1, **bad))
        assert str(info.value).startswith(message), str(info.value)
