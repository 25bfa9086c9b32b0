"""One PPO / GRPO step, top to bottom: generate -> score -> logprobs (+ values) -> advantages ->
update -> weight sync. Each stage is one call into the module that owns it; a GRPO step passes
through these files (PPO adds the critic's calls in the same files):

1. ``fastrlhf/rl/step.py``           this file: the order of the stages (timings and metrics: ``step_metrics.py``)
2. ``fastrlhf/rollout/hf_engine.py``  generate (or ``vllm_engine.py``); ``SamplingConfig`` from ``rollout/sampling.py``
3. ``fastrlhf/rl/experience.py``      completions -> one padded batch (the tensor layout)
4. ``fastrlhf/rl/rewards.py``         scores: reward functions and/or a reward model
5. ``fastrlhf/rl/forward.py``         model passes: old/ref logprobs, values, the actor's and critic's losses
6. ``fastrlhf/algorithms/``          every formula: ``advantages.py`` (estimators), ``losses.py`` (TIS, policy, KL)
7. ``fastrlhf/rl/update.py``          epochs x minibatches x micro-batches, the learners, the NaN guard's checks
8. ``fastrlhf/rollout/weight_sync.py`` push the updated weights into a separate engine

Below them sit the fused kernels (``fastrlhf.kernels``, whose reference math is ``fastrlhf.algorithms``),
the guard (``fastrlhf/engine/guards.py``) and the collectives (``fastrlhf/distributed/comm.py``).

:class:`RLStep` holds the models; it knows nothing about files or launchers (``rl/trainer.py``
builds it from a config). Models come as DeepSpeed engines or as plain modules with torch
optimizers, so a single process without DeepSpeed runs exactly the same step.

Metrics (reduced over ranks: means, per-token ones over every rank's tokens, except times and ``*_max``: the
slowest / largest rank, and token counts: summed): reward_mean/std (over finite rewards; NaN where there is none),
reward_nonfinite (NaN/inf rewards: the step is skipped), reward/<name> (each text reward), truncated_fraction
(completions cut at max_new_tokens), kl (rollout KL of the old policy to the reference), kl_coef (the coefficient
the step used, with ``trainer.kl_target``), critic_warmup (1 on a step that trained the critic alone), entropy,
rollout_entropy, policy_loss, value_loss, clipfrac, approx_kl, logprob_mismatch_mean/max (|actor
recomputed - engine|), tis_weight_mean and tis_outside_fraction (completion tokens whose importance ratio
lay beyond ``tis_cap`` / ``tis_floor``), entropy_kept_fraction and entropy_threshold (``top_entropy_quantile``:
the share of the trained tokens whose policy term trained, and its entropy bound: ``rl/entropy_mask.py``),
off_policy_masked_fraction (``off_policy_mask_threshold``: the response tokens whose policy term it dropped),
advantage_mean, grad_norm, generated_tokens (with
``trainer.filter_groups``: of every sampling round, as are ``sampling/*``: see ``rl/dynamic_sampling.py``),
tokens_per_second, time/generate, time/score, time/reward, time/train, time/sync, step_time,
sync_bytes, skipped (this step) and skipped_steps (total), rank_tokens and rank_tokens_max (real
prompt + completion tokens of a rank's batch, mean and largest: every collective waits for the largest;
``trainer.balance_ranks`` deals the prompts so that they stay close). Memory, the largest rank's
(``fastrlhf plan`` predicts them): on CUDA memory/<stage>_gib (the most torch allocated during
generate, score, train, sync), memory/<stage>_reserved_gib and memory/peak_reserved_gib (the caching
allocator's, per stage and the largest), memory/<stage>_alloc_retries and memory/<stage>_cuda_mallocs (how often
the allocator failed an allocation, synchronized the device, freed its cache and retried; its cudaMalloc calls),
on the first step memory/setup_peak_allocated_gib,
memory/setup_peak_reserved_gib and memory/setup_cached_gib (the models' and engines' set-up, whose cache is
emptied before the first step) and
memory/context_gib (what the device holds beyond it: CUDA context, NCCL, other libraries); on a CPU
memory/peak_rss_gib.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from fastrlhf import distributed as D
from fastrlhf.algorithms import (
    ADV_ESTIMATORS,
    AdaptiveKLController,
    adv_estimator_of,
    kl_in_reward,
    kl_penalty,
    masked_mean,
    overlong_penalty,
    rollout_is_weights,
)
from fastrlhf.config.rollout_checks import reshaping_settings
from fastrlhf.engine.device import to_device
from fastrlhf.engine.guards import StepGuard
from fastrlhf.rl.entropy_mask import keep_high_entropy_tokens
from fastrlhf.rl.experience import Experience, build_experience
from fastrlhf.rl.forward import (
    critic_loss,
    packing_mode,
    policy_loss_from_model,
    sequence_logprobs,
    token_values,
    unwrap,
)
from fastrlhf.rl.reward_norm import RunningMoments
from fastrlhf.rl.step_metrics import StepClock, logprob_mismatch, probe_rows, reduce_step_metrics
from fastrlhf.rl.update import Minibatch, as_learner, minibatch_order, on_policy_update, run_updates
from fastrlhf.rollout.episodes import PREFIX_CACHE_HIT, with_prefix_cache_hit

__all__ = ["RLStep", "empty_device_cache", "forward_micro_batch_size", "micro_batch_size", "on_policy_update",
           "skips_old_logprobs"]


def micro_batch_size(config, world: int) -> int:
    """Sequences per rank per micro-batch: ``trainer.minibatch_size`` counts all ranks' sequences
    (``config.check_world_size`` has checked that it splits over ranks x grad_accum)."""
    return config.trainer.minibatch_size // world // config.trainer.grad_accum


def forward_micro_batch_size(config, world: int) -> int:
    """Sequences per rank per no-grad forward: old and reference logprobs, values, the reward model's scores."""
    return config.trainer.forward_micro_batch or micro_batch_size(config, world)


