"""One RL step: generate -> score -> old/ref logprobs (+ values) -> advantages -> update -> weight sync.

:class:`RLStep` holds the models and does the step; it knows nothing about configs, files or
launchers (``fastrlhf.rl.trainer`` builds it from a config). Models come in as DeepSpeed engines
or as plain modules with torch optimizers (see ``fastrlhf.rl.learner``), so a single process
without DeepSpeed runs exactly the same step.

Metrics of a step (reduced over ranks: means, except times and ``*_max`` which take the slowest /
largest rank, and token counts which are summed): reward_mean/std, kl (rollout KL of the old policy
to the reference, ``kl_kind``), entropy (policy entropy during the update), policy_loss, value_loss,
clipfrac, approx_kl, logprob_mismatch_mean/max (|actor recomputed - engine| over completion tokens),
tis_weight_mean, grad_norm, generated_tokens, tokens_per_second (generated tokens / generate time),
time/generate, time/score (rewards + old/ref logprobs + values), time/reward, time/train, time/sync,
step_time, sync_bytes, skipped (this step) and skipped_steps (total).
"""

from __future__ import annotations

import contextlib
import time

import torch

from fastrlhf import comm
from fastrlhf import distributed as D
from fastrlhf.algorithms import kl_penalty, masked_mean
from fastrlhf.guards import TooManySkippedSteps
from fastrlhf.rl.experience import Experience, build_experience
from fastrlhf.rl.forward import policy_loss_from_model, sequence_logprobs, unwrap
from fastrlhf.rl.grpo import compute_grpo_token_advantages
from fastrlhf.rl.hparams import RLHParams
from fastrlhf.rl.learner import as_learner
from fastrlhf.rl.ppo import compute_ppo_advantages, critic_loss
from fastrlhf.rl.update import minibatch_order, run_updates

__all__ = ["RLStep"]

# log(ratio) clamp before exp() for the importance weights; the cap bounds them anyway.
_MAX_LOG_IS = 20.0


