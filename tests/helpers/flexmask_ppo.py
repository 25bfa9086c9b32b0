"""A tiny packed PPO step (actor, frozen reference, value-head critic) on the flex backend, and a count of the block
masks it builds: shared by tests/sequences/test_mask_shared_audit4.py and the scratch measurements of its fix."""

import copy

import torch

from fastrlhf.modeling import use_attention
from fastrlhf.modeling.compile import compile_layers
from fastrlhf.sequences import packed_attention
from helpers.rl_case import PPO, PROMPTS, SCORES, FixedScorer, fixed_completions, make_config, tiny_actor, tiny_critic


def flex_on_cpu(monkeypatch) -> None:
    """FlexAttention's eager reference with gradients on a CPU (tests/conftest.py's ``cpu_flex``)."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)


def count_builds(monkeypatch) -> list[int]:
    """The row length of every block mask built from now on (``packed_attention.block_mask`` calls)."""
    built, real = [], packed_attention.block_mask
    monkeypatch.setattr(packed_attention, "block_mask", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    return built


def ppo_step(share_prompts: bool = False, compiled: bool = False, **over):
    """One packed PPO step on flex: ``(metrics, exp, actor, critic)``, the experience with its old and reference
    logprobs and values, the models after the update; ``compiled``: each model's layers compiled (model.compile)."""
    from fastrlhf.rl.step import RLStep

    torch.manual_seed(0)
    hp = make_config(PPO, packing=True, share_prompts=share_prompts, **over)
    actor, reference, critic = tiny_actor(), tiny_actor(seed=1).eval(), tiny_critic()
    completions = fixed_completions(actor, hp.rollout.temperature)
    for model in (actor, reference, critic.lm):
        use_attention(model, True, share_prompts, "flex")
        if compiled:
            compile_layers(model)
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    copt = torch.optim.SGD(critic.parameters(), lr=0.1)
    rl = RLStep(
        hp,
        actor,
        rollout=None,
        scorer=FixedScorer(SCORES),
        reference=reference,
        critic=critic,
        actor_optimizer=opt,
        critic_optimizer=copt,
        pad_token_id=2,
        rollout_shares_actor=True,
    )
    seen = []
    real = rl.update
    rl.update = lambda exp, step: seen.append(copy.copy(exp)) or real(exp, step)
    metrics = rl(PROMPTS, None, step=1, completions=completions)
    return metrics, seen[0], actor, critic