def skips_old_logprobs(config) -> bool:
    """Whether the step trains on-policy without recomputing the old logprobs first.

    With one optimizer step per rollout batch (one epoch, one minibatch) the parameters the update
    starts from ARE the old policy, so old = the update's own logprobs, detached (ratio 1, as TRL
    and verl do): a whole forward pass saved. Not with TIS (its weights compare the trainer's old
    logprobs with the engine's) nor with PPO's KL-shaped rewards (they need the old logprobs first), nor with
    ``top_entropy_quantile`` (its threshold over the whole batch needs the pass's entropies before the update).
    """
    t = config.trainer
    single_update = t.ppo_epochs == 1 and t.minibatch_size == config.rollout_batch_size
    return (t.old_logprobs == "auto" and single_update and t.tis_cap is None and not kl_in_reward(config)
            and t.top_entropy_quantile == 1.0)


class RLStep:
    """Call with this rank's prompts (and their meta records) to run one step on every rank.

    ``actor``/``critic``: DeepSpeed engines, or modules with ``actor_optimizer``/``critic_optimizer``;
    ``rollout``: a ``RolloutEngine`` (``rollout_shares_actor``: it generates with the actor's own
    module, so no sync); ``reference``: frozen model, or None for a LoRA actor (adapter disabled) or
    without KL; ``scorer``: ``fastrlhf.rl.rewards.RewardScorer`` or a callable with its signature;
    ``episodes``: a :class:`fastrlhf.rollout.episodes.EpisodeRunner` on ``rollout`` for multi-turn tool use
    (None: one assistant turn per sample).
    """

    def __init__(self, config, actor, rollout, scorer, reference=None, critic=None, actor_optimizer=None,
                 critic_optimizer=None, pad_token_id: int = 0, rollout_shares_actor: bool = False,
                 device: str | torch.device = "cpu", guard: StepGuard | None = None, episodes=None):
        t = config.trainer
        self.config, self.world = config, D.world_size()
        self.guard = guard if guard is not None else StepGuard(t.max_skipped_steps)
        self.actor = as_learner(actor, actor_optimizer, t.max_grad_norm, self.guard)
        self.critic = None
        if config.algorithm == "ppo":
            if critic is None:
                raise ValueError("PPO needs a critic (critic.path, or the actor's path for a fresh value head)")
            self.critic = as_learner(critic, critic_optimizer, t.max_grad_norm, self.guard)
        self.rollout, self.scorer, self.reference, self.episodes = rollout, scorer, reference, episodes
        self._reference_pages = None  # found at the first reference pass (fastrlhf.cpu.file_pages)
        self.pad_token_id, self.rollout_shares_actor = int(pad_token_id), rollout_shares_actor
        self.device = torch.device(device)
        # The set-up's allocator figures (step_metrics.setup_memory), logged with the first step's metrics.
        self.setup_memory: dict[str, float] = {}
        if t.kl_coef != 0.0 and reference is None and not hasattr(unwrap(self.actor.module), "disable_adapter"):
            raise ValueError("kl_coef != 0 needs a reference model (reference.path) or a LoRA actor")
        # trainer.kl_target: the coefficient each step uses is the controller's (restored with it on --resume)
        self.kl_control = (AdaptiveKLController(t.kl_coef, t.kl_target, t.kl_horizon) if t.kl_target is not None
                           else None)
        # reward.normalize true: the running moments of every training score (restored with them on --resume);
        # stored is the reward model's own mean and std, applied by the scorer
        self.reward_moments = RunningMoments(self.device) if config.reward.normalize is True else None

    def __call__(self, prompts: list[list[int]], metas: list[dict] | None, step: int,
                 completions=None, more_prompts=None) -> dict[str, float]:
        """One step on this rank's prompts; ``completions`` (per prompt, n each) skips generation.
        ``more_prompts()``: this rank's next prompts and metas, drawn where ``trainer.filter_groups`` samples again.
        Returns the step's metrics reduced over ranks (a collective: call it on every rank)."""
        metas = metas if metas is not None else [{} for _ in prompts]
        if self.kl_control is not None:
            trainer = dataclasses.replace(self.config.trainer, kl_coef=self.kl_control.value)
            self.config = dataclasses.replace(self.config, trainer=trainer)
        clock = StepClock(self.device, uncounted=getattr(self.rollout, "asleep_bytes", lambda: 0))
        sampled = None
        if completions is None and self.config.trainer.filter_groups and more_prompts is not None:
            sampled = self.sample_differing_groups(prompts, metas, step, more_prompts, clock)
            prompts, metas, completions = sampled.prompts, sampled.metas, sampled.completions
        elif completions is None:
            with clock("generate"):
                completions = self.generate(prompts, metas, step)
        with clock("generate"):
            if not self.rollout_shares_actor:  # its device memory is the update's until the sync
                self.rollout.sleep()
                if self.rollout.sleep_frees_device:
                    empty_device_cache(self.device)
        with clock("score"):
            with clock("reward"):
                exp = build_experience(prompts, completions, self.pad_token_id, self.device)
                exp.scores = self.score(exp, prompts, completions, metas) if sampled is None else sampled.scores
            truncated = [c.finish_reason == "length" for samples in completions for c in samples]
            if self.config.trainer.mask_truncated_completions:  # DAPO's overlong filtering
                exp.loss_rows = to_device(torch.tensor([0.0 if cut else 1.0 for cut in truncated]), self.device)
            rank_tokens = float(sum(p + c for p, c in exp.token_parts()))  # what this rank's passes cost
            prep = {**getattr(self.scorer, "metrics", {}), **self.logprobs_and_values(exp),
                    # the ratio is taken from the counts summed over the ranks (below)
                    **({k: v for k, v in self.episodes.metrics.items() if k != PREFIX_CACHE_HIT}
                       if self.episodes is not None else {}),
                    "truncated_fraction": sum(truncated) / max(len(truncated), 1),
                    "rank_tokens": rank_tokens, "rank_tokens_max": rank_tokens}
            name = adv_estimator_of(self.config)
            exp.advantages, exp.returns = ADV_ESTIMATORS[name](exp, self.config.trainer)
            if self.critic is not None and exp.returns is None:
                raise _no_returns_error(name)
            prep["advantage_mean"] = masked_mean(exp.advantages, exp.response_mask)
            if exp.entropy is not None:  # trainer.top_entropy_quantile (rl/entropy_mask.py)
                prep.update(keep_high_entropy_tokens(exp, self.config.trainer.top_entropy_quantile))
            # Decided by all ranks together, before any parameter moves: the score stage's one host read (with
            # top_entropy_quantile on several ranks the second: its gather's size, once every pass is queued).
            inputs_ok = self.check_scored(exp, prep)
        with clock("train"):
            train = self.update(exp, step) if inputs_ok else {}
        skipped = self.guard.end_step()
        with clock("sync"):
            # A skipped update changed no weight, but an engine whose sleep dropped them needs them back.
            actor_moved = inputs_ok and not self.warming_critic(step) and train.get("optimizer_steps", 0) > 0
            needed = actor_moved or getattr(self.rollout, "needs_sync", False)
            sync = self.sync(clock) if needed else {"sync_bytes": 0.0}
        local = {**prep, **train, **sync, **clock.memory(), **(sampled.metrics if sampled else {}),
                 **self.setup_memory}
        self.setup_memory = {}
        generated = sampled.generated_tokens if sampled else None
        metrics = with_prefix_cache_hit(reduce_step_metrics(exp, local, clock.times, step, skipped=skipped,
                                                            world=self.world, skipped_total=self.guard.skipped_total,
                                                            generated=generated))
        if self.kl_control is not None:  # every rank feeds it the same reduced kl
            metrics["kl_coef"] = self.kl_control.value
            self.kl_control.update(None if skipped else metrics.get("kl"), self.config.rollout_batch_size)
        return metrics

    def warming_critic(self, step: int) -> bool:
        """``trainer.critic_warmup_steps``: whether this step (counted from 1) trains the critic alone."""
        warmup = self.config.trainer.critic_warmup_steps
        return self.critic is not None and warmup > 0 and step <= warmup

    # ------------------------------------------------------------------ stages
    def generate(self, prompts, metas, step: int, round_: int = 0):
        """Completions (``rollout.n`` per prompt) from the rollout engine, or whole episodes with tools."""
        if self.episodes is not None:
            return self.episodes.generate(prompts, self.sampling(step, round_), metas)
        return self.rollout.generate(prompts, self.sampling(step, round_))

    def sample_differing_groups(self, prompts, metas, step: int, more_prompts, clock):
        """``trainer.filter_groups``: rounds of generation and scoring until this rank has its share of groups whose
        scores differ (:mod:`fastrlhf.rl.dynamic_sampling`). The engine stays awake between rounds, so a reward
        model scores beside it."""
        from fastrlhf.rl.dynamic_sampling import kept_reward_means, sample_groups

        parts = []  # each round's named rewards per row (text rewards, an environment's), for reward/<name>

        def generate_and_score(prompts, metas, round_):
            with clock("generate"):
                completions = self.generate(prompts, metas, step, round_)
            with clock("score"), clock("reward"):
                exp = build_experience(prompts, completions, self.pad_token_id, self.device)
                scores = self.score(exp, prompts, completions, metas)
                parts.append(getattr(self.scorer, "parts", {}))
                return completions, scores, sum(exp.policy_token_counts())

        t = self.config.trainer
        sampled = sample_groups(generate_and_score, prompts, metas, more_prompts, self.config.rollout.n,
                                t.max_sampling_rounds)
        sampled.metrics.update(kept_reward_means(parts, sampled.rows))
        return sampled

    def sampling(self, step: int, round_: int = 0):
        from fastrlhf.rollout.sampling import rollout_sampling

        ro = self.config.rollout
        # A seed per (step, engine, sampling round): different samples on each rank's engine, the same ones after a
        # resume. The ranks of a tensor-parallel group drive one engine and must agree on it.
        tp = 1 if self.rollout_shares_actor else ro.tensor_parallel_size
        seed = (self.config.seed * 1_000_003 + step * self.world + D.rank() // tp + round_ * 7_919_617) % (2**31)
        return rollout_sampling(ro, seed)

    def score(self, exp: Experience, prompts, completions, metas, training: bool = True) -> torch.Tensor:
        """[B] fp32 scores, one row per (prompt, sample) in the batch's prompt-major order.

        ``reward.normalize`` normalises them by the running moments (:mod:`fastrlhf.rl.reward_norm`), then
        ``reward.clip_range`` clamps them (OpenRLHF's ``--reward.clip_range``) and
        ``reward.overlong_buffer`` subtracts DAPO's overlong penalty, all training signals (not with
        ``training=False``, as validation scores); then ``reward.truncated_reward`` replaces the score of a completion
        cut at the cap. A
        reward function that fails on one rank fails the step on every rank, with that rank's message
        (:func:`fastrlhf.rl.rewards.agree_on_reward_failure`), so no rank is left waiting in the next
        collective.
        """
        from fastrlhf.rl.rewards import agree_on_reward_failure

        rows = [(p if c.prompt_ids is None else c.prompt_ids, c.token_ids, m)
                for p, m, samples in zip(prompts, metas, completions, strict=True) for c in samples]
        flat = [c for samples in completions for c in samples]
        # Episodes: rewards read the whole conversation, and an environment may score its own episode.
        episodes = {"conversations": [c.extra.get("messages") for c in flat],
                    "environments": [c.extra.get("environment") for c in flat]} if self.episodes is not None else {}
        scores = agree_on_reward_failure(lambda: self.scorer(exp, *map(list, zip(*rows, strict=True)),
                                                             **episodes).float())
        # A scorer of its own may score on the host (as rule rewards do): every later use mixes them with the batch's.
        scores = to_device(scores, exp.input_ids.device)
        r = self.config.reward
        if training and self.reward_moments is not None:  # each scored batch once, every sampling round's
            scores = self.reward_moments.normalize(scores)
        if training and r.clip_range is not None:  # a NaN stays NaN, for the step's guard
            scores = scores.clamp(*r.clip_range)
        if training and r.overlong_buffer is not None:
            lengths = to_device(torch.tensor([len(c.token_ids) for c in flat]), scores.device)
            scores = scores + overlong_penalty(lengths, self.config.rollout.max_new_tokens, r.overlong_buffer,
                                               r.overlong_penalty)
        truncated_reward = r.truncated_reward
        if truncated_reward is not None:
            cut = to_device(torch.tensor([c.finish_reason == "length" for c in flat]), scores.device)
            scores = torch.where(cut, torch.full_like(scores, truncated_reward), scores)
        return scores

    def score_rollout(self, prompts, completions, metas) -> torch.Tensor:
        """[B] scores of completions generated outside a step (validation), as a step scores them, without the
        overlong penalty and clip: validation measures the task, not the reward shaping."""
        exp = build_experience(prompts, completions, self.pad_token_id, self.device)
        return self.score(exp, prompts, completions, metas, training=False)

    def logprobs_and_values(self, exp: Experience) -> dict[str, torch.Tensor]:
        """Old logprobs (recomputed by the actor), reference logprobs, TIS weights and values.

        On-policy (:func:`skips_old_logprobs`) the old logprobs stay None: the update takes its own,
        detached, and the rollout ``kl`` / ``rollout_entropy`` come from the update instead (same
        parameters, same tokens: the same values). ``logprob_mismatch_*`` (actor vs engine) is logged
        every step: over the batch when the old logprobs are recomputed, else over a probe of the
        ``rollout.mismatch_probe`` shortest sequences; :meth:`check_engine_weights` stops a stale engine.
        The metrics are 0-dim device tensors: reading them here would wait for each pass before queuing the next.
        """
        t, mask = self.config.trainer, exp.response_mask
        # No dropout (LoRA's, a config's) in these passes, as the engine sampled without it: a random mask here made
        # the old logprobs, the mismatch check, the TIS weights and the values noise. The update sets train() again.
        for model in (self.actor, self.critic):
            if model is not None:
                unwrap(model.module).eval()
        micro = forward_micro_batch_size(self.config, self.world)
        lp_kwargs = dict(temperature=self.config.rollout.temperature, micro_batch=micro,
                         chunk_size=t.loss_chunk_size, fused=t.fused_loss, chunk_bytes=t.loss_chunk_bytes,
                         packed=packing_mode(t), fp32_logits=self.config.model.fp32_logits)
        groups = self.forward_groups(exp, micro)
        metrics = {}
        if not skips_old_logprobs(self.config):
            exp.old_logprobs, old_entropy = sequence_logprobs(self.actor.module, exp, groups=groups, **lp_kwargs)
            metrics.update(logprob_mismatch(exp.old_logprobs, exp.engine_logprobs, mask),
                           rollout_entropy=masked_mean(old_entropy, mask))
            exp.entropy = old_entropy if t.top_entropy_quantile < 1.0 else None
        else:
            probe = exp.select(probe_rows(exp.token_parts(), self.config.rollout.mismatch_probe))
            actor_logprobs, _ = sequence_logprobs(self.actor.module, probe, groups=self.forward_groups(probe, micro),
                                                  **lp_kwargs)
            metrics.update(logprob_mismatch(actor_logprobs, probe.engine_logprobs, probe.response_mask))
        if t.kl_coef != 0.0:
            reference, context = self.reference, contextlib.nullcontext()
            if reference is None:  # a LoRA actor with its adapter disabled is the reference
                reference, context = self.actor.module, unwrap(self.actor.module).disable_adapter()
            with context:
                exp.ref_logprobs, _ = sequence_logprobs(reference, exp, groups=groups, **lp_kwargs)
            self.release_reference_pages()
            if exp.old_logprobs is not None:
                metrics["kl"] = masked_mean(kl_penalty(exp.old_logprobs, exp.ref_logprobs, t.kl_kind, mask), mask)
        if t.tis_cap is not None:
            exp.is_weights, outside = rollout_is_weights(exp.old_logprobs, exp.engine_logprobs, mask, t.tis_cap,
                                                         level=t.tis_level, mode=t.tis_mode, floor=t.tis_floor)
            metrics["tis_weight_mean"] = masked_mean(exp.is_weights, mask)
            metrics["tis_outside_fraction"] = masked_mean(outside.to(mask.dtype), mask)
        if self.critic is not None:
            exp.values = token_values(self.critic.module, exp, micro, groups=groups, packed=packing_mode(t))
        return metrics

    def release_reference_pages(self) -> int:
        """On a CPU, the frozen reference's weights (pages of its checkpoint file) leave this rank's
        resident memory until its next pass: see :mod:`fastrlhf.cpu.file_pages`. Returns the bytes."""
        if self.reference is None or not isinstance(self.reference, torch.nn.Module):
            return 0
        if self._reference_pages is None:
            from fastrlhf.engine.platform import cpu_tools

            cpu = cpu_tools(self.device)
            self._reference_pages = cpu.file_pages.FilePages(self.reference) if cpu is not None else False
        return self._reference_pages.release() if self._reference_pages else 0

    def forward_groups(self, exp: Experience, micro: int) -> list[list[int]] | None:
        """The micro-batches (row indices) of the no-grad passes over ``exp``: by
        ``trainer.max_tokens_per_microbatch`` when set, as many on every rank (under ZeRO each forward
        is a collective); else None, ``micro`` rows at a time."""
        from fastrlhf.sequences.packing import micro_batch_plan

        t = self.config.trainer
        if t.max_tokens_per_microbatch is None:
            return None
        return micro_batch_plan([exp.token_parts()], micro, t.max_tokens_per_microbatch, t.packing,
                                keys_of=[exp.prompt_keys()] if packing_mode(t) == "shared" else None)[0]

    def update_plan(self, exp: Experience, step: int) -> list[Minibatch]:
        """The optimizer steps of the update: shuffled minibatches of ``trainer.minibatch_size / world``
        rows each epoch, each in micro-batches of ``minibatch_size / world / grad_accum`` rows, or by the
        token budget (``trainer.max_tokens_per_microbatch``; then as many on every rank). The minibatches
        are the same either way: only their split into micro-batches differs."""
        from fastrlhf.sequences.packing import micro_batch_plan

        t = self.config.trainer
        generator = torch.Generator().manual_seed(self.config.seed * 7919 + step)
        order = minibatch_order(exp.batch_size, t.minibatch_size // self.world, t.ppo_epochs, generator)
        token_parts, keys = exp.token_parts(), exp.prompt_keys()
        parts = [[token_parts[r] for r in rows.tolist()] for rows in order]
        keys_of = [[keys[r] for r in rows.tolist()] for rows in order] if packing_mode(t) == "shared" else None
        groups = micro_batch_plan(parts, micro_batch_size(self.config, self.world), t.max_tokens_per_microbatch,
                                  t.packing, keys_of=keys_of)
        return [Minibatch(rows, g) for rows, g in zip(order, groups, strict=True)]

    def check_scored(self, exp: Experience, metrics: dict) -> bool:
        """Whether the update runs: everything it consumes is finite on every rank (else the step is skipped,
        :class:`StepGuard`), and the engine generated with the actor's weights (else :class:`StepFailed`). The
        score stage's one collective and host read: the metrics stay on the device until the step's end, so the
        passes before it (old and reference logprobs, values, the reward model's) queue without a wait."""
        ro = self.config.rollout
        # Truncation and the repetition penalty reshape what the engine reports: a mismatch there is expected.
        watched = ro.max_logprob_mismatch is not None and not reshaping_settings(ro)
        consumed = [t for t in (exp.scores, exp.advantages, exp.old_logprobs, exp.ref_logprobs, exp.values,
                                exp.returns, exp.is_weights) if t is not None]
        ok = self.guard.inputs_ok(*consumed, largest={"mismatch": metrics["logprob_mismatch_mean"]} if watched
                                  else None)
        if watched and ok:  # a non-finite input skips the step (counted) before any mismatch is judged
            self.check_engine_weights(self.guard.largest["mismatch"])
        return ok

    def check_engine_weights(self, worst: float) -> None:
        """Stop (on every rank) before training on completions of an engine whose weights are not the
        actor's: a sync or sleep/wake that left it stale. ``worst``: the largest mismatch of any rank."""
        ro = self.config.rollout
        if not worst <= ro.max_logprob_mismatch:  # NaN too: an engine whose logprobs are NaN is broken
            from fastrlhf.engine.guards import AgreedStepFailure

            # Agreed: every rank read the same worst, so the command line says it once (not a traceback per rank).
            raise AgreedStepFailure(f"the rollout engine's logprobs differ from the actor's by {worst:.3g} nats per "
                                    f"token (rollout.max_logprob_mismatch {ro.max_logprob_mismatch}): it is generating "
                                    "with other weights than the actor's (a failed weight sync or wake-up?)")

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        """The actor's (then the critic's) optimizer steps over shuffled minibatches of the batch."""
        t = self.config.trainer
        order = self.update_plan(exp, step)
        if self.warming_critic(step):
            metrics, aborted = {"critic_warmup": 1.0}, False
        else:
            metrics, aborted = self.update_actor(exp, order)
        if self.critic is not None and not aborted:
            unwrap(self.critic.module).train()
            critic = run_updates(self.critic, exp, lambda module, mb: critic_loss(module, mb, self.config), order,
                                 t.agg, self.config.rollout.max_new_tokens)
            metrics.update(value_loss=critic.get("value_loss", float("nan")),
                           vf_clipfrac=critic.get("vf_clipfrac", float("nan")), critic_grad_norm=critic["grad_norm"])
        return metrics

    def update_actor(self, exp: Experience, order: list[Minibatch]) -> tuple[dict[str, float], bool]:
        """The actor's optimizer steps: its metrics, and whether a non-finite loss stopped them."""
        unwrap(self.actor.module).train()
        actor = run_updates(self.actor, on_policy_update(exp, order),
                            lambda module, mb: policy_loss_from_model(module, mb, self.config),
                            order, self.config.trainer.agg, self.config.rollout.max_new_tokens)
        metrics = {"policy_loss": actor.get("loss", float("nan")), "loss_kl": actor.get("kl", float("nan")),
                   **{k: actor.get(k, float("nan")) for k in ("clipfrac", "approx_kl", "entropy")},
                   "grad_norm": actor["grad_norm"], "optimizer_steps": actor["optimizer_steps"],
                   "empty_minibatches": actor["empty_minibatches"]}
        if "off_policy_masked_fraction" in actor:
            metrics["off_policy_masked_fraction"] = actor["off_policy_masked_fraction"]
        if exp.old_logprobs is None and not actor["aborted"]:  # on-policy: the update's logprobs are the rollout's
            metrics["rollout_entropy"] = metrics["entropy"]
            if exp.ref_logprobs is not None:
                metrics["kl"] = metrics["loss_kl"]
        return metrics, actor["aborted"]

    def sync(self, clock: StepClock | None = None) -> dict[str, float]:
        """Push the actor's weights into a rollout engine that holds its own copy (bucketed); ``clock``: the
        step's, whose sync stage counts its peak from the engine's weights woken (:meth:`StepClock.restart_peak`)."""
        if self.rollout_shares_actor:
            return {"sync_bytes": 0.0}
        from fastrlhf.rl.lora_sync import is_peft_model, sync_lora_weights
        from fastrlhf.rollout.weight_sync import sync_weights

        source, bucket = getattr(self.actor, "engine", self.actor.module), self.config.rollout.sync_bucket_bytes
        if self.rollout.sleep_frees_device:  # the update's activations and logits go before the weights come back
            empty_device_cache(self.device)
        self.rollout.wake_up(("weights",))
        if clock is not None:
            clock.restart_peak("sync")
        if is_peft_model(unwrap(self.actor.module)):
            stats = sync_lora_weights(source, self.rollout, bucket)
        else:
            stats = sync_weights(source, self.rollout, bucket_bytes=bucket)
        self.rollout.wake_up(("kv_cache",))
        return {"sync_bytes": float(stats.bytes), "sync_buckets": float(stats.num_buckets)}


def _no_returns_error(estimator: str):
    """The error of an estimator that gave the critic no returns: one registered without ``EstimatorTraits``, which the
    config checks could not refuse. Every rank's estimator returned None alike, so the command line says it once
    (``comm.agreed``), not once per rank."""
    from fastrlhf.config import ConfigError
    from fastrlhf.distributed import comm

    return comm.agreed(ConfigError("trainer.adv_estimator", f"{estimator} returns no returns, which the critic of "
                                   "algorithm ppo is trained on: run it with algorithm grpo (registered with "
                                   "EstimatorTraits(gives_returns=False), it is refused before any model loads)"))


def empty_device_cache(device: torch.device) -> None:
    """Give cached, unused blocks back to the device, so a colocated engine can take them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
