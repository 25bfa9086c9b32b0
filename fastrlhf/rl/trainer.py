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
from typing import Any, NamedTuple

from fastrlhf.rl import rollout_setup

__all__ = ["run", "build_rl_step", "build_validator", "critic_as_saved", "preflight"]


def build_rl_step(config, guard, tokenizer=None, text_rewards=(), reward_tokenizer=None, plan=None, toolbox=None,
                  resume: bool = False):
    """Load models, build engines; returns ``(rl_step, stateful objects for checkpoints)``.

    ``tokenizer``: the policy's (for text rewards, stop strings and tool turns); ``text_rewards``: resolved
    ``reward.functions``; ``reward_tokenizer``: a reward model's own; ``plan``: the memory plan that
    sizes vLLM's ``auto`` settings (see :func:`preflight`); ``toolbox``: the run's tools (multi-turn
    episodes, :class:`fastrlhf.rollout.episodes.EpisodeRunner`), or None.
    """
    from fastrlhf import distributed as D
    from fastrlhf.config.precision import apply_matmul_precision, compute_dtype
    from fastrlhf.engine.deepspeed import build_frozen_engine, build_train_engine, deepspeed_config
    from fastrlhf.modeling import load_causal_lm, load_value_model, use_attention
    from fastrlhf.modeling.loading import pad_token_id
    from fastrlhf.rl.rewards import RewardScorer
    from fastrlhf.rl.step import RLStep, forward_micro_batch_size, micro_batch_size
    from fastrlhf.rl.step_metrics import setup_memory

    t, ds = config.trainer, config.deepspeed
    apply_matmul_precision(config)
    micro = micro_batch_size(config, D.world_size())

    # ZeRO-3: load straight into partitions (no full replica per rank), with the engines' own configs.
    actor_ds = deepspeed_config(ds, micro, t.grad_accum, t.max_grad_norm) if ds.zero_stage == 3 else None
    actor = load_causal_lm(config.model, zero3_config=actor_ds)
    attention = config.model.attention
    use_attention(actor, t.packing, t.share_prompts, attention)
    pad_id = pad_token_id(actor.config)
    # A ZeRO-3 partitioned parameter reports numel() 0; ds_numel is its full size.
    num_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in {id(p): p for p in actor.parameters()}.values())
    # Optimizer steps over the run, for trainer.lr_schedule: each step's minibatches times its epochs (the actor's
    # not during the critic's warmup)
    per_step = t.ppo_epochs * (config.rollout_batch_size // t.minibatch_size)
    schedule = dict(lr_schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio, warmup_steps=t.warmup_steps,
                    betas=tuple(t.adam_betas), eps=t.adam_eps)
    actor_engine = build_train_engine(actor, ds, lr=t.lr, weight_decay=t.weight_decay, micro_batch_size=micro,
                                      grad_accum=t.grad_accum, max_grad_norm=t.max_grad_norm, guard=guard,
                                      total_steps=(t.max_steps - t.critic_warmup_steps) * per_step, **schedule)
    stateful = {"actor": actor_engine}
    device = actor_engine.device  # where DeepSpeed put the actor: every batch tensor lives there

    reference = None
    if t.kl_coef != 0.0 and config.model.lora_r == 0:
        ref_ds = deepspeed_config(ds, zero_stage=3, trainable=False) if ds.zero_stage == 3 else None
        ref_model = load_causal_lm(config.model, config.reference.path or config.model.path, trainable=False,
                                   zero3_config=ref_ds, dtype=compute_dtype(config))
        use_attention(ref_model, t.packing, t.share_prompts, attention)
        # ZeRO-3 actor: a ZeRO-3 reference too (a full replica would waste what the actor saves).
        reference = build_frozen_engine(ref_model, ds) if ds.zero_stage == 3 else ref_model.to(device)

    critic = None
    if config.algorithm == "ppo":
        # ZeRO-3: partitioned at load, as the actor (a full replica per rank first would need world x its size)
        critic_model = load_value_model(config.model, config.critic.path, zero3_config=actor_ds)
        use_attention(critic_model.lm, t.packing, t.share_prompts, attention)
        if resume:
            critic_as_saved(critic_model, config.output_dir, config.model.lora_r > 0)
        critic = build_train_engine(critic_model, ds, lr=config.critic.lr, weight_decay=t.weight_decay,
                                    micro_batch_size=micro, grad_accum=t.grad_accum, max_grad_norm=t.max_grad_norm,
                                    guard=guard, total_steps=t.max_steps * per_step, **schedule)
        stateful["critic"] = critic

    reward_model = _reward_model(config, device) if config.reward.model_path else None
    scorer = RewardScorer(config.reward.function, reward_model, config.reward.model_kind, config.reward.label_index,
                          micro_batch=forward_micro_batch_size(config, D.world_size()), text_rewards=text_rewards,
                          tokenizer=tokenizer, reward_tokenizer=reward_tokenizer, packed=t.packing,
                          max_tokens=t.max_tokens_per_microbatch, reward_format=config.reward.format,
                          environment_reward=_environment_reward(toolbox), normalize=config.reward.normalize)

    rollout, shares = rollout_setup.build_rollout(config, actor_engine.module, num_params, device, tokenizer, plan)
    episodes = None
    if toolbox is not None:
        from fastrlhf.rollout.episodes import EpisodeRunner

        episodes = EpisodeRunner(rollout, toolbox, tokenizer, config.rollout.max_turns,
                                 say=(lambda line: print(line, flush=True)) if D.is_main() else None,
                                 chat_template_kwargs=config.data.chat_template_kwargs)
    step = RLStep(config, actor_engine, rollout, scorer, reference=reference, critic=critic, pad_token_id=pad_id,
                  rollout_shares_actor=shares, device=device, guard=guard, episodes=episodes)
    if step.kl_control is not None:
        stateful["kl_control"] = step.kl_control
    if step.reward_moments is not None:
        stateful["reward_moments"] = step.reward_moments
    step.setup_memory = setup_memory(device)
    return step, stateful


def critic_as_saved(critic_model, output_dir: str, lora: bool) -> bool:
    """The untied lm_head of ``critic_model`` trained again where the checkpoint a run resumes from trained it (one
    saved before the head was frozen, :func:`fastrlhf.modeling.loading.load_value_model`): its optimizer state
    holds the head's, which an engine without it cannot load. The head gets no gradient either way (the values
    read the decoder's hidden states); trained, it only holds its optimizer state again, as when it was saved.
    Collective (every rank builds the same engine); returns whether the head trains."""
    from fastrlhf import distributed as D
    from fastrlhf.distributed import comm
    from fastrlhf.engine.checkpoint import latest_checkpoint, trained_when_saved
    from fastrlhf.modeling import base_model

    head = base_model(critic_model.lm).get_output_embeddings()
    head_params = {id(p) for p in head.parameters()} if head is not None else set()
    # Those the run trained before the freeze: a LoRA critic trained the adapter on the head, not its weight.
    frozen = {n: p for n, p in critic_model.named_parameters()
              if id(p) in head_params and not p.requires_grad and (not lora or "lora_" in n)}
    folder = latest_checkpoint(output_dir)
    trained = trained_when_saved(folder, "critic") if folder is not None and frozen else None
    if isinstance(trained, set):
        saved_so = set(frozen) <= trained
    else:  # ZeRO stage 0 counts them: as many more as the head has
        saved_so = trained == sum(p.requires_grad for p in critic_model.parameters()) + len(frozen)
    if not comm.any_rank_true(bool(frozen) and saved_so):
        return False
    for p in frozen.values():
        p.requires_grad_(True)
    if D.is_main():
        print(f"note: {folder} trained the critic's lm_head (saved before it was frozen): this resumed run trains it "
              "too; start again with --overwrite to leave it frozen", flush=True)
    return True


def _reward_model(config, device):
    """The frozen model of ``reward.model_path``: a ``*ForSequenceClassification`` (``model_kind: classifier``), or
    for ``value_head`` a causal LM with a value head, read per position (a PPO critic's export, or a one-label
    classifier whose score head becomes the value head: the config check refuses any other folder)."""
    import dataclasses

    from fastrlhf.config.precision import compute_dtype
    from fastrlhf.modeling import load_value_model, torch_dtype, use_attention

    r, t = config.reward, config.trainer
    if r.model_kind == "value_head":
        # In the compute dtype and without fused layers, as a classifier reward model loads
        frozen = dataclasses.replace(config.model, dtype=compute_dtype(config), liger_kernels=False, compile=False)
        model = load_value_model(frozen, r.model_path, trainable=False).eval().to(device)
        use_attention(model.lm, t.packing, backend=config.model.attention)
        return model
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        r.model_path, dtype=torch_dtype(compute_dtype(config))).eval().requires_grad_(False).to(device)
    from fastrlhf.rl.forward import pools_its_own

    if not pools_its_own(model):  # an encoder runs its own forward, never packed
        use_attention(model, t.packing, backend=config.model.attention)
    return model


