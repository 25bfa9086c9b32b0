"""Cross-field validation of a built config: each rule once, each failure a one-line ConfigError naming the key.

:func:`validate` runs the rules that need only the config (at load time); :func:`check_world_size`
the ones that also need the number of ranks (once the launched world is known).
"""

from __future__ import annotations

import os

from . import model_checks as M
from .algorithm_checks import (
    check_adv_estimator,
    check_advantage_scaling,
    check_filter_groups,
    check_group_size,
    check_kl_in_reward,
    check_kl_target,
    check_policy_loss,
    check_tis,
    check_top_entropy_quantile,
)
from .deepspeed_checks import check_extra
from .errors import ConfigError
from .errors import positive as _positive
from .model_checks import check_model_folder as _check_model_folder  # by this name: fastrlhf plan swaps it
from .precision import refuse_fp16
from .rollout_checks import check_rollout, context_of
from .schema import DeepSpeedConfig, LoopConfig, ModelConfig, RMConfig, SFTConfig, SFTTrainerConfig, TrainConfig

__all__ = ["validate", "check_world_size"]


def _check_path(path: str | None, key: str, base: str):
    if path is None:
        return
    resolved = path if os.path.isabs(path) else os.path.join(base, path)
    if not os.path.exists(resolved):
        raise ConfigError(key, f"path does not exist: {path}")


def _check_reward_spec(spec: str | None, key: str):
    if spec is not None and spec.count(":") > 1:
        raise ConfigError(key, f"expected a registered name or 'module:function', got {spec!r}")


def _check_model(m: ModelConfig, base: str, command: str, key: str = "model") -> dict:
    """The rules of ``model``; returns model.path's config.json (``{}`` where ``fastrlhf plan`` reads none)."""
    hf_config = _check_model_folder(m.path, f"{key}.path", base)
    _positive(m.lora_r, f"{key}.lora_r", strict=False)
    _positive(m.lora_alpha, f"{key}.lora_alpha")  # the adapter's scale is alpha / r: 0 trains nothing
    if m.checkpoint_layers is not None:
        _positive(m.checkpoint_layers, f"{key}.checkpoint_layers")
        if m.gradient_checkpointing is not True:
            raise ConfigError(f"{key}.checkpoint_layers", "needs gradient_checkpointing: true" + (
                " (with auto the memory plan decides it: leave it null)" if m.gradient_checkpointing == "auto" else
                f", got {m.gradient_checkpointing}"))
        layers = hf_config.get("num_hidden_layers", (hf_config.get("text_config") or {}).get("num_hidden_layers"))
        if isinstance(layers, int) and m.checkpoint_layers > layers:
            raise ConfigError(f"{key}.checkpoint_layers", f"must be at most the model's {layers} decoder layers, "
                                                          f"got {m.checkpoint_layers}")
    if m.lora_r > 0 and not m.lora_targets:
        raise ConfigError(f"{key}.lora_targets", "must name at least one module when lora_r > 0")
    if not 0.0 <= m.lora_dropout < 1.0:
        raise ConfigError(f"{key}.lora_dropout", f"must be in [0, 1), got {m.lora_dropout}")
    M.check_lora(m, hf_config, key, command)
    if m.compile and m.liger_kernels:
        raise ConfigError(f"{key}.compile", f"cannot be combined with {key}.liger_kernels (both replace the "
                                            "layers' norm, rotary and SwiGLU kernels): set one of them")
    return hf_config


def _check_template_kwargs(kwargs: dict) -> None:  # the arguments fastrlhf itself passes to apply_chat_template
    if taken := sorted(set(kwargs) & {"conversation", "tools", "tokenize", "add_generation_prompt", "return_dict"}):
        raise ConfigError("data.chat_template_kwargs", f"{taken[0]!r} is set by fastrlhf; give the template's own "
                                                       "variables only (e.g. enable_thinking: false)")


def _check_seed(seed: int) -> None:
    if not 0 <= seed <= 2**32 - 1:  # numpy's and the engines' seeds are unsigned 32-bit
        raise ConfigError("seed", f"must be in [0, {2**32 - 1}], got {seed}")