class RLStep:
    """The PPO / GRPO step. Call :meth:`__call__` with this rank's prompts (and their meta records).

    - ``actor``: DeepSpeed engine, or a module with ``actor_optimizer``.
    - ``rollout``: a ``RolloutEngine``; ``rollout_shares_actor=True`` when it generates with the
      actor's own module (HF engine, ZeRO 0-2): then no weight sync is needed.
    - ``reference``: frozen module (or engine); None with a PEFT actor = the actor with its adapter
      disabled; None without KL (kl_coef == 0) = not needed.
    - ``critic``: PPO only, DeepSpeed engine or module with ``critic_optimizer``.
    - ``scorer``: ``fastrlhf.rl.rewards.RewardScorer`` (or any callable with its signature).
    """

    def __init__(self, hp: RLHParams, actor, rollout, scorer, reference=None, critic=None, actor_optimizer=None,
                 critic_optimizer=None, pad_token_id: int = 0, rollout_shares_actor: bool = False,
                 device: str | torch.device = "cpu", guard=None):
        self.hp = hp
        self.guard = guard  # fastrlhf.guards.StepGuard shared by the actor's and critic's optimizers
        self.actor = as_learner(actor, actor_optimizer, hp.grad_accum, hp.max_grad_norm, guard)
        self.critic = None
        if hp.algorithm == "ppo":
            if critic is None:
                raise ValueError("PPO needs a critic (critic.path, or the actor's path for a fresh value head)")
            self.critic = as_learner(critic, critic_optimizer, hp.grad_accum, hp.max_grad_norm, guard)
        self.rollout = rollout
        self.scorer = scorer
        self.reference = reference
        self.pad_token_id = int(pad_token_id)
        self.rollout_shares_actor = rollout_shares_actor
        self.device = torch.device(device)
        self.skipped_steps = 0
        if hp.kl_coef != 0.0 and reference is None and not hasattr(unwrap(self.actor.module), "disable_adapter"):
            raise ValueError("kl_coef != 0 needs a reference model (reference.path) or a LoRA actor")

    # ------------------------------------------------------------------ rollout
    def sampling(self, step: int):
        from fastrlhf.rollout import SamplingConfig

        rank, world = D.rank(), D.world_size()
        hp = self.hp
        # A seed per (step, rank): different samples on each rank, the same ones after a resume.
        return SamplingConfig(n=hp.n, temperature=hp.temperature, top_p=hp.top_p, top_k=hp.top_k,
                              max_new_tokens=hp.max_new_tokens, stop_token_ids=tuple(hp.stop_token_ids),
                              seed=(hp.seed * 1_000_003 + step * world + rank) % (2**31))

    def generate(self, prompts: list[list[int]], step: int):
        return self.rollout.generate(prompts, self.sampling(step))

    # ------------------------------------------------------------------ scoring / preparation
    def _reference_context(self):
        if self.reference is not None:
            return self.reference, contextlib.nullcontext()
        return self.actor.module, unwrap(self.actor.module).disable_adapter()

    def prepare(self, exp: Experience) -> dict[str, float]:
        """Old logprobs (recomputed by the actor), reference logprobs, values and advantages.

        On-policy (``hp.skips_old_logprobs``) the old logprobs stay None: the update takes its own,
        detached, and the rollout ``kl`` / ``rollout_entropy`` metrics come from the update instead
        (same parameters, same tokens: the same values); ``logprob_mismatch_*`` is then not logged.
        """
        hp = self.hp
        micro = hp.forward_micro_batch or hp.micro_batch_size(exp.batch_size)
        mask = exp.response_mask
        keep = mask > 0
        metrics = {}
        exp.old_logprobs = None
        if not hp.skips_old_logprobs(exp.batch_size):
            exp.old_logprobs, old_entropy = sequence_logprobs(self.actor.module, exp, hp.temperature, micro,
                                                              hp.loss_chunk_size, hp.fused_loss,
                                                              chunk_bytes=hp.loss_chunk_bytes)
            diff = torch.where(keep, (exp.old_logprobs - exp.engine_logprobs).abs(), 0.0)
            metrics.update(logprob_mismatch_mean=float(masked_mean(diff, mask)),
                           logprob_mismatch_max=float(diff.max()) if diff.numel() else 0.0,
                           rollout_entropy=float(masked_mean(old_entropy, mask)))
        if hp.kl_coef != 0.0:
            ref_model, ctx = self._reference_context()
            with ctx:
                exp.ref_logprobs, _ = sequence_logprobs(ref_model, exp, hp.temperature, micro, hp.loss_chunk_size,
                                                        hp.fused_loss, chunk_bytes=hp.loss_chunk_bytes)
            if exp.old_logprobs is not None:
                kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, hp.kl_kind, mask)
                metrics["kl"] = float(masked_mean(kl, mask))
        if hp.tis_cap is not None:
            # Truncated importance sampling: the engine sampled from engine_lp, we train as if from old_lp.
            log_w = (exp.old_logprobs - exp.engine_logprobs).clamp(-_MAX_LOG_IS, _MAX_LOG_IS)
            exp.is_weights = torch.where(keep, torch.exp(log_w).clamp(max=hp.tis_cap), 0.0)
            metrics["tis_weight_mean"] = float(masked_mean(exp.is_weights, mask))
        if hp.algorithm == "ppo":
            from fastrlhf.rl.forward import token_values

            exp.values = token_values(self.critic.module, exp, micro)
            compute_ppo_advantages(exp, hp)
        else:
            compute_grpo_token_advantages(exp, hp)
        metrics["advantage_mean"] = float(masked_mean(exp.advantages, mask))
        return metrics

    # ------------------------------------------------------------------ update
    def train(self, exp: Experience, step: int) -> dict[str, float]:
        hp = self.hp
        micro = hp.micro_batch_size(exp.batch_size)
        generator = torch.Generator().manual_seed(hp.seed * 7919 + step)
        order = minibatch_order(exp.batch_size, micro, hp.grad_accum, hp.ppo_epochs, generator)
        # In-loss KL for GRPO, and for PPO when it is not shaped into the rewards.
        kl_coef = 0.0 if (hp.algorithm == "ppo" and hp.kl_in_reward) else hp.kl_coef

        def actor_loss(module, mb):
            return policy_loss_from_model(module, mb, clip_low=hp.clip_low, clip_high=hp.clip_high,
                                          dual_clip=hp.dual_clip, kl_coef=kl_coef, kl_kind=hp.kl_kind,
                                          entropy_coef=hp.entropy_coef, temperature=hp.temperature, agg=hp.agg,
                                          chunk_size=hp.loss_chunk_size, fused=hp.fused_loss,
                                          chunk_bytes=hp.loss_chunk_bytes)

        unwrap(self.actor.module).train()
        actor = run_updates(self.actor, exp, actor_loss, order)
        metrics = {
            "policy_loss": actor.get("loss", float("nan")),
            "clipfrac": actor.get("clipfrac", float("nan")),
            "approx_kl": actor.get("approx_kl", float("nan")),
            "entropy": actor.get("entropy", float("nan")),
            "loss_kl": actor.get("kl", float("nan")),
            "grad_norm": actor["grad_norm"],
            "optimizer_steps": actor["optimizer_steps"],
        }
        if exp.old_logprobs is None and not actor["aborted"]:
            # On-policy: the update's logprobs are the rollout policy's (see prepare).
            metrics["rollout_entropy"] = metrics["entropy"]
            if exp.ref_logprobs is not None:
                metrics["kl"] = metrics["loss_kl"]
        aborted = actor["aborted"]
        if self.critic is not None and not aborted:
            unwrap(self.critic.module).train()
            critic = run_updates(self.critic, exp, lambda module, mb: critic_loss(module, mb, hp), order)
            metrics.update(value_loss=critic.get("value_loss", float("nan")),
                           vf_clipfrac=critic.get("vf_clipfrac", float("nan")), critic_grad_norm=critic["grad_norm"])
            aborted = critic["aborted"]
        metrics["aborted"] = aborted
        return metrics

    # ------------------------------------------------------------------ sync
    def sync(self) -> dict[str, float]:
        if self.rollout_shares_actor:
            return {"sync_bytes": 0.0}
        from fastrlhf.rl.lora_sync import is_peft_model, sync_lora_weights
        from fastrlhf.rollout.weight_sync import sync_weights

        source = getattr(self.actor, "engine", self.actor.module)
        if is_peft_model(unwrap(self.actor.module)):
            stats = sync_lora_weights(source, self.rollout, self.hp.sync_bucket_bytes)
        else:
            stats = sync_weights(source, self.rollout, bucket_bytes=self.hp.sync_bucket_bytes)
        return {"sync_bytes": float(stats.bytes), "sync_buckets": float(stats.num_buckets)}

    # ------------------------------------------------------------------ the whole step
    def __call__(self, prompts: list[list[int]], metas: list[dict] | None, step: int,
                 completions=None) -> dict[str, float]:
        """Run one step on this rank's prompts; ``completions`` (per prompt, n each) skips generation.

        Returns the step's metrics, reduced over ranks (a collective: call it on every rank).
        """
        metas = metas if metas is not None else [{} for _ in prompts]
        timings = {}
        t0 = time.perf_counter()
        if completions is None:
            completions = self.generate(prompts, step)
        timings["generate"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        exp = build_experience(prompts, completions, self.pad_token_id, self.device)
        row_prompts = [p for p, samples in zip(prompts, completions, strict=True) for _ in samples]
        row_completions = [c.token_ids for samples in completions for c in samples]
        row_metas = [m for m, samples in zip(metas, completions, strict=True) for _ in samples]
        exp.scores = self.scorer(exp, row_prompts, row_completions, row_metas).float()
        timings["reward"] = time.perf_counter() - t0
        prep = self.prepare(exp)
        timings["score"] = time.perf_counter() - t0

        # NaN guard, decided by all ranks together: anything non-finite in what the update would
        # consume skips the whole step before any parameter moves.
        consumed = [exp.scores, exp.advantages]
        consumed += [t for t in (exp.old_logprobs, exp.ref_logprobs, exp.values, exp.returns, exp.is_weights)
                     if t is not None]
        all_finite = torch.stack([torch.isfinite(t).all() for t in consumed]).all()
        bad_inputs = comm.any_rank_true(~all_finite)

        t0 = time.perf_counter()
        if bad_inputs:
            train = {"aborted": True}
        else:
            train = self.train(exp, step)
        timings["train"] = time.perf_counter() - t0
        skipped = bool(train.pop("aborted"))
        if self.guard is not None:
            if bad_inputs:
                self.guard.mark_skipped()
            try:
                skipped = self.guard.end_step(step) or skipped
            except TooManySkippedSteps as exc:  # this step's metrics first, then stop (every rank alike)
                exc.metrics = self._reduce_metrics(exp, prep, train, {"sync_bytes": 0.0}, {**timings, "sync": 0.0},
                                                   True, step)
                raise
        if skipped:
            self.skipped_steps += 1

        t0 = time.perf_counter()
        sync = self.sync() if not (bad_inputs) else {"sync_bytes": 0.0}
        timings["sync"] = time.perf_counter() - t0
        return self._reduce_metrics(exp, prep, train, sync, timings, skipped, step)

    def _reduce_metrics(self, exp, prep, train, sync, timings, skipped, step) -> dict[str, float]:
        scores = exp.scores.double()
        finite = torch.isfinite(scores)
        gen_tokens = float(exp.response_mask.sum())
        total = comm.reduce_floats([float(scores[finite].sum()), float(scores[finite].square().sum()),
                                    float(finite.sum()), gen_tokens], "sum")
        count = max(total[2], 1.0)
        mean = total[0] / count
        var = max(total[1] / count - mean * mean, 0.0) * (count / max(count - 1, 1))
        local = {**prep, **train, **{f"time/{k}": v for k, v in timings.items()}, **sync}
        keys = sorted(local)
        world = D.world_size()
        summed = comm.reduce_floats([float(local[k]) for k in keys], "sum")
        maxed = comm.reduce_floats([float(local[k]) for k in keys], "max")
        # Times and maxima: the slowest / largest rank; everything else: the mean over ranks.
        metrics = {k: (mx if (k.startswith("time/") or k.endswith("_max")) else s / world)
                   for k, s, mx in zip(keys, summed, maxed, strict=True)}
        step_time = sum(metrics[f"time/{k}"] for k in ("generate", "score", "train", "sync"))
        metrics.update(step=step, reward_mean=mean, reward_std=var ** 0.5, generated_tokens=total[3],
                       tokens_per_second=total[3] / metrics["time/generate"] if metrics["time/generate"] > 0 else 0.0,
                       step_time=step_time, skipped=float(skipped),
                       skipped_steps=float(self.guard.skipped_total if self.guard is not None else self.skipped_steps),
                       mean_response_length=total[3] / max(1, exp.batch_size * world))
        return metrics