def _environment_reward(toolbox) -> str | None:
    """The class name an environment's ``get_reward()`` is logged under (``reward/<name>``), or None."""
    env = toolbox.environment if toolbox is not None else None
    return env.__name__ if env is not None and callable(getattr(env, "get_reward", None)) else None


def _reward_tokenizer(config, tokenizer):
    """The reward model's tokenizer where its vocabulary is not the policy's (None: it reads the policy's ids)."""
    if config.reward.model_path is None:
        return None
    try:
        from transformers import AutoTokenizer

        reward_tokenizer = AutoTokenizer.from_pretrained(config.reward.model_path)
    except Exception:  # noqa: BLE001 -- a folder without a tokenizer reads the policy's token ids
        return None
    if tokenizer is not None and reward_tokenizer.get_vocab() == tokenizer.get_vocab():
        return None
    if tokenizer is None:
        from fastrlhf.config import ConfigError

        raise ConfigError("reward.model_path", f"{config.reward.model_path} has a tokenizer of its own, but "
                                               f"{config.model.path} has none to decode completions with")
    return reward_tokenizer


def _load_tokenizer(config, needed_for: list[str]):
    """The policy's tokenizer (model.path), or None where the folder has none and nothing needs one."""
    from fastrlhf.config import ConfigError

    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.model.path)
    except Exception as exc:  # noqa: BLE001 -- any failure means "no usable tokenizer"
        if needed_for:
            raise ConfigError("model.path", f"{config.model.path} has no usable tokenizer ({type(exc).__name__}), "
                                            f"which {' and '.join(needed_for)} need") from None
        return None