def _check_lora_head(model: ModelConfig, trainer) -> None:
    if model.lora_r > 0 and "lm_head" in model.lora_targets and trainer.fused_loss:
        raise ConfigError("model.lora_targets", "lm_head: the fused kernels read the head's weight, not an "
                                                "adapter's; leave it out or set trainer.fused_loss: false")


def _check_fp32_logits(model: ModelConfig, trainer) -> None:
    if model.fp32_logits and not trainer.fused_loss:
        raise ConfigError("model.fp32_logits", "needs trainer.fused_loss: true (the fused kernels make the fp32 "
                                               "logits; the debugging path takes the model's own)")


def _check_deepspeed(ds: DeepSpeedConfig, model: ModelConfig):
    if ds.zero_stage not in (0, 1, 2, 3):
        raise ConfigError("deepspeed.zero_stage", f"must be 0, 1, 2 or 3, got {ds.zero_stage}")
    if model.compile and ds.zero_stage == 3:
        raise ConfigError("model.compile", "needs deepspeed.zero_stage 0, 1 or 2 (ZeRO-3 gathers each layer's "
                                           "parameters in hooks the compiled layer would trace), got 3")
    if ds.zero_stage == 3 and model.lora_r > 0 and "embed_tokens" in model.lora_targets:
        # peft keeps an embedding's factors where no forward hook sees them: ZeRO-3 never gathers them
        raise ConfigError("model.lora_targets", "embed_tokens cannot be adapted under deepspeed.zero_stage 3 (its "
                                                "LoRA factors are never gathered); leave it out or use ZeRO 0-2")
    if ds.offload_param and ds.zero_stage != 3:
        raise ConfigError("deepspeed.offload_param", f"needs deepspeed.zero_stage 3, got {ds.zero_stage}")
    if ds.offload_optimizer and ds.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer", "needs deepspeed.zero_stage 1, 2 or 3, got 0")
    refuse_fp16(ds.extra)
    check_extra(ds)
    if model.dtype == "float16":
        raise ConfigError("model.dtype", "float16 training needs loss scaling, which fastrlhf does not set up; use "
                                         "bfloat16 (with deepspeed.bf16 for fp32 master weights) or auto")
    if ds.pure_bf16 and ds.bf16 is True:
        raise ConfigError("deepspeed.pure_bf16", "conflicts with deepspeed.bf16: true (fp32 master weights)")
    if model.dtype == "bfloat16" and ds.bf16 is False and not ds.pure_bf16:
        raise ConfigError("deepspeed.bf16", "false with model.dtype bfloat16 trains pure bf16 without fp32 master "
                                            "weights; set deepspeed.bf16: true (or auto), or deepspeed.pure_bf16: true "
                                            "to train that way on purpose")


def _check_loop(t: LoopConfig, prefix: str = "trainer"):
    """The rules on the settings of :class:`LoopConfig`, which every command's ``trainer`` has."""
    _positive(t.max_steps, f"{prefix}.max_steps")
    _positive(t.lr, f"{prefix}.lr")
    _positive(t.grad_accum, f"{prefix}.grad_accum")
    _positive(t.weight_decay, f"{prefix}.weight_decay", strict=False)
    _positive(t.warmup_steps, f"{prefix}.warmup_steps", strict=False)
    if len(t.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in t.adam_betas):
        raise ConfigError(f"{prefix}.adam_betas", f"must be two numbers in [0, 1), got {t.adam_betas}")
    _positive(t.adam_eps, f"{prefix}.adam_eps")
    if not 0.0 <= t.min_lr_ratio <= 1.0:  # NaN too
        raise ConfigError(f"{prefix}.min_lr_ratio", f"must be in [0, 1] (of {prefix}.lr), got {t.min_lr_ratio}")
    _positive(t.max_grad_norm, f"{prefix}.max_grad_norm")
    _positive(t.loss_chunk_size, f"{prefix}.loss_chunk_size")
    _positive(t.loss_chunk_bytes, f"{prefix}.loss_chunk_bytes")
    if t.max_tokens_per_microbatch != "auto":
        _positive(t.max_tokens_per_microbatch, f"{prefix}.max_tokens_per_microbatch")
    if t.max_tokens_per_microbatch is not None and t.grad_accum != 1:
        raise ConfigError(f"{prefix}.grad_accum", f"must be 1 with {prefix}.max_tokens_per_microbatch (the token "
                                                  f"budget decides the micro-batches), got {t.grad_accum}")
    _positive(t.save_every, f"{prefix}.save_every", strict=False)
    _positive(t.keep_checkpoints, f"{prefix}.keep_checkpoints", strict=False)
    _positive(t.max_skipped_steps, f"{prefix}.max_skipped_steps")
    _positive(t.log_every, f"{prefix}.log_every")
    _positive(t.profile_step, f"{prefix}.profile_step")
    if t.profile_step is not None and t.profile_step > t.max_steps:
        raise ConfigError(f"{prefix}.profile_step", f"must be at most {prefix}.max_steps ({t.max_steps}), got "
                                                    f"{t.profile_step}: that step never runs")
    for name in ("wandb_project", "wandb_run_name"):
        if getattr(t, name) is not None and not t.wandb:
            raise ConfigError(f"{prefix}.{name}", f"needs {prefix}.wandb (offline or online), which is off")


