"""``fastrlhf train``: the PPO / GRPO run loop, from a validated config to a trained HF folder.

Every rank: loads the models, builds DeepSpeed engines (actor, critic) at the configured ZeRO
stage, its own rollout engine, and then, each step, takes its shard of the step's prompts (GRPO
groups stay on the rank that sampled them), runs :class:`fastrlhf.rl.step.RLStep` and logs the
rank-reduced metrics. Checkpoints hold the engines, the prompt sampler's position and the guard;
the sampling seeds and minibatch shuffles derive from (seed, step), so a resumed run continues as
the uninterrupted one would have.
"""

from __future__ import annotations

import time

__all__ = ["run", "build_rl_step"]


def _pad_token_id(model) -> int:
    config = model.config
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _build_rollout(config, actor_module, num_params: int, device):
    """(engine, shares_actor): HF generates with the actor's own module when it holds whole weights.

    Otherwise (ZeRO-3, or vLLM) the engine holds its own plain copy, synced after every step (LoRA
    actors: with the adapter merged, see ``fastrlhf.rl.lora_sync``).
    """
    from fastrlhf.modeling import load_causal_lm
    from fastrlhf.rollout import HFEngine, VLLMEngine, choose_engine_kind

    ro, ds = config.rollout, config.deepspeed
    kind = ro.engine if ro.engine != "auto" else choose_engine_kind(num_params, device)
    max_len = config.data.max_prompt_len + ro.max_new_tokens
    if kind == "hf":
        if ds.zero_stage < 3:
            # Same module, same weights: generation sees every update at once, no sync needed.
            return HFEngine(actor_module, max_model_len=max_len), True
        rollout_model = load_causal_lm(config.model, trainable=False, dtype=ro.dtype).to(device)
        return HFEngine(rollout_model, max_model_len=max_len), False
    from fastrlhf import distributed as D

    engine = VLLMEngine(config.model.path, dtype=ro.dtype, max_model_len=max_len,
                        kv_cache_bytes=ro.kv_cache_bytes, seed=config.seed + D.rank())
    return engine, False


def build_rl_step(config, guard):
    """Load models, build engines; returns ``(rl_step, stateful objects for checkpoints)``."""
    from fastrlhf import distributed as D
    from fastrlhf.config import ConfigError, check_world_size
    from fastrlhf.distributed import build_frozen_engine, build_train_engine, deepspeed_config
    from fastrlhf.modeling import load_causal_lm, load_value_model
    from fastrlhf.precision import apply_matmul_precision, compute_dtype
    from fastrlhf.rl.rewards import RewardScorer, resolve_text_rewards
    from fastrlhf.rl.step import RLStep, micro_batch_size

    t, ds = config.trainer, config.deepspeed
    apply_matmul_precision(config)
    check_world_size(config, D.world_size())
    try:  # an unknown or unimportable function stops the run before any model loads
        text_rewards = resolve_text_rewards(config.reward.functions)
    except ValueError as exc:
        raise ConfigError("reward.functions", str(exc)) from None
    micro = micro_batch_size(config, D.world_size())

    # ZeRO-3: load straight into partitions (no full replica per rank), with the engines' own configs.
    actor_ds = deepspeed_config(ds, micro, t.grad_accum, t.max_grad_norm) if ds.zero_stage == 3 else None
    actor = load_causal_lm(config.model, zero3_config=actor_ds)
    pad_id = _pad_token_id(actor)
    # A ZeRO-3 partitioned parameter reports numel() 0; ds_numel is its full size.
    num_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in {id(p): p for p in actor.parameters()}.values())
    actor_engine = build_train_engine(actor, ds, lr=t.lr, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
                                      micro_batch_size=micro, grad_accum=t.grad_accum, max_grad_norm=t.max_grad_norm,
                                      guard=guard)
    stateful = {"actor": actor_engine}
    device = actor_engine.device  # where DeepSpeed put the actor: every batch tensor lives there

    reference = None
    if t.kl_coef != 0.0 and config.model.lora_r == 0:
        ref_ds = deepspeed_config(ds, zero_stage=3, trainable=False) if ds.zero_stage == 3 else None
        ref_model = load_causal_lm(config.model, config.reference.path or config.model.path, trainable=False,
                                   zero3_config=ref_ds, dtype=compute_dtype(config))
        # ZeRO-3 actor: a ZeRO-3 reference too (a full replica would waste what the actor saves).
        reference = build_frozen_engine(ref_model, ds) if ds.zero_stage == 3 else ref_model.to(device)

    critic = None
    if config.algorithm == "ppo":
        critic_model = load_value_model(config.model, config.critic.path)
        critic = build_train_engine(critic_model, ds, lr=config.critic.lr, weight_decay=t.weight_decay,
                                    warmup_steps=t.warmup_steps, micro_batch_size=micro, grad_accum=t.grad_accum,
                                    max_grad_norm=t.max_grad_norm, guard=guard)
        stateful["critic"] = critic

    reward_model = None
    if config.reward.model_path:
        from transformers import AutoModelForSequenceClassification

        from fastrlhf.modeling import torch_dtype

        reward_model = AutoModelForSequenceClassification.from_pretrained(
            config.reward.model_path, dtype=torch_dtype(compute_dtype(config))).eval().requires_grad_(False).to(device)
    tokenizer = None
    if text_rewards:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    scorer = RewardScorer(config.reward.function, reward_model, config.reward.model_kind, config.reward.label_index,
                          micro_batch=micro, text_rewards=text_rewards, tokenizer=tokenizer)

    rollout, shares = _build_rollout(config, actor_engine.module, num_params, device)
    step = RLStep(config, actor_engine, rollout, scorer, reference=reference, critic=critic, pad_token_id=pad_id,
                  rollout_shares_actor=shares, device=device, guard=guard)
    return step, stateful