class Prepared(NamedTuple):
    plan: Any  # fastrlhf.memory.plan.MemoryPlan of this launch, or None (an architecture the plan cannot count)
    examples: list  # the prompts (fastrlhf.data.PromptExample)
    eval_examples: list | None
    text_rewards: list  # resolved reward.functions
    tokenizer: Any  # the policy's, or None
    reward_tokenizer: Any  # a reward model's own, where its vocabulary differs, or None
    toolbox: Any = None  # fastrlhf.rollout.tools.Toolbox of rollout.tools / rollout.environment, or None


def preflight(config) -> Prepared:
    """Everything knowable before a model loads, checked at once (one-line errors, exit 2):
    batch vs ranks, engine vs model, reward functions, the tokenizers, the prompts, the columns
    the reward functions ask for and (``data.strict_columns``) columns some rows lack."""
    from fastrlhf import distributed as D
    from fastrlhf.config import ConfigError, check_world_size
    from fastrlhf.config.precision import gpu_available
    from fastrlhf.data import check_columns, load_prompts, report_uneven_columns
    from fastrlhf.modeling import vocab_size
    from fastrlhf.rl.rewards import required_columns, resolve_reward_function, resolve_text_rewards

    check_world_size(config, D.world_size())
    if (tp := config.rollout.tensor_parallel_size) > 1 and not gpu_available():
        raise ConfigError("rollout.tensor_parallel_size", f"{tp} needs CUDA (vLLM's tensor parallelism); on a CPU "
                                                          "each rank runs its own engine: set 1")
    if config.rollout.engine == "vllm" and (why := rollout_setup.vllm_cannot_run(config)):
        raise ConfigError("rollout.engine", f"vllm cannot run this model: {why}")
    plan = _memory_plan(config, D.world_size())
    try:
        text_rewards = resolve_text_rewards(config.reward.functions)
    except ValueError as exc:
        raise ConfigError("reward.functions", str(exc)) from None
    for key, spec in (("reward.function", config.reward.function), ("eval.reward", config.eval.reward)):
        if spec is not None:
            try:
                resolve_reward_function(spec, key)
            except ValueError as exc:
                raise ConfigError(key, str(exc)) from None
    from fastrlhf.rollout.tools import run_toolbox

    toolbox = run_toolbox(config)
    r = config.reward
    if r.function is None and r.model_path is None and not r.functions and _environment_reward(toolbox) is None:
        raise ConfigError("reward", f"set reward.function, reward.functions or reward.model_path, got neither (and "
                                    f"rollout.environment {config.rollout.environment} has no get_reward())")
    needed_for = (["reward.functions"] if text_rewards else []) + (["rollout.stop"] if config.rollout.stop else []) \
        + (["rollout.tools"] if toolbox is not None else [])
    tokenizer = _load_tokenizer(config, needed_for)

    d, vocab = config.data, vocab_size(config.model.path)

    def load(path):
        return load_prompts(path, d.prompt_field, d.max_prompt_len, vocab_size=vocab, tokenizer_path=config.model.path,
                            chat_template=d.chat_template, overlong=d.overlong,
                            tools=toolbox.schemas if toolbox is not None else None,
                            chat_template_kwargs=d.chat_template_kwargs)

    examples = load(d.prompts)
    eval_examples = load(config.eval.data) if config.eval.data is not None else None
    if eval_examples is not None and len(eval_examples) < D.world_size():
        # Scoring agrees across ranks (a collective): every rank needs at least one prompt to score.
        raise ConfigError("eval.data", f"has {len(eval_examples)} prompts, fewer than the {D.world_size()} ranks")
    required = {r.name: required_columns(r.fn) for r in text_rewards}
    check_columns(examples, required)
    if eval_examples is not None and config.eval.reward is None:
        check_columns(eval_examples, required)
    # Last: a run that fails a check above says only why, not also this.
    for loaded in (examples, eval_examples or []):
        report_uneven_columns(loaded, strict=d.strict_columns)
    return Prepared(plan, examples, eval_examples, text_rewards, tokenizer, _reward_tokenizer(config, tokenizer),
                    toolbox)