def _validate_train(c: TrainConfig, base: str):
    _check_seed(c.seed)
    actor = _check_model(c.model, base, "train")
    _check_fp32_logits(c.model, c.trainer)
    _check_lora_head(c.model, c.trainer)
    if c.reference.path is not None and c.model.lora_r > 0:
        raise ConfigError("reference.path", "is not used with model.lora_r > 0 (the reference is the actor with its "
                                            "adapter disabled); remove it, or train without LoRA")
    if c.reference.path is not None and c.trainer.kl_coef == 0.0:  # the trainer loads no reference then
        raise ConfigError("reference.path", "is not used with trainer.kl_coef 0 (no KL term); remove it, or set "
                                            "kl_coef > 0")
    reference = _check_model_folder(c.reference.path, "reference.path", base)
    M.check_vocab_covers(reference, "reference.path", actor, "the reference scores")
    _check_path(c.data.prompts, "data.prompts", base)
    _positive(c.data.max_prompt_len, "data.max_prompt_len")
    if not c.data.prompt_field:
        raise ConfigError("data.prompt_field", "must be a non-empty field name")
    _check_template_kwargs(c.data.chat_template_kwargs)

    r = c.reward
    if r.function is not None and r.model_path is not None:
        raise ConfigError("reward", "set one of reward.function and reward.model_path, got both")
    if r.function is None and r.model_path is None and not r.functions and c.rollout.environment is None:
        # (an environment's get_reward() may be the only reward: checked once it is imported, in preflight)
        raise ConfigError("reward", "set reward.function, reward.functions or reward.model_path, got neither")
    reward_model = _check_model_folder(r.model_path, "reward.model_path", base)
    _check_reward_spec(r.function, "reward.function")
    for i, spec in enumerate(r.functions):
        _check_reward_spec(spec.function, f"reward.functions[{i}].function")
    _positive(r.label_index, "reward.label_index", strict=False)
    M.check_reward_model(r, reward_model, base)
    if r.normalize == "stored" and r.model_path is None:
        raise ConfigError("reward.normalize", "stored normalises a reward model's scores by its stored mean and std: "
                                              "set reward.model_path, or true for the running moments")
    if r.format != "trl" and not r.functions:
        raise ConfigError("reward.format", f"{r.format} is the form of what reward.functions receive, and none "
                                           "is set (set reward.functions, or leave reward.format at trl)")

    critic = {}
    if c.algorithm == "ppo":
        if c.critic is None:
            raise ConfigError("critic", "algorithm ppo needs a critic section (critic: {path: null} uses model.path "
                                        "with a value head)")
        critic = _check_model_folder(c.critic.path, "critic.path", base)
        M.check_vocab_covers(critic, "critic.path", actor, "the critic reads")
        _positive(c.critic.lr, "critic.lr")
    elif c.critic is not None:
        raise ConfigError("critic", f"algorithm {c.algorithm} has no critic; remove the section (or use algorithm: "
                                    "ppo)")

    ro = c.rollout
    _positive(ro.n, "rollout.n")
    if c.algorithm == "grpo" and c.trainer.adv_estimator == "auto":
        check_group_size("grpo", ro.n)
    check_rollout(c, actor)
    tokens, tokens_key, tokens_sum = context_of(c)
    for key, folder in (("model.path", actor), ("reference.path", reference), ("critic.path", critic),
                        ("reward.model_path", reward_model)):  # each model reads whole sequences
        M.check_positions(folder, tokens, tokens_key, tokens_sum, key)
        if key != "reward.model_path":  # a score head: no LM logits
            M.check_logit_terms(folder, c.trainer.packing, c.model.attention, key)
    if r.overlong_buffer is not None:
        if not 0 < r.overlong_buffer <= ro.max_new_tokens:
            raise ConfigError("reward.overlong_buffer", f"must be in [1, rollout.max_new_tokens = {ro.max_new_tokens}]"
                                                        f" (or null), got {r.overlong_buffer}")
        if ro.tools or ro.environment:
            raise ConfigError("reward.overlong_buffer", "counts the tokens of one generated turn against "
                                                        "rollout.max_new_tokens; an episode's completion holds several "
                                                        "turns and the tools' replies")
    _positive(r.overlong_penalty, "reward.overlong_penalty", strict=False)
    if r.clip_range is not None and (len(r.clip_range) != 2 or not r.clip_range[0] < r.clip_range[1]):
        raise ConfigError("reward.clip_range", f"must be [low, high] with low < high, got {r.clip_range}")

    t = c.trainer
    _check_loop(t)
    _positive(t.prompts_per_step, "trainer.prompts_per_step")
    _positive(t.minibatch_size, "trainer.minibatch_size")
    _positive(t.ppo_epochs, "trainer.ppo_epochs")
    if t.policy_loss != "vanilla" or t.policy_loss_args:  # the default needs no torch import
        check_policy_loss(t)
    if t.adv_estimator != "auto":  # auto (gae or grpo, by the algorithm) needs no torch import
        check_adv_estimator(c)
    rollout_batch = c.rollout_batch_size
    if rollout_batch % t.minibatch_size:
        raise ConfigError("trainer.minibatch_size", f"{t.minibatch_size} does not divide the rollout batch of "
                          f"{rollout_batch} (trainer.prompts_per_step x rollout.n)")
    if t.minibatch_size % t.grad_accum:
        raise ConfigError("trainer.grad_accum", f"{t.grad_accum} does not divide trainer.minibatch_size "
                          f"{t.minibatch_size}")
    if not 0.0 <= t.clip_low < 1.0:  # the ratio's lower bound, 1 - clip_low, must stay above 0 to clip anything
        raise ConfigError("trainer.clip_low", f"must be in [0, 1), got {t.clip_low}")
    _positive(t.clip_high, "trainer.clip_high", strict=False)
    if t.dual_clip is not None and t.dual_clip <= 1.0:
        raise ConfigError("trainer.dual_clip", f"must be > 1 (or null), got {t.dual_clip}")
    _positive(t.kl_coef, "trainer.kl_coef", strict=False)
    check_kl_target(t, rollout_batch)
    check_kl_in_reward(c)
    _positive(t.critic_warmup_steps, "trainer.critic_warmup_steps", strict=False)
    if t.critic_warmup_steps and c.algorithm != "ppo":
        raise ConfigError("trainer.critic_warmup_steps", f"warms up PPO's critic; algorithm {c.algorithm} has none")
    if t.critic_warmup_steps >= t.max_steps:
        raise ConfigError("trainer.critic_warmup_steps", f"must be below trainer.max_steps ({t.max_steps}), got "
                                                         f"{t.critic_warmup_steps}: the actor would never train")
    _positive(t.entropy_coef, "trainer.entropy_coef", strict=False)
    for name in ("gamma", "lam"):
        value = getattr(t, name)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"trainer.{name}", f"must be in [0, 1], got {value}")
    _positive(t.vf_clip, "trainer.vf_clip")
    _positive(t.vf_coef, "trainer.vf_coef", strict=False)
    check_tis(t)
    check_top_entropy_quantile(t)
    check_advantage_scaling(t)
    if t.share_prompts and not t.packing:
        raise ConfigError("trainer.share_prompts",
                          "needs trainer.packing: true (prompts are shared within a packed row)")
    if t.forward_micro_batch is not None and t.forward_micro_batch <= 0:
        raise ConfigError("trainer.forward_micro_batch", f"must be > 0 (or null), got {t.forward_micro_batch}")
    if t.forward_micro_batch is not None and t.max_tokens_per_microbatch is not None:
        raise ConfigError("trainer.forward_micro_batch", "conflicts with trainer.max_tokens_per_microbatch, which "
                                                         "sizes the no-grad passes too; set one of them")
    _positive(t.max_sampling_rounds, "trainer.max_sampling_rounds")
    if t.filter_groups:
        check_filter_groups(c)
    _validate_eval(c, base)
    _check_deepspeed(c.deepspeed, c.model)
    return {"model.path": actor, "reference.path": reference, "critic.path": critic}