def _load_eval_set(config):
    """(validation prompts, their reward function), or None without ``eval.prompts``; read before any
    model loads, so a bad line or an unknown function stops the run at once."""
    if config.eval.prompts is None:
        return None
    from fastrlhf.data import load_prompts
    from fastrlhf.modeling import vocab_size
    from fastrlhf.rl.rewards import resolve_reward_function

    examples = load_prompts(config.eval.prompts, config.data.prompt_field, config.data.max_prompt_len,
                            vocab_size=vocab_size(config.model.path), tokenizer_path=config.model.path)
    return examples, resolve_reward_function(config.eval.reward or config.reward.function)


def run(config, resume: bool = False) -> dict:
    """Train for ``trainer.max_steps`` steps; returns the last step's metrics (collective)."""
    from fastrlhf import distributed as D
    from fastrlhf.config import config_to_dict
    from fastrlhf.data import EpochSampler, load_prompts, shard
    from fastrlhf.guards import StepGuard
    from fastrlhf.loop import resume_step, run_steps
    from fastrlhf.metrics import MetricsLogger
    from fastrlhf.modeling import vocab_size
    from fastrlhf.supervised import seed_everything

    D.init_distributed()
    seed_everything(config.seed)
    t = config.trainer
    examples = load_prompts(config.data.prompts, config.data.prompt_field, config.data.max_prompt_len,
                            vocab_size=vocab_size(config.model.path), tokenizer_path=config.model.path)
    eval_set = _load_eval_set(config)
    guard = StepGuard(t.max_skipped_steps)
    rl_step, stateful = build_rl_step(config, guard)
    sampler = EpochSampler(len(examples), seed=config.seed)
    stateful.update(sampler=sampler, guard=guard)

    start_step = resume_step(config.output_dir, stateful, resume)
    if start_step:
        rl_step.sync()  # the rollout engine must generate with the restored weights
    logger = MetricsLogger(config.output_dir, t.max_steps, start_step, bar_keys=("reward_mean", "kl", "policy_loss"),
                           tensorboard=t.tensorboard, wandb=t.wandb, run_config=config_to_dict(config), resume=resume)

    validator = None
    if eval_set is not None:
        from fastrlhf.rl.validation import Validator

        eval_examples, eval_reward = eval_set
        validator = Validator([e.prompt_ids for e in eval_examples], [e.meta for e in eval_examples], eval_reward,
                              rl_step.rollout, max_new_tokens=config.rollout.max_new_tokens,
                              stop_token_ids=config.rollout.stop_token_ids, group_by=config.eval.group_by,
                              rank=D.rank(), world=D.world_size())

    def one_step(step: int) -> dict:
        started = time.perf_counter()
        local = shard(sampler.next_indices(t.prompts_per_step), D.rank(), D.world_size())
        batch = [examples[i] for i in local]
        metrics = rl_step([e.prompt_ids for e in batch], [e.meta for e in batch], step)
        metrics["lr"] = rl_step.actor.engine.get_lr()[0]
        if validator is not None and (step % config.eval.every == 0 or step == t.max_steps):
            t0 = time.perf_counter()
            metrics.update(validator())
            metrics["time/eval"] = time.perf_counter() - t0
            stop_at = config.eval.stop_at
            metrics["stop"] = stop_at is not None and metrics["eval_reward"] >= stop_at
        metrics["wall_time"] = time.perf_counter() - started
        return metrics

    return run_steps(config, one_step, start_step=start_step, stateful=stateful, logger=logger, guard=guard,
                     skip_reason="non-finite reward, loss or gradient", export_engine=stateful["actor"],
                     after_loop=rl_step.rollout.close)