def _memory_plan(config, world: int):
    """``fastrlhf plan`` for this launch: on CUDA a run that cannot fit stops here, in a second, with one
    line naming the largest component. On a CPU the budget (MemAvailable) moves with whatever else
    runs, so there it only warns. None where the plan cannot count the model's architecture."""
    from fastrlhf import distributed as D
    from fastrlhf.config import ConfigError
    from fastrlhf.memory.plan import plan_for_launch

    try:
        plan = plan_for_launch(config, world)
    except ConfigError as exc:
        if exc.key == "model.lora_targets":  # no model could load them either: not a gap of the plan's
            raise
        if D.is_main():
            print(f"warning: no memory plan for this run ({exc})", flush=True)
        return None
    if plan.device == "cuda":
        plan.check()
    elif not plan.fits and D.is_main():
        print(f"warning: memory plan: {plan.total / 2**30:.1f} GiB per rank planned, "
              f"{plan.budget / 2**30:.1f} GiB available (see fastrlhf plan)", flush=True)
    return plan


def _max_reward(config) -> float:
    if config.eval.max_reward is not None:
        return config.eval.max_reward
    if config.eval.reward is None and config.reward.functions:
        return sum(max(f.weight, 0.0) for f in config.reward.functions)
    return 1.0


def build_validator(config, eval_examples, rl_step, tokenizer):
    """The :class:`~fastrlhf.rl.validation.Validator` of ``eval``: the run's reward, or ``eval.reward``."""
    from fastrlhf import distributed as D
    from fastrlhf.rl.rewards import RewardScorer, agree_on_reward_failure
    from fastrlhf.rl.validation import Validator
    from fastrlhf.rollout.sampling import rollout_sampling

    e, ro = config.eval, config.rollout
    if e.reward is not None:
        scorer = RewardScorer(e.reward)  # the run's reward-call path: its checks, errors and cross-rank agreement

        def score(prompts, completions, metas):
            rows = [(p, c.token_ids, m) for p, m, samples in zip(prompts, metas, completions, strict=True)
                    for c in samples]
            return agree_on_reward_failure(lambda: scorer(None, *map(list, zip(*rows, strict=True)))).double()
    else:
        score = rl_step.score_rollout
    sampling = rollout_sampling(ro, config.seed, n=e.n, temperature=e.temperature, max_new_tokens=e.max_new_tokens)
    # The HF engine generates a call's sequences at once: no more than a step's per rank, which the plan sizes for.
    step_sequences = -(-config.trainer.prompts_per_step // D.world_size()) * ro.n
    return Validator([x.prompt_ids for x in eval_examples], [x.meta for x in eval_examples], score,
                     rl_step.episodes or rl_step.rollout,
                     sampling, max_reward=_max_reward(config), group_by=e.group_by, rank=D.rank(),
                     world=D.world_size(), output_dir=config.output_dir, tokenizer=tokenizer,
                     max_sequences_per_call=step_sequences if getattr(rl_step.rollout, "kind", None) == "hf" else None)


def rank_prompts(examples: list, indices: list[int], balance: bool, rank: int, world: int) -> list:
    """This rank's prompts of a step's sampled ``indices``: dealt by prompt length
    (``trainer.balance_ranks``; :func:`fastrlhf.data.balanced_shard`), else a contiguous slice."""
    from fastrlhf.data import balanced_shard, shard

    if balance:
        indices = balanced_shard(indices, [len(examples[i].prompt_ids) for i in indices], rank, world)
    else:
        indices = shard(indices, rank, world)
    return [examples[i] for i in indices]


# The text line of each logged step where there is no progress bar (fastrlhf.engine.metrics.step_line).
STEP_LINE_KEYS = (("reward", "reward_mean"), ("kl", "kl"), ("loss", "policy_loss"), ("eval", "eval/reward_mean"),
                  ("tokens/s", "tokens_per_second"), ("s/step", "wall_time"))


def _with_auto_decided(config, plan):
    """``model.gradient_checkpointing`` and ``trainer.max_tokens_per_microbatch`` ``auto`` as the memory plan
    decided them (``fastrlhf.memory.auto``; said once), before any model loads, the same on every rank."""
    from fastrlhf import distributed as D
    from fastrlhf.distributed import comm
    from fastrlhf.memory.auto import agree_over_ranks, resolve_auto_settings

    decided, notes = resolve_auto_settings(config, plan)
    if notes:  # one collective where several ranks run
        decided, note = agree_over_ranks(config, decided, lambda values: comm.reduce_floats(values, "max"))
        notes += [note] if note else []
    if notes and D.is_main():
        print("\n".join(notes), flush=True)
    return decided


def _with_engine_used(config, kind: str):
    """The config with ``rollout.engine`` the engine this run uses (``auto`` resolved), said once on rank 0:
    the saved ``config.yaml`` and the log say which one ran."""
    import dataclasses

    from fastrlhf import distributed as D

    if D.is_main():
        print(f"rollout.engine: {kind}" + (" (auto)" if config.rollout.engine == "auto" else ""), flush=True)
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, engine=kind))


