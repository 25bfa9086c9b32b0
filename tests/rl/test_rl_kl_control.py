"""PPO's controls from InstructGPT / verl / OpenRLHF: the adaptive KL coefficient (``trainer.kl_target``) and the
critic's warmup (``trainer.critic_warmup_steps``), in the step. Their resume is covered by
``tests/rl/test_rl_distributed.py::test_kill_and_resume_matches_uninterrupted_grpo_run`` (its run adapts the KL)."""

import copy
import dataclasses
import math

import pytest
import torch
from helpers.rl_case import (
    GRPO,
    PAD,
    PPO,
    PROMPTS,
    SCORES,
    FixedScorer,
    changed,
    fixed_completions,
    make_config,
    tiny_actor,
    tiny_critic,
)

from fastrlhf.algorithms import AdaptiveKLController, adaptive_kl_coef
from fastrlhf.rl.step import RLStep
from fastrlhf.rollout import RolloutEngine


def test_the_coefficient_moves_toward_the_target_by_at_most_a_fifth_of_samples_over_horizon():
    # error = kl / target - 1, clipped to +-0.2; the coefficient changes by error x samples / horizon of itself.
    assert adaptive_kl_coef(0.1, kl=0.11, target=0.1, samples=100, horizon=1000) == pytest.approx(0.1 * (1 + 0.01))
    assert adaptive_kl_coef(0.1, kl=0.5, target=0.1, samples=100, horizon=1000) == pytest.approx(0.1 * 1.02)
    assert adaptive_kl_coef(0.1, kl=0.0, target=0.1, samples=100, horizon=1000) == pytest.approx(0.1 * 0.98)
    assert adaptive_kl_coef(0.1, kl=0.1, target=0.1, samples=100, horizon=1000) == 0.1
    control = AdaptiveKLController(0.05, target=0.02, horizon=50)
    control.update(0.03, samples=10)  # error 0.5, clipped to 0.2: x 1.04
    assert control.value == pytest.approx(0.052)
    for kl in (None, float("nan"), float("inf")):  # a skipped step, or no KL measured: no change
        control.update(kl, samples=10)
    assert control.value == pytest.approx(0.052)
    restored = AdaptiveKLController(0.05, target=0.02, horizon=50)
    restored.load_state_dict(control.state_dict())
    assert restored.value == control.value


def _step(config, actor, critic=None, rollout=None):
    return RLStep(config, actor, rollout=rollout, scorer=FixedScorer(SCORES), reference=tiny_actor(seed=1).eval(),
                  critic=critic, actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=5e-3),
                  critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=5e-3) if critic is not None else None,
                  pad_token_id=PAD, rollout_shares_actor=rollout is None)


@pytest.mark.parametrize("spec", [GRPO, PPO], ids=["grpo-kl-in-loss", "ppo-kl-in-reward"])
def test_each_step_trains_with_the_coefficient_the_controller_reached(spec):
    """Two adaptive steps train exactly as two fixed-coefficient steps given the controller's values: the second
    step's coefficient is the first's moved by the formula, in the loss (GRPO) and in PPO's token rewards."""
    config = make_config(spec, kl_coef=0.05, kl_target=0.01, kl_horizon=20)  # 12 completions: up to 12% a step
    ppo = spec is PPO
    actor = tiny_actor()
    completions = fixed_completions(actor, config.rollout.temperature)
    fixed_actor, critic = copy.deepcopy(actor), tiny_critic() if ppo else None
    adaptive = _step(config, actor, critic)
    fixed = _step(dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, kl_target=None)),
                  fixed_actor, copy.deepcopy(critic) if ppo else None)

    first = adaptive(PROMPTS, None, step=1, completions=copy.deepcopy(completions))
    assert first["kl_coef"] == 0.05 and first["kl"] > 0  # the reference differs from the actor
    moved = adaptive_kl_coef(0.05, first["kl"], 0.01, 12, 20)
    assert adaptive.kl_control.value == pytest.approx(moved) and moved > 0.05 * 1.1  # kl over its target: up
    second = adaptive(PROMPTS, None, step=2, completions=copy.deepcopy(completions))
    assert second["kl_coef"] == pytest.approx(moved)

    fixed(PROMPTS, None, step=1, completions=copy.deepcopy(completions))
    fixed.config = dataclasses.replace(fixed.config, trainer=dataclasses.replace(fixed.config.trainer, kl_coef=moved))
    expected = fixed(PROMPTS, None, step=2, completions=copy.deepcopy(completions))
    assert "kl_coef" not in expected  # logged only where it adapts
    for key in ("policy_loss", "kl", "advantage_mean"):
        assert second[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    for a, b in zip(actor.parameters(), fixed_actor.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7)
    # The coefficient matters here: the same second step at the starting coefficient trains otherwise.
    held = _step(config, tiny_actor(), tiny_critic() if ppo else None)
    held.kl_control.target = first["kl"]  # kl on its target: the coefficient stays 0.05
    held(PROMPTS, None, step=1, completions=copy.deepcopy(completions))
    unchanged = held(PROMPTS, None, step=2, completions=copy.deepcopy(completions))
    key = "advantage_mean" if ppo else "policy_loss"  # where each puts the KL: PPO's rewards, GRPO's loss
    assert unchanged["kl_coef"] == 0.05 and not math.isclose(unchanged[key], second[key], rel_tol=1e-6)


class CountingEngine(RolloutEngine):
    """Fixed completions; counts the weight syncs it receives."""

    def __init__(self, completions):
        self.completions, self.syncs = completions, 0

    def generate(self, prompt_token_ids, sampling):
        return copy.deepcopy(self.completions)

    def update_weights(self, named_tensors):
        list(named_tensors)
        self.syncs += 1


def test_during_the_critic_warmup_only_the_critic_trains_and_no_weights_are_synced():
    config = make_config(PPO, critic_warmup_steps=2)
    actor, critic = tiny_actor(), tiny_critic()
    engine = CountingEngine(fixed_completions(actor, config.rollout.temperature))
    rl = _step(config, actor, critic, rollout=engine)
    actor_before, critic_before = copy.deepcopy(actor), copy.deepcopy(critic)
    for step in (1, 2):
        metrics = rl(PROMPTS, None, step=step)
        assert metrics["critic_warmup"] == 1.0 and "policy_loss" not in metrics
        assert math.isfinite(metrics["value_loss"]) and metrics["skipped"] == 0.0
    assert changed(actor_before, actor) == 0.0 and changed(critic_before, critic) > 1e-3
    assert engine.syncs == 0 and rl.actor.optimizer.state == {}  # no actor optimizer step: Adam's moments unborn
    metrics = rl(PROMPTS, None, step=3)
    assert "critic_warmup" not in metrics and math.isfinite(metrics["policy_loss"])
    assert changed(actor_before, actor) > 1e-3 and engine.syncs == 1
