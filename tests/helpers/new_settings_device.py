"""One RL step (``RLStep.__call__``: generation, reward model, reference, update) with its models on the emulated
second device of :mod:`helpers.other_device`, for the settings a test chooses: whether any host tensor reaches a
model and which device reads the step makes, its update's kept apart from the rest."""

from __future__ import annotations

import torch

from helpers.other_device import OtherDevice

VOCAB = 64
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


def tiny_lm(seed=0):
    from fastrlhf.modeling.tiny import make_tiny_llama

    return make_tiny_llama(seed=seed, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=1)


def rl_config(**trainer):
    from fastrlhf.config import DataConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig, TrainerConfig

    base = dict(
        max_steps=1, prompts_per_step=3, minibatch_size=6, ppo_epochs=2, grad_accum=2, kl_coef=0.05, loss_chunk_size=5
    )
    return TrainConfig(
        output_dir="unused",
        model=ModelConfig(path="unused"),
        data=DataConfig(prompts="unused"),
        trainer=TrainerConfig(**{**base, **trainer}),
        algorithm="grpo",
        reward=RewardConfig(),
        rollout=RolloutConfig(n=4, max_new_tokens=5, temperature=1.0, max_logprob_mismatch=1.0),
    )


def step_reads(config):
    """``(metrics, update_reads, other_reads)`` of one step of ``config`` on the emulated device: the names of the
    update's reads, and of the step's others outside generation. Each completion scores its first token's parity."""
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.modeling import use_attention
    from fastrlhf.rl.step import RLStep
    from fastrlhf.rollout.hf_engine import HFEngine

    t = config.trainer
    actor, reference = tiny_lm(0), tiny_lm(0)
    for model in (actor, reference):
        use_attention(model, t.packing, t.share_prompts, "sdpa")

    def scorer(exp, prompts, completions, metas, **_):
        # on the host, as a rule reward scores: the step moves it (RLStep.score)
        return torch.tensor([float(c[0] % 2) if c else 0.0 for c in completions])

    with OtherDevice() as dev:
        actor, reference = dev.move(actor.train()), dev.move(reference.eval())
        engine = HFEngine(actor)
        step = RLStep(
            config,
            actor,
            engine,
            scorer,
            reference=reference,
            actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3),
            pad_token_id=0,
            rollout_shares_actor=True,
            device=dev.device,
            guard=StepGuard(),
        )
        apart = set()

        def recorded(run):
            def wrapped(*args, **kwargs):
                before = len(dev.reads)
                out = run(*args, **kwargs)
                apart.update(range(before, len(dev.reads)))
                wrapped.reads = dev.reads[before:]
                return out

            return wrapped

        step.update, step.generate = recorded(step.update), recorded(step.generate)
        before = len(dev.reads)
        metrics = step(PROMPTS, None, step=1)
        others = [r[0] for i, r in enumerate(dev.reads[before:], before) if i not in apart]
        return metrics, [r[0] for r in step.update.reads], others