def _validate_eval(c: TrainConfig, base: str):
    e = c.eval
    _positive(e.every, "eval.every")
    _positive(e.n, "eval.n")
    if e.temperature < 0:
        raise ConfigError("eval.temperature", f"must be >= 0 (0 = greedy), got {e.temperature}")
    if e.n > 1 and e.temperature == 0:
        raise ConfigError("eval.n", f"{e.n} greedy completions of a prompt are all the same; set eval.temperature > 0 "
                                    "for pass@n")
    _positive(e.max_new_tokens, "eval.max_new_tokens")
    if e.max_new_tokens is not None and e.max_new_tokens > c.rollout.max_new_tokens:
        # The engine's context, and so every generation's cap, is sized from rollout.max_new_tokens.
        raise ConfigError("eval.max_new_tokens", f"must be at most rollout.max_new_tokens ({c.rollout.max_new_tokens}"
                                                 f", which sizes the engine's context), got {e.max_new_tokens}")
    if e.data is None:
        # Settings that only say how to validate are left alone (a run switches validation off with eval.data: null)
        for name in ("reward", "group_by", "stop_at", "max_reward"):
            if getattr(e, name) is not None:
                raise ConfigError(f"eval.{name}", "needs eval.data (the validation prompts)")
        return
    _check_path(e.data, "eval.data", base)
    _check_reward_spec(e.reward, "eval.reward")


