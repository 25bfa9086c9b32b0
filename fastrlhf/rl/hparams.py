"""The RL step's hyperparameters: a flat frozen dataclass, built from the run config or by hand (tests)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from fastrlhf.algorithms import AGG_MODES
from fastrlhf.config import RolloutConfig, TrainerConfig

__all__ = ["RLHParams"]


def _default(section, name: str):
    """The run config's default for ``section.name``: one home for every default (fastrlhf.config)."""
    return section.__dataclass_fields__[name].default


_R, _T = RolloutConfig, TrainerConfig


@dataclass(frozen=True)
class RLHParams:
    """Defaults are the run config's (``rollout``/``trainer`` sections), except where noted."""

    algorithm: str = "grpo"  # grpo | ppo
    seed: int = 0
    # rollout (temperature is also the training temperature: logprobs are of the sampled distribution)
    n: int = _default(_R, "n")
    temperature: float = _default(_R, "temperature")
    top_p: float = _default(_R, "top_p")
    top_k: int = _default(_R, "top_k")
    max_new_tokens: int = _default(_R, "max_new_tokens")
    stop_token_ids: tuple = ()
    sync_bucket_bytes: int = _default(_R, "sync_bucket_bytes")
    # update
    prompts_per_step: int = _default(_T, "prompts_per_step")
    # Per rank, unlike the config's (which counts all ranks): 0 = the whole rank batch.
    minibatch_size: int = 0
    ppo_epochs: int = _default(_T, "ppo_epochs")
    grad_accum: int = _default(_T, "grad_accum")
    max_grad_norm: float = _default(_T, "max_grad_norm")
    clip_low: float = _default(_T, "clip_low")
    clip_high: float = _default(_T, "clip_high")
    dual_clip: float | None = _default(_T, "dual_clip")
    agg: str = _default(_T, "agg")
    entropy_coef: float = _default(_T, "entropy_coef")
    kl_coef: float = _default(_T, "kl_coef")
    kl_kind: str = _default(_T, "kl_kind")
    kl_in_reward: bool = _default(_T, "kl_in_reward")  # PPO: KL shaped into token rewards; GRPO: always in the loss
    gamma: float = _default(_T, "gamma")
    lam: float = _default(_T, "lam")
    vf_clip: float = _default(_T, "vf_clip")  # the config's null (no clipping) arrives as inf
    vf_coef: float = _default(_T, "vf_coef")
    whiten_advantages: bool = _default(_T, "whiten_advantages")
    scale_by_std: bool = _default(_T, "scale_by_std")  # false = Dr.GRPO
    tis_cap: float | None = _default(_T, "tis_cap")
    loss_chunk_size: int | None = _default(_T, "loss_chunk_size")
    loss_chunk_bytes: int | None = _default(_T, "loss_chunk_bytes")
    fused_loss: bool = _default(_T, "fused_loss")
    forward_micro_batch: int | None = _default(_T, "forward_micro_batch")  # None = the micro-batch
    old_logprobs: str = _default(_T, "old_logprobs")  # auto: not recomputed on-policy (skips_old_logprobs)

    def __post_init__(self):
        if self.algorithm not in ("grpo", "ppo"):
            raise ValueError(f"algorithm must be 'grpo' or 'ppo', got {self.algorithm!r}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"trainer.agg must be one of {', '.join(AGG_MODES)}, got {self.agg!r}")
        if self.ppo_epochs < 1 or self.grad_accum < 1:
            raise ValueError(f"ppo_epochs and grad_accum must be >= 1, got {self.ppo_epochs} and {self.grad_accum}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"trainer.tis_cap must be > 0 or null, got {self.tis_cap}")
        if self.old_logprobs not in ("auto", "recompute"):
            raise ValueError(f"trainer.old_logprobs must be 'auto' or 'recompute', got {self.old_logprobs!r}")
        if self.algorithm == "grpo" and self.n < 2:
            raise ValueError(f"GRPO needs rollout.n >= 2 completions per prompt (a group of one has no baseline), "
                             f"got n={self.n}")

    @classmethod
    def from_config(cls, config) -> RLHParams:
        """From the run config (``config.trainer``/``config.rollout`` sections); unknown names are ignored."""
        names = {f.name for f in fields(cls)}
        values = {"algorithm": config.algorithm, "seed": getattr(config, "seed", 0)}
        for section in (getattr(config, "rollout", None), getattr(config, "trainer", None)):
            if section is None:
                continue
            items = section.items() if isinstance(section, dict) else vars(section).items()
            for key, value in items:
                if key in names and key not in ("algorithm", "seed"):
                    values[key] = value
        if "vf_clip" in values and values["vf_clip"] is None:
            values["vf_clip"] = float("inf")
        if values.get("tis_cap") in (0, 0.0):
            values["tis_cap"] = None
        if values.get("stop_token_ids") is not None:
            values["stop_token_ids"] = tuple(values["stop_token_ids"])
        else:
            values.pop("stop_token_ids", None)
        return cls(**values)

    def skips_old_logprobs(self, rank_batch: int) -> bool:
        """Whether the step trains on-policy without recomputing the old logprobs first.

        With one optimizer step per rollout batch (one epoch, one minibatch) the parameters the
        update starts from ARE the old policy, so old = the update's own logprobs, detached (ratio
        1, as TRL and verl do): a whole forward pass saved. Not with TIS (its weights compare the
        trainer's old logprobs with the engine's before the update) nor with PPO's KL-shaped
        rewards (they need the old logprobs before the advantages exist).
        """
        single_update = self.ppo_epochs == 1 and self.micro_batch_size(rank_batch) * self.grad_accum == rank_batch
        return (self.old_logprobs == "auto" and single_update and self.tis_cap is None
                and not (self.algorithm == "ppo" and self.kl_in_reward))

    def micro_batch_size(self, rank_batch: int) -> int:
        """Sequences per micro-batch given this rank's batch size; raises on uneven splits."""
        minibatch = self.minibatch_size or rank_batch
        if rank_batch % minibatch:
            raise ValueError(f"each rank has {rank_batch} sequences per step (prompts_per_step * n / world_size), "
                             f"not a multiple of trainer.minibatch_size={minibatch}")
        if minibatch % self.grad_accum:
            raise ValueError(f"trainer.minibatch_size={minibatch} is not a multiple of trainer.grad_accum="
                             f"{self.grad_accum}")
        return minibatch // self.grad_accum
