"""The ragged RL batch and the step settings that tests of packed layouts share (sequences/test_packing.py,
modeling/test_tied_gradient.py)."""

import torch

from fastrlhf.config import (
    CriticConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
)
from fastrlhf.rollout import Completion

PAD = 2


VOCAB = 96


def ragged_batch(seed=0, num_prompts=3, n=4, long=24, empty=True, episodes=False):
    """Prompts of 1-5 tokens, completions of 1-6 tokens, one of ``long`` tokens and (optionally) one empty.
    ``episodes``: completions of 3 tokens or more are multi-turn episodes, a tool turn of 1-3 tokens masked
    in their middle (logprob 0 there, as ``fastrlhf.rollout.episodes`` builds them)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_prompts)]
    completions = []
    for i in range(num_prompts):
        samples = []
        for j in range(n):
            length = long if (i, j) == (1, 2) else 0 if (empty and (i, j) == (2, 0)) else int(
                torch.randint(1, 7, (1,), generator=g))
            tokens = torch.randint(3, VOCAB, (length,), generator=g).tolist()
            logprobs = (-torch.rand(length, generator=g)).tolist()
            mask = None
            if episodes and length >= 3:
                start = int(torch.randint(1, length - 1, (1,), generator=g))
                stop = min(length - 1, start + int(torch.randint(1, 4, (1,), generator=g)))
                mask = [0 if start <= k < stop else 1 for k in range(length)]
                logprobs = [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)]
            samples.append(Completion(tokens, logprobs, "length", mask=mask))
        completions.append(samples)
    completions[0][1].token_ids[-1] = PAD  # the pad id as a real token
    return prompts, completions


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every parameter's gradient at each step."""

    def __init__(self, named_params, lr):
        self.names = [n for n, _ in named_params]
        super().__init__([p for _, p in named_params], lr=lr)
        self.grads = []

    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        self.grads.append({n: p.grad.detach().clone() for n, p in zip(self.names, params, strict=True)
                           if p.grad is not None})
        return super().step(closure)


def make_config(algorithm, agg, **trainer):
    keys = dict(prompts_per_step=3, minibatch_size=6, ppo_epochs=2, agg=agg, clip_low=0.2, clip_high=0.28,
                kl_coef=0.1, kl_kind="k3", entropy_coef=0.01, max_grad_norm=1e6, old_logprobs="recompute")
    if algorithm == "ppo":
        keys.update(kl_in_reward=True, kl_coef=0.05, vf_clip=0.2, gamma=0.99, lam=0.9, dual_clip=3.0)
    keys.update(trainer)
    return TrainConfig(algorithm=algorithm, output_dir="unused", model=ModelConfig(path="unused"),
                       data=DataConfig(prompts="unused"), reward=RewardConfig(function="target_token"),
                       trainer=TrainerConfig(max_steps=10, **keys),
                       rollout=RolloutConfig(n=4, temperature=0.9, max_logprob_mismatch=None),
                       critic=CriticConfig() if algorithm == "ppo" else None)