def _no_auto_checkpointing(m: ModelConfig):
    if m.gradient_checkpointing == "auto":
        raise ConfigError("model.gradient_checkpointing", "auto is decided by the memory plan of `fastrlhf train`; "
                                                          "here set true or false")


def _no_auto_micro_tokens(t: LoopConfig):
    if t.max_tokens_per_microbatch == "auto":
        raise ConfigError("trainer.max_tokens_per_microbatch", "auto is decided by the memory plan of `fastrlhf "
                                                               "train`; here set a number of tokens or null")


def _validate_sft(c: SFTConfig, base: str):
    _check_seed(c.seed)
    model = _check_model(c.model, base, "sft")
    _check_lora_head(c.model, c.trainer)
    if c.model.fp32_logits:
        raise ConfigError("model.fp32_logits", "matches the RL trainer's logprobs to its rollout engine's; sft has "
                                               "no engine: set it false")
    _no_auto_checkpointing(c.model)
    _no_auto_micro_tokens(c.trainer)
    _check_path(c.data.path, "data.path", base)
    _check_path(c.data.eval_path, "data.eval_path", base)
    _positive(c.data.max_len, "data.max_len")
    M.check_positions(model, c.data.max_len, "data.max_len", "", "model.path")
    M.check_logit_terms(model, c.trainer.packing, c.model.attention)
    _positive(c.data.max_prompt_len, "data.max_prompt_len")
    if c.data.max_prompt_len is not None and c.data.max_prompt_len >= c.data.max_len:
        raise ConfigError("data.max_prompt_len", f"must be below data.max_len ({c.data.max_len}, prompt and response), "
                                                 f"got {c.data.max_prompt_len}")
    _check_template_kwargs(c.data.chat_template_kwargs)
    _validate_small_trainer(c.trainer)
    _check_deepspeed(c.deepspeed, c.model)
    return {"model.path": model}