def run(config, resume: bool = False) -> dict:
    """Train for ``trainer.max_steps`` steps; returns the last step's metrics (collective)."""
    from fastrlhf import distributed as D
    from fastrlhf.config import config_to_dict
    from fastrlhf.data import EpochSampler, check_same_data
    from fastrlhf.engine.guards import StepFailed, StepGuard
    from fastrlhf.engine.loop import resume_step, run_steps
    from fastrlhf.engine.metrics import MetricsLogger
    from fastrlhf.supervised import seed_everything

    t = config.trainer
    from fastrlhf.engine.platform import cpu_tools

    cpu = cpu_tools()
    if cpu is not None:
        cpu.hostmem.configure_cpu_heap()  # before anything large is allocated: see fastrlhf.cpu.hostmem
    # Before the process group: a bad config or data line stops every rank at once, none left waiting.
    prepared = preflight(config)
    examples, tokenizer = prepared.examples, prepared.tokenizer
    D.init_distributed(shared_dir=config.output_dir)
    check_same_data()  # every node read the same copy: before any model loads
    config = _with_auto_decided(config, prepared.plan)
    t = config.trainer
    seed_everything(config.seed)
    guard = StepGuard(t.max_skipped_steps)
    rl_step, stateful = build_rl_step(config, guard, tokenizer, prepared.text_rewards, prepared.reward_tokenizer,
                                      prepared.plan, prepared.toolbox, resume=resume)
    config = _with_engine_used(config, rl_step.rollout.kind)
    sampler = EpochSampler(len(examples), seed=config.seed)
    stateful.update(sampler=sampler, guard=guard)

    start_step = resume_step(config.output_dir, stateful, resume, config)
    if start_step or getattr(rl_step.rollout, "sync_at_start", False):
        rl_step.sync()  # restored weights; or a CPU vLLM engine's GEMMs on weights its sleep() can release
    logger = MetricsLogger(config.output_dir, t.max_steps, start_step, bar_keys=("reward_mean", "kl", "policy_loss"),
                           line_keys=STEP_LINE_KEYS, tensorboard=t.tensorboard, wandb=t.wandb,
                           wandb_project=t.wandb_project, wandb_run_name=t.wandb_run_name,
                           run_config=config_to_dict(config), resume=resume)
    validator = build_validator(config, prepared.eval_examples, rl_step, tokenizer) if prepared.eval_examples else None

    def validate(step: int) -> dict:
        t0 = time.perf_counter()
        metrics = validator(step)
        metrics["time/eval"] = time.perf_counter() - t0
        return metrics

    if validator is not None and config.eval.before_train and start_step == 0:
        logger.log(0, validate(0))

    def one_step(step: int) -> dict:
        started = time.perf_counter()
        position = sampler.state_dict()

        def draw():  # this rank's share of the next prompts_per_step prompts (again under trainer.filter_groups)
            batch = rank_prompts(examples, sampler.next_indices(t.prompts_per_step), t.balance_ranks, D.rank(),
                                 D.world_size())
            return [e.prompt_ids for e in batch], [e.meta for e in batch]

        try:
            metrics = rl_step(*draw(), step, more_prompts=draw)
        except StepFailed:
            sampler.load_state_dict(position)  # --resume retries this step's prompts
            raise
        metrics["lr"] = rl_step.actor.engine.get_lr()[0]
        if validator is not None and (step % config.eval.every == 0 or step == t.max_steps):
            try:
                metrics.update(validate(step))
            except StepFailed as exc:
                exc.completed_step = True  # the update happened: this step's weights are the good ones
                raise
            stop_at = config.eval.stop_at
            metrics["stop"] = stop_at is not None and metrics["eval/reward_mean"] >= stop_at
        metrics["wall_time"] = time.perf_counter() - started
        return metrics

    return run_steps(config, one_step, start_step=start_step, stateful=stateful, logger=logger, guard=guard,
                     skip_reason="non-finite reward, loss or gradient", export_engine=stateful["actor"],
                     more_exports={"critic": stateful["critic"]} if config.critic and config.critic.export else None,
                     after_loop=rl_step.rollout.close)
