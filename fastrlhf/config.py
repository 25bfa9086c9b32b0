"""Run configuration: YAML -> frozen dataclasses, validated before any work starts.

Importing this module must stay cheap (no torch): a bad config has to fail in well under a second.
Every problem raises :class:`ConfigError` whose message is one line naming the offending key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import yaml

__all__ = [
    "ConfigError",
    "ModelConfig",
    "ReferenceConfig",
    "CriticConfig",
    "RewardConfig",
    "DataConfig",
    "RolloutConfig",
    "TrainerConfig",
    "DeepSpeedConfig",
    "TrainConfig",
    "SFTDataConfig",
    "SFTTrainerConfig",
    "SFTConfig",
    "RMDataConfig",
    "RMConfig",
    "load_config",
    "parse_config",
    "config_to_dict",
]


class ConfigError(ValueError):
    """An invalid run configuration; ``str()`` is the one-line message shown to the user."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    path: str
    # auto: bfloat16 on a GPU (with deepspeed.bf16: fp32 master weights), float32 on a CPU; see fastrlhf.precision
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tf32: bool = True  # fp32 matmuls use TF32 on GPUs
    lora_r: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    gradient_checkpointing: bool = False


@dataclass(frozen=True)
class ReferenceConfig:
    path: str | None = None  # None: model.path (with LoRA: the actor with its adapter disabled)


@dataclass(frozen=True)
class CriticConfig:
    path: str | None = None  # None: model.path with a fresh value head
    lr: float = 1.0e-5


@dataclass(frozen=True)
class RewardConfig:
    function: str | None = None  # registered name or "module:function"
    model_path: str | None = None
    model_kind: Literal["classifier", "value_head"] = "classifier"
    label_index: int = 0


@dataclass(frozen=True)
class DataConfig:
    prompts: str
    prompt_field: str = "prompt_ids"
    max_prompt_len: int = 256


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["auto", "hf", "vllm"] = "auto"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    sync_bucket_bytes: int = 268435456
    kv_cache_bytes: int = 1073741824
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on a GPU, else the actor's


@dataclass(frozen=True)
class EvalConfig:
    """Validation during RL (``fastrlhf.rl.validation``): greedy completions of held-out prompts."""

    prompts: str | None = None  # JSONL in the data.prompts format; null: no validation
    every: int = 10  # steps between validations (the last step is always validated)
    reward: str | None = None  # the validation score (e.g. exact match); null: reward.function
    group_by: str | None = None  # a meta key: eval_reward/<value> for each of its values
    stop_at: float | None = None  # end the run once eval_reward >= stop_at (checkpoint + export as usual)


@dataclass(frozen=True)
class TrainerConfig:
    max_steps: int
    prompts_per_step: int = 16
    minibatch_size: int = 32
    ppo_epochs: int = 1
    grad_accum: int = 1
    lr: float = 1.0e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coef: float = 0.0
    kl_coef: float = 0.001
    kl_kind: Literal["k1", "abs", "k2", "k3", "kl", "mse", "low_var_kl"] = "k3"  # verl's names accepted
    kl_in_reward: bool = False
    gamma: float = 1.0
    lam: float = 0.95
    vf_clip: float | None = 0.2
    vf_coef: float = 0.5
    whiten_advantages: bool = True
    scale_by_std: bool = True
    tis_cap: float | None = None
    loss_chunk_size: int | None = None  # tokens per fused-loss chunk; null: from loss_chunk_bytes
    loss_chunk_bytes: int | None = None  # fp32 logits per chunk; null: 64 MiB on CPU, 1 GiB on GPU (free-memory cap)
    fused_loss: bool = True  # false: the same loss on materialised logits (for debugging)
    forward_micro_batch: int | None = None  # sequences per no-grad forward (logprobs, values); None: minibatch share
    # auto: skip the old-logprob pass when the update is on-policy (one epoch, one minibatch, no TIS,
    # KL not in the reward); recompute: always (also logs logprob_mismatch_* against the engine)
    old_logprobs: Literal["auto", "recompute"] = "auto"
    save_every: int = 0
    keep_checkpoints: int = 0  # 0 keeps all
    max_skipped_steps: int = 3
    log_every: int = 1
    tensorboard: bool = False
    wandb: bool = False


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    bf16: bool | Literal["auto"] = "auto"  # bf16 compute, fp32 master weights; auto: when model.dtype is bfloat16
    pure_bf16: bool = False  # true: allow bf16 weights trained without fp32 master weights (refused otherwise)
    extra: dict = field(default_factory=dict)  # merged verbatim into the generated DeepSpeed config