def _validate_rm(c: RMConfig, base: str):
    _check_seed(c.seed)
    model = _check_model(c.model, base, "rm")
    if c.model.fp32_logits:
        raise ConfigError("model.fp32_logits", "a reward model has a score head, no LM head: set it false")
    _no_auto_checkpointing(c.model)
    _no_auto_micro_tokens(c.trainer)
    _check_path(c.data.path, "data.path", base)
    _check_path(c.data.eval_path, "data.eval_path", base)
    _positive(c.data.max_len, "data.max_len")
    M.check_positions(model, c.data.max_len, "data.max_len", "", "model.path")
    M.check_logit_terms(model, c.trainer.packing, c.model.attention)
    _check_template_kwargs(c.data.chat_template_kwargs)
    _validate_small_trainer(c.trainer)
    _positive(c.num_labels, "num_labels")
    if c.kind == "pairwise" and c.resolved_num_labels != 1:
        raise ConfigError("num_labels", f"a pairwise reward model has one output, got {c.num_labels}")
    if c.kind == "classifier" and c.resolved_num_labels < 2:
        raise ConfigError("num_labels", f"a classifier needs at least 2 labels, got {c.num_labels}")
    _positive(c.center_rewards_coefficient, "center_rewards_coefficient", strict=False)
    if c.center_rewards_coefficient is not None and c.kind != "pairwise":
        raise ConfigError("center_rewards_coefficient", "centres a pairwise reward model's scores; kind classifier "
                                                        "has none to centre (leave it null)")
    _check_deepspeed(c.deepspeed, c.model)
    return {"model.path": model}


def _validate_small_trainer(t: SFTTrainerConfig):
    _check_loop(t)
    _positive(t.batch_size, "trainer.batch_size")
    _positive(t.eval_every, "trainer.eval_every")  # checked without data.eval_path too: switched off, still valid
    if t.batch_size % t.grad_accum:
        raise ConfigError("trainer.grad_accum", f"{t.grad_accum} does not divide trainer.batch_size {t.batch_size}")


_VALIDATORS = {TrainConfig: _validate_train, SFTConfig: _validate_sft, RMConfig: _validate_rm}


def validate(config, base_dir: str = ".") -> dict:
    """Every rule that needs only the config (relative paths resolved against ``base_dir``). Returns the config.json
    of each model folder the trained models load from, by key (``{}`` for one unset)."""
    return _VALIDATORS[type(config)](config, base_dir)


def check_world_size(config, world: int) -> None:
    """The rules that need the number of ranks ``world``: the batches must split evenly over them.

    RL (:class:`TrainConfig`): ``trainer.prompts_per_step`` over the ranks (each samples whole groups
    for its own prompts), ``trainer.minibatch_size`` over ranks x ``trainer.grad_accum``. SFT and RM:
    ``trainer.batch_size`` over ranks x ``trainer.grad_accum``. Raises a one-line ConfigError.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive number of ranks, got {world!r}")
    t = config.trainer
    if isinstance(config, TrainConfig):
        tp = config.rollout.tensor_parallel_size
        if world % tp:
            raise ConfigError("rollout.tensor_parallel_size", f"{tp} does not divide the {world} ranks (each "
                              f"{tp} consecutive ranks share one vLLM engine)")
        if t.prompts_per_step % world:
            raise ConfigError("trainer.prompts_per_step", f"{t.prompts_per_step} does not split over {world} ranks "
                              "(each rank samples whole groups for its own prompts)")
        if t.minibatch_size % (world * t.grad_accum):
            raise ConfigError("trainer.minibatch_size", f"{t.minibatch_size} sequences per optimizer step do not "
                              f"split over {world} ranks x trainer.grad_accum {t.grad_accum}")
        return
    if isinstance(config, (SFTConfig, RMConfig)):
        if t.batch_size % (world * t.grad_accum):
            raise ConfigError("trainer.batch_size", f"{t.batch_size} does not split over {world} ranks x "
                              f"trainer.grad_accum {t.grad_accum}")
        return
    raise TypeError(f"expected a TrainConfig, SFTConfig or RMConfig, got {type(config).__name__}")
