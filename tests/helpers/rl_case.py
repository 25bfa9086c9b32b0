"""The RL step case that tests of the step, the colocated engines and the reference's file pages share:
prompts, fixed completions with engine logprobs, fixed scores and the GRPO / PPO settings."""

import dataclasses
from types import SimpleNamespace

import torch

from fastrlhf.algorithms import (
    logprobs_from_logits,
)
from fastrlhf.config import (
    CriticConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
)
from fastrlhf.modeling.tiny import make_tiny_llama
from fastrlhf.rl.experience import build_experience
from fastrlhf.rollout import Completion

PAD = 2


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


N = 4


def tiny_actor(seed=0):
    return make_tiny_llama(seed=seed, vocab_size=96, hidden_size=32, num_layers=2, num_heads=1).train()


def lora_dropout_actor(dropout: float):
    """A LoRA actor (q and v, rank 4) with ``dropout`` and a non-zero adapter, so that dropout changes its outputs."""
    from peft import LoraConfig, get_peft_model

    actor = get_peft_model(tiny_actor(), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                    target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return actor


def tiny_critic():
    from fastrlhf.modeling import CausalLMWithValueHead

    torch.manual_seed(3)
    return CausalLMWithValueHead(tiny_actor(seed=5)).train()


def fixed_completions(actor, temperature):
    """Random completions of lengths 1..7 (one ends in the pad id, a real token here) with engine
    logprobs = the model's own logprobs + noise (what a bf16 or stale engine would report)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _prompt in PROMPTS:
        samples = []
        for _ in range(N):
            length = int(torch.randint(1, 8, (1,), generator=g))
            tokens = torch.randint(3, 96, (length,), generator=g).tolist()
            samples.append(Completion(tokens, [0.0] * length, "length"))
        out.append(samples)
    out[0][1].token_ids[-1] = PAD
    exp = build_experience(PROMPTS, out, PAD)
    with torch.no_grad():
        logits = actor(input_ids=exp.input_ids, attention_mask=exp.attention_mask,
                       position_ids=exp.position_ids).logits[:, exp.response_slice()]
        lp = logprobs_from_logits(logits, exp.labels, temperature)
    noise = 0.3 * torch.randn(lp.shape, generator=g)
    rows = [c for samples in out for c in samples]
    for b, c in enumerate(rows):
        c.logprobs = (lp[b, : len(c.token_ids)] + noise[b, : len(c.token_ids)]).tolist()
    return out


SCORES = torch.tensor([0.1, 0.9, 0.4, 0.4, 1.0, 0.0, 0.5, 0.2, -0.3, 0.7, 0.7, 0.1])


class FixedScorer:
    def __init__(self, scores):
        self.scores = scores

    def __call__(self, exp, prompts, completions, metas):
        return self.scores.clone()


def guarded_step(hp):
    """An RLStep on ``hp`` with a tiny actor (AdamW at 1e-2), a tiny reference, the fixed scores and no rollout
    engine of its own (completions are given); returns ``(rl_step, actor, optimizer)``."""
    from fastrlhf.rl.step import RLStep

    actor = tiny_actor()
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=tiny_actor().eval(),
                actor_optimizer=opt, pad_token_id=PAD, rollout_shares_actor=True)
    return rl, actor, opt


def changed(a, b):
    return max(float((pa - pb).detach().abs().max()) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


GRPO = dict(algorithm="grpo", n=N, prompts_per_step=3, temperature=0.8, minibatch_size=6, grad_accum=2,
            ppo_epochs=2, lr_=0, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean", entropy_coef=0.01,
            kl_coef=0.1, kl_kind="k3", tis_cap=1.5, max_grad_norm=0.5)


PPO = dict(algorithm="ppo", n=N, prompts_per_step=3, temperature=1.0, minibatch_size=4, grad_accum=2, ppo_epochs=2,
           dual_clip=3.0, agg="token-mean", kl_coef=0.05, kl_kind="k1", kl_in_reward=True, gamma=0.99, lam=0.9,
           vf_clip=0.2, vf_coef=0.5, max_grad_norm=1.0)


def make_config(spec=None, **over) -> TrainConfig:
    """A run config (RLStep's one input) from flat rollout/trainer keys; paths are never read here."""
    keys = {k: v for k, v in {**(spec or {}), **over}.items() if k != "lr_"}
    top = {k: keys.pop(k) for k in ("algorithm", "seed") if k in keys}
    top.setdefault("algorithm", "grpo")
    rollout_names = {f.name for f in dataclasses.fields(RolloutConfig)}
    rollout = RolloutConfig(**{k: keys.pop(k) for k in list(keys) if k in rollout_names})
    return TrainConfig(output_dir="unused", model=ModelConfig(path="unused"), data=DataConfig(prompts="unused"),
                       trainer=TrainerConfig(**{"max_steps": 10, **keys}), reward=RewardConfig(function="target_token"),
                       rollout=rollout, critic=CriticConfig() if top["algorithm"] == "ppo" else None, **top)


def flat(config: TrainConfig) -> SimpleNamespace:
    """The hand-written step reads every setting by its bare name."""
    return SimpleNamespace(**vars(config.rollout), **vars(config.trainer), algorithm=config.algorithm,
                           seed=config.seed)