@dataclass(frozen=True)
class TrainConfig:
    algorithm: Literal["grpo", "ppo"]
    output_dir: str
    model: ModelConfig
    data: DataConfig
    trainer: TrainerConfig
    reward: RewardConfig
    seed: int = 0
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig | None = None
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    @property
    def rollout_batch_size(self) -> int:
        return self.trainer.prompts_per_step * self.rollout.n


@dataclass(frozen=True)
class SFTDataConfig:
    path: str
    max_len: int = 512  # prompt + response tokens; longer examples are reported as bad lines
    max_prompt_len: int | None = None


@dataclass(frozen=True)
class SFTTrainerConfig:
    max_steps: int
    batch_size: int = 8  # global examples per optimizer step, split across ranks and grad_accum
    grad_accum: int = 1
    lr: float = 1.0e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    loss_chunk_size: int | None = None
    loss_chunk_bytes: int | None = None
    use_fused_loss: bool = True
    save_every: int = 0
    keep_checkpoints: int = 0
    max_skipped_steps: int = 3
    log_every: int = 1
    tensorboard: bool = False
    wandb: bool = False


@dataclass(frozen=True)
class SFTConfig:
    output_dir: str
    model: ModelConfig
    data: SFTDataConfig
    trainer: SFTTrainerConfig
    seed: int = 0
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)


@dataclass(frozen=True)
class RMDataConfig:
    path: str
    max_len: int = 512


@dataclass(frozen=True)
class RMConfig:
    output_dir: str
    model: ModelConfig
    data: RMDataConfig
    trainer: SFTTrainerConfig
    kind: Literal["pairwise", "classifier"] = "pairwise"
    num_labels: int | None = None  # None: 1 for pairwise, 2 for classifier
    seed: int = 0
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    @property
    def resolved_num_labels(self) -> int:
        if self.num_labels is not None:
            return self.num_labels
        return 1 if self.kind == "pairwise" else 2


SCHEMAS = {"train": TrainConfig, "sft": SFTConfig, "rm": RMConfig}


# --------------------------------------------------------------------------------------------
# YAML with 1.2-style floats: PyYAML reads `1e-5` as a string, a classic trap for learning rates.
# --------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    pass


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _ch in list("-+0123456789."):
    _Loader.yaml_implicit_resolvers[_ch] = [
        (tag, rx) for tag, rx in _Loader.yaml_implicit_resolvers.get(_ch, []) if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
               r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def _yaml_load(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("", f"{where}: invalid YAML: {problem}") from None


# --------------------------------------------------------------------------------------------
# dict -> dataclass with type checks
# --------------------------------------------------------------------------------------------


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value, tp, key: str):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(key, f"expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(key, f"expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} at {key}")  # a schema bug, not a user error


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(prefix, f"expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(_join(prefix, str(key)), f"unknown key (known keys here: {known})")
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name in raw:
            kwargs[name] = _coerce(raw[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(key, "missing required key")
    return cls(**kwargs)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# --------------------------------------------------------------------------------------------
# --set overrides
# --------------------------------------------------------------------------------------------


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` strings (values parsed as YAML scalars) to a raw config mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError("--set", f"expected key=value, got {item!r}")
        dotted, text = item.split("=", 1)
        dotted = dotted.strip()
        if not dotted or any(not part for part in dotted.split(".")):
            raise ConfigError("--set", f"expected key=value, got {item!r}")
        value = _yaml_load(text, f"--set {dotted}") if text.strip() else None
        node = raw
        parts = dotted.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]),
                                  f"is {child!r}, not a section, so --set {dotted} cannot apply")
            node = child
        node[parts[-1]] = value
    return raw


# --------------------------------------------------------------------------------------------
# Cross-field validation
# --------------------------------------------------------------------------------------------


def _positive(value, key: str, strict: bool = True):
    if value is None:
        return
    if (value <= 0) if strict else (value < 0):
        raise ConfigError(key, f"must be {'> 0' if strict else '>= 0'}, got {value}")


def _check_path(path: str | None, key: str, base: str):
    if path is None:
        return
    resolved = path if os.path.isabs(path) else os.path.join(base, path)
    if not os.path.exists(resolved):
        raise ConfigError(key, f"path does not exist: {path}")


def _check_reward_spec(spec: str | None, key: str):
    if spec is not None and spec.count(":") > 1:
        raise ConfigError(key, f"expected a registered name or 'module:function', got {spec!r}")


def _check_model(m: ModelConfig, base: str, key: str = "model"):
    _check_path(m.path, f"{key}.path", base)
    _positive(m.lora_r, f"{key}.lora_r", strict=False)
    if m.lora_r > 0 and not m.lora_targets:
        raise ConfigError(f"{key}.lora_targets", "must name at least one module when lora_r > 0")
    if not 0.0 <= m.lora_dropout < 1.0:
        raise ConfigError(f"{key}.lora_dropout", f"must be in [0, 1), got {m.lora_dropout}")


def _check_deepspeed(ds: DeepSpeedConfig, model: ModelConfig):
    if ds.zero_stage not in (0, 1, 2, 3):
        raise ConfigError("deepspeed.zero_stage", f"must be 0, 1, 2 or 3, got {ds.zero_stage}")
    if ds.offload_param and ds.zero_stage != 3:
        raise ConfigError("deepspeed.offload_param", f"needs deepspeed.zero_stage 3, got {ds.zero_stage}")
    if ds.offload_optimizer and ds.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer", "needs deepspeed.zero_stage 1, 2 or 3, got 0")
    if model.dtype == "float16":
        raise ConfigError("model.dtype", "float16 training needs loss scaling, which fastrlhf does not set up; use "
                                         "bfloat16 (with deepspeed.bf16 for fp32 master weights) or auto")
    if ds.pure_bf16 and ds.bf16 is True:
        raise ConfigError("deepspeed.pure_bf16", "conflicts with deepspeed.bf16: true (fp32 master weights)")
    if model.dtype == "bfloat16" and ds.bf16 is False and not ds.pure_bf16:
        raise ConfigError("deepspeed.bf16", "false with model.dtype bfloat16 trains pure bf16 without fp32 master "
                                            "weights; set deepspeed.bf16: true (or auto), or deepspeed.pure_bf16: true "
                                            "to train that way on purpose")


def _check_common_trainer(t, prefix: str = "trainer"):
    _positive(t.max_steps, f"{prefix}.max_steps")
    _positive(t.lr, f"{prefix}.lr")
    _positive(t.grad_accum, f"{prefix}.grad_accum")
    _positive(t.weight_decay, f"{prefix}.weight_decay", strict=False)
    _positive(t.warmup_steps, f"{prefix}.warmup_steps", strict=False)
    _positive(t.max_grad_norm, f"{prefix}.max_grad_norm")
    _positive(t.loss_chunk_size, f"{prefix}.loss_chunk_size")
    _positive(t.loss_chunk_bytes, f"{prefix}.loss_chunk_bytes")
    _positive(t.save_every, f"{prefix}.save_every", strict=False)
    _positive(t.keep_checkpoints, f"{prefix}.keep_checkpoints", strict=False)
    _positive(t.max_skipped_steps, f"{prefix}.max_skipped_steps")
    _positive(t.log_every, f"{prefix}.log_every")


def _validate_train(c: TrainConfig, base: str):
    _check_model(c.model, base)
    _check_path(c.reference.path, "reference.path", base)
    _check_path(c.data.prompts, "data.prompts", base)
    _positive(c.data.max_prompt_len, "data.max_prompt_len")
    if not c.data.prompt_field:
        raise ConfigError("data.prompt_field", "must be a non-empty field name")

    r = c.reward
    if (r.function is None) == (r.model_path is None):
        which = "neither" if r.function is None else "both"
        raise ConfigError("reward", f"set exactly one of reward.function and reward.model_path, got {which}")
    _check_path(r.model_path, "reward.model_path", base)
    _check_reward_spec(r.function, "reward.function")
    _positive(r.label_index, "reward.label_index", strict=False)

    if c.algorithm == "ppo":
        if c.critic is None:
            raise ConfigError("critic", "algorithm ppo needs a critic section (critic: {path: null} uses model.path "
                                        "with a value head)")
        _check_path(c.critic.path, "critic.path", base)
        _positive(c.critic.lr, "critic.lr")

    ro = c.rollout
    _positive(ro.n, "rollout.n")
    if c.algorithm == "grpo" and ro.n < 2:
        raise ConfigError("rollout.n", f"grpo compares completions within a group and needs rollout.n >= 2, got {ro.n}")
    if ro.temperature < 0:
        raise ConfigError("rollout.temperature", f"must be >= 0, got {ro.temperature}")
    if not 0.0 < ro.top_p <= 1.0:
        raise ConfigError("rollout.top_p", f"must be in (0, 1], got {ro.top_p}")
    if ro.top_k == 0 or ro.top_k < -1:
        raise ConfigError("rollout.top_k", f"must be -1 (off) or >= 1, got {ro.top_k}")
    _positive(ro.max_new_tokens, "rollout.max_new_tokens")
    _positive(ro.sync_bucket_bytes, "rollout.sync_bucket_bytes")
    _positive(ro.kv_cache_bytes, "rollout.kv_cache_bytes")

    t = c.trainer
    _check_common_trainer(t)
    _positive(t.prompts_per_step, "trainer.prompts_per_step")
    _positive(t.minibatch_size, "trainer.minibatch_size")
    _positive(t.ppo_epochs, "trainer.ppo_epochs")
    rollout_batch = c.rollout_batch_size
    if rollout_batch % t.minibatch_size:
        raise ConfigError("trainer.minibatch_size", f"{t.minibatch_size} does not divide the rollout batch of "
                          f"{rollout_batch} (trainer.prompts_per_step x rollout.n)")
    if t.minibatch_size % t.grad_accum:
        raise ConfigError("trainer.grad_accum", f"{t.grad_accum} does not divide trainer.minibatch_size "
                          f"{t.minibatch_size}")
    _positive(t.clip_low, "trainer.clip_low", strict=False)
    _positive(t.clip_high, "trainer.clip_high", strict=False)
    if t.dual_clip is not None and t.dual_clip <= 1.0:
        raise ConfigError("trainer.dual_clip", f"must be > 1 (or null), got {t.dual_clip}")
    _positive(t.kl_coef, "trainer.kl_coef", strict=False)
    _positive(t.entropy_coef, "trainer.entropy_coef", strict=False)
    for name in ("gamma", "lam"):
        value = getattr(t, name)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"trainer.{name}", f"must be in [0, 1], got {value}")
    _positive(t.vf_clip, "trainer.vf_clip")
    _positive(t.vf_coef, "trainer.vf_coef", strict=False)
    _positive(t.tis_cap, "trainer.tis_cap")
    _validate_eval(c, base)
    _check_deepspeed(c.deepspeed, c.model)


def _validate_eval(c: TrainConfig, base: str):
    e = c.eval
    _positive(e.every, "eval.every")
    if e.prompts is None:
        for name in ("reward", "group_by", "stop_at"):
            if getattr(e, name) is not None:
                raise ConfigError(f"eval.{name}", "needs eval.prompts (the validation prompts)")
        return
    _check_path(e.prompts, "eval.prompts", base)
    if e.reward is None and c.reward.function is None:
        raise ConfigError("eval.reward", "needed when the training reward is a model (reward.model_path): "
                                         "validation scores with a reward function")
    _check_reward_spec(e.reward, "eval.reward")


def _validate_sft(c: SFTConfig, base: str):
    _check_model(c.model, base)
    _check_path(c.data.path, "data.path", base)
    _positive(c.data.max_len, "data.max_len")
    _positive(c.data.max_prompt_len, "data.max_prompt_len")
    _validate_small_trainer(c.trainer)
    _check_deepspeed(c.deepspeed, c.model)


def _validate_rm(c: RMConfig, base: str):
    _check_model(c.model, base)
    _check_path(c.data.path, "data.path", base)
    _positive(c.data.max_len, "data.max_len")
    _validate_small_trainer(c.trainer)
    _positive(c.num_labels, "num_labels")
    if c.kind == "pairwise" and c.resolved_num_labels != 1:
        raise ConfigError("num_labels", f"a pairwise reward model has one output, got {c.num_labels}")
    if c.kind == "classifier" and c.resolved_num_labels < 2:
        raise ConfigError("num_labels", f"a classifier needs at least 2 labels, got {c.num_labels}")
    _check_deepspeed(c.deepspeed, c.model)


def _validate_small_trainer(t: SFTTrainerConfig):
    _check_common_trainer(t)
    _positive(t.batch_size, "trainer.batch_size")
    if t.batch_size % t.grad_accum:
        raise ConfigError("trainer.grad_accum", f"{t.grad_accum} does not divide trainer.batch_size {t.batch_size}")


_VALIDATORS = {TrainConfig: _validate_train, SFTConfig: _validate_sft, RMConfig: _validate_rm}


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def parse_config(raw: dict, command: str = "train", base_dir: str = ".", on_gpu: bool | None = None):
    """Build and validate the config of ``command`` (train | sft | rm) from a raw mapping.

    ``auto`` precision settings are then resolved for a GPU run when ``on_gpu`` (None: whether
    this machine has one), see ``fastrlhf.precision``.
    """
    cls = SCHEMAS[command]
    if raw is None:
        raise ConfigError("", "the config is empty")
    if not isinstance(raw, dict):
        raise ConfigError("", f"the config must be a mapping of keys, got {type(raw).__name__}")
    if command == "train" and isinstance(raw.get("algorithm"), str) and raw.get("algorithm") == "ppo":
        # An empty `critic:` section means "all defaults", which is how a PPO config says "use a value head".
        if "critic" in raw and raw["critic"] is None:
            raw = {**raw, "critic": {}}
    config = _build(cls, raw, "")
    _VALIDATORS[cls](config, base_dir)
    from fastrlhf.precision import gpu_available, resolve_precision

    return resolve_precision(config, gpu_available() if on_gpu is None else on_gpu)


def load_config(path: str, command: str = "train", overrides: list[str] | None = None, on_gpu: bool | None = None):
    """Read a YAML run config, apply ``--set`` overrides, validate, resolve ``auto`` precision for a GPU
    run when ``on_gpu`` (None: this machine). Raises ConfigError (one line)."""
    if command not in SCHEMAS:
        raise ConfigError("", f"unknown command {command!r}; expected one of {', '.join(SCHEMAS)}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
    raw = _yaml_load(text, path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path}: the config must be a mapping of keys, got {type(raw).__name__}")
    raw = apply_overrides(raw, list(overrides or []))
    # Relative paths in a config mean "relative to the current directory", as on the command line.
    return parse_config(raw, command, base_dir=".", on_gpu=on_gpu)


def config_to_dict(config) -> dict:
    """Plain-data form of a config (for logging it next to the run's outputs)."""
    return dataclasses.asdict(config)
