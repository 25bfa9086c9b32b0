"""The run configs of every command as frozen dataclasses: each setting, its type and its default, once.

The RL step reads ``TrainConfig`` itself (no mirror of it), so a setting has one name and one default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ModelConfig",
    "ReferenceConfig",
    "CriticConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "DataConfig",
    "RolloutConfig",
    "EvalConfig",
    "LoopConfig",
    "TrainerConfig",
    "DeepSpeedConfig",
    "TrainConfig",
    "SFTDataConfig",
    "SFTTrainerConfig",
    "SFTConfig",
    "RMDataConfig",
    "RMConfig",
    "SCHEMAS",
]


@dataclass(frozen=True)
class ModelConfig:
    path: str
    # auto: bfloat16 on a GPU (with deepspeed.bf16: fp32 master weights), float32 on a CPU (fastrlhf.config.precision)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tf32: bool = True  # fp32 matmuls use TF32 on GPUs
    lora_r: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    # auto (fastrlhf train only): off where the memory plan fits without it, else on for as few layers as fit
    # (fastrlhf.memory.auto)
    gradient_checkpointing: bool | Literal["auto"] = False
    # With gradient_checkpointing true: how many decoder layers (the first ones) recompute their forward in the
    # backward; the others keep their activations (less recompute, more memory). null: all. auto decides it.
    checkpoint_layers: int | None = None
    # The attention of packed rows (trainer.packing, trainer.share_prompts): auto, flex, flash_attention_2 or
    # sdpa; auto: flash_attention_2 on a GPU with flash_attn and bf16, else flex; sdpa on a CPU
    # (fastrlhf.sequences.attention)
    attention: Literal["auto", "flex", "flash_attention_2", "sdpa"] = "auto"
    # true (CUDA, liger-kernel installed): Liger-Kernel's RMSNorm, SwiGLU and rotary kernels in the models' layers
    # (not its loss: the LM head is fastrlhf's fused kernel). Off by default until measured here
    # (fastrlhf.modeling.loading.apply_liger_layers)
    liger_kernels: bool = False
    # true: torch.compile each decoder layer (Inductor fuses the norms, rotary, SwiGLU and residual adds, forward
    # and backward); DeepSpeed ZeRO 0-2. Off by default until measured on a GPU (fastrlhf.modeling.compile)
    compile: bool = False
    # true: a bf16/fp16 LM head's logits kept as its GEMM's fp32 sums, not rounded to bf16: in the fused kernels
    # (needs trainer.fused_loss) and in the rollout engine (vLLM's head_dtype: float32; HF generate's head), as
    # ScaleRL's fp32 head, so that trainer and engine logprobs agree more closely (fastrlhf.modeling.heads)
    fp32_logits: bool = False


@dataclass(frozen=True)
class ReferenceConfig:
    path: str | None = None  # None: model.path (with LoRA: the actor with its adapter disabled)


@dataclass(frozen=True)
class CriticConfig:
    path: str | None = None  # None: model.path with a fresh value head
    lr: float = 1.0e-5
    # true: the trained critic is exported too, to output_dir/final/critic (its model and value_head.safetensors:
    # a critic.path or a reward.model_kind value_head model of a later run; OpenRLHF's --critic.save_value_network)
    export: bool = False


@dataclass(frozen=True)
class RewardFunctionConfig:
    """A batch reward on text, TRL's signature: ``fn(prompts, completions, completion_ids, **columns)``."""

    function: str  # "module:function" or a registered name
    weight: float = 1.0


@dataclass(frozen=True)
class RewardConfig:
    function: str | None = None  # registered name or "module:function": fn(prompt_ids, completion_ids, meta)
    functions: list[RewardFunctionConfig] = field(default_factory=list)  # batch rewards on text, weighted
    model_path: str | None = None
    model_kind: Literal["classifier", "value_head"] = "classifier"
    label_index: int = 0
    truncated_reward: float | None = None  # the reward of a completion cut at max_new_tokens; null: scored as any
    # DAPO's soft overlong punishment: a completion longer than rollout.max_new_tokens - overlong_buffer tokens
    # loses overlong_penalty x (its excess / overlong_buffer) of its score; null: none
    overlong_buffer: int | None = None
    overlong_penalty: float = 1.0
    # [low, high]: each score clamped into it before the penalties and advantages (OpenRLHF's --reward.clip_range,
    # [-10, 10] there by default); validation scores stay unclamped. null: none
    clip_range: list[float] | None = None
    # Training scores normalised by the running mean and std of every training score seen so far (every rank's; kept
    # in the checkpoints), before the clip and the penalties: TRL's RunningMoments (use_score_norm). stored: the reward
    # model's scores as (score - mean) / std, by the mean and std in its config.json (OpenRLHF's
    # --reward.normalize_enable with a train_rm reward model; fastrlhf rm writes them too), training and validation
    # scores alike
    normalize: bool | Literal["stored"] = False
    # The form of `functions`' prompts and completions. trl: as TRL's GRPOTrainer passes them (a messages row:
    # its messages and [{"role": "assistant", "content": text}]; a text row: strings); text: strings, the prompt
    # as the model saw it (chat template and special tokens included)
    format: Literal["trl", "text"] = "trl"


@dataclass(frozen=True)
class DataConfig:
    prompts: str
    prompt_field: str = "prompt_ids"
    max_prompt_len: int = 256
    # a `messages` row always goes through the tokenizer's chat template (with the generation prompt);
    # true: text prompts too (as one user message); auto: only chats; false: chats are bad lines
    chat_template: bool | Literal["auto"] = "auto"
    # The template's own variables, for the prompts and every later turn of an episode (TRL's chat_template_kwargs;
    # Qwen3: {enable_thinking: false})
    chat_template_kwargs: dict = field(default_factory=dict)
    overlong: Literal["error", "truncate", "skip"] = "error"  # prompts over max_prompt_len (truncate keeps the end)
    # A column some rows lack (their rewards see None) is a warning at load; true: an error (data and eval.data)
    strict_columns: bool = False


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["auto", "hf", "vllm"] = "auto"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # TRL's min_p (tokens below min_p x the top token's probability are dropped; 0: off) and repetition_penalty
    # (HF's and vLLM's: 1.0 off); the engines report logprobs of the distribution they sampled from
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's and the tokenizer's eos
    stop: list[str] = field(default_factory=list)  # stop strings (the completing token is kept)
    sync_bucket_bytes: int = 268435456
    kv_cache_bytes: int | Literal["auto"] = "auto"  # vLLM's KV cache; auto: the step's batch (fastrlhf plan)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bfloat16 on a GPU, else the actor's
    # vLLM on CUDA: the share of each GPU it may take (auto: from the memory the trainer's models leave, see
    # fastrlhf plan), sleep mode between generations, tensor parallelism, CUDA graphs (auto: on CUDA, not CPU)
    gpu_memory_utilization: float | Literal["auto"] = "auto"
    sleep: bool = False
    tensor_parallel_size: int = 1
    enforce_eager: bool | Literal["auto"] = "auto"
    # Stop the run when the actor's logprobs of the engine's tokens differ from the engine's by more than this
    # (mean |difference|, nats): the engine is generating with other weights (checked without top-k/top-p)
    max_logprob_mismatch: float | None = 0.5
    mismatch_probe: int = 2  # shortest sequences per rank re-scored by the actor when the old-logprob pass is skipped
    # Multi-turn tool use (fastrlhf.rollout.episodes, docs/tools.md), TRL's interface: functions as 'module:function'
    # (type hints + Google-style docstring), and/or an environment class 'module:Class' (one instance per
    # episode; reset(**row), public methods as tools, optional get_reward()). max_new_tokens then counts an
    # episode's generated tokens over all its assistant turns.
    tools: list[str] = field(default_factory=list)
    environment: str | None = None
    max_turns: int = 4  # assistant turns per episode (a turn without a tool call ends it sooner)
    tool_timeout_s: float = 5.0  # a tool call running longer becomes an error message to the policy
    tool_parser: str = "hermes"  # how tool calls are read from a turn (fastrlhf.rollout.tools.TOOL_CALL_PARSERS)
    # Tokens between an episode's turns (tool results, the template's markers), over all its turns: the engine's
    # context and the memory plan hold max_prompt_len + max_new_tokens + this per episode
    max_tool_tokens: int = 256


@dataclass(frozen=True)
class EvalConfig:
    """Validation during RL (``fastrlhf.rl.validation``): completions of held-out prompts, scored."""

    data: str | None = None  # held-out prompts, any data.prompts format; null: no validation
    every: int = 10  # steps between validations (the last step is always validated)
    n: int = 1  # completions per prompt; n > 1 also logs eval/pass@n
    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int | None = None  # null: rollout.max_new_tokens
    before_train: bool = True  # also validate the starting weights (logged as step 0; not on --resume)
    reward: str | None = None  # a per-sample reward function for validation only; null: the run's reward
    max_reward: float | None = None  # eval/accuracy counts rewards >= this; null: 1.0, or with
    # reward.functions the sum of their positive weights (each function scoring at most 1)
    group_by: str | None = None  # a meta key: eval/reward_mean/<value> for each of its values
    stop_at: float | None = None  # end the run once eval/reward_mean >= stop_at (checkpoint + export as usual)


@dataclass(frozen=True)
class LoopConfig:
    """The ``trainer`` settings every command shares: optimizer, loss chunking, checkpoints, logging.

    A subclass adds its own settings after these, and overrides a field only where its default differs.
    """

    max_steps: int
    grad_accum: int = 1
    lr: float = 1.0e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0  # optimizer steps of linear warmup
    # After warmup: constant, or decayed over the run's optimizer steps to min_lr_ratio x lr, linearly (TRL's
    # default) or on a half cosine (OpenRLHF's cosine_with_min_lr, verl's cosine)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's (OpenRLHF's default: 0.9, 0.95)
    adam_eps: float = 1.0e-8
    max_grad_norm: float = 1.0
    loss_chunk_size: int | None = None  # tokens per fused-loss chunk; null: from loss_chunk_bytes
    loss_chunk_bytes: int | None = None  # fp32 logits per chunk; null: 64 MiB on CPU, 1 GiB on GPU (free-memory cap)
    fused_loss: bool = True  # false: the same loss on materialised logits (for debugging)
    # Micro-batches of at most this many tokens per rank (real tokens packed, rows x padded width otherwise),
    # in every forward/backward, instead of a fixed count of sequences; the loss is the same. null: by count;
    # auto (`fastrlhf train`): as many whole longest sequences as the memory plan says fit (fastrlhf.memory.auto)
    max_tokens_per_microbatch: int | Literal["auto"] | None = None
    packing: bool = False  # true: a micro-batch's sequences end to end in one row, no padding (same loss)
    # Deal each step's batch to the ranks by length (prompt tokens in RL, sequence tokens in SFT/RM), as many
    # items on every rank, so that no rank waits at each collective for one that drew all the long ones;
    # where that would not lower the largest rank's tokens, and with false: contiguous slices in sampled order
    balance_ranks: bool = True
    save_every: int = 0
    keep_checkpoints: int = 0  # 0 keeps all
    # false: no final checkpoint and no Hugging Face export (final/) after the last step, for throwaway runs
    # (benchmarks, the GPU tests) whose checkpoints would fill a small disk; a failed run still saves its last
    save_final: bool = True
    max_skipped_steps: int = 3
    log_every: int = 1
    # Step N under torch.profiler: each stage's wall and device time, the largest kernels, and a timeline, in
    # output_dir/profile (fastrlhf.engine.step_profile); null: none
    profile_step: int | None = None
    tensorboard: bool = False
    # Weights & Biases (when installed): false; true or offline (a local run under output_dir/wandb, `wandb sync`
    # uploads it); online (streamed to the W&B server: needs `wandb login` or WANDB_API_KEY)
    wandb: bool | Literal["offline", "online"] = False
    wandb_project: str | None = None  # null: fastrlhf
    wandb_run_name: str | None = None  # null: output_dir's folder name


@dataclass(frozen=True)
class TrainerConfig(LoopConfig):
    """``trainer`` of ``fastrlhf train`` (PPO, GRPO)."""

    lr: float = 1.0e-6
    prompts_per_step: int = 16
    minibatch_size: int = 32
    ppo_epochs: int = 1
    policy_loss: str = "vanilla"  # a registered policy loss (fastrlhf.algorithms)
    # the policy loss's own options, beyond the clips (fastrlhf.algorithms.policy_loss_options); sapo: tau_pos, tau_neg
    policy_loss_args: dict[str, float] = field(default_factory=dict)
    # a registered advantage estimator (@register_adv_est); auto: the algorithm's (ppo: gae, grpo: grpo)
    adv_estimator: str = "auto"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coef: float = 0.0
    kl_coef: float = 0.001
    # verl's names accepted; a "+" kind (verl's k1+, k3+, low_var_kl+) is the estimate's value with k2's gradient
    # in the loss (a straight-through estimator: unbiased gradient of KL(policy || ref)), the plain kind elsewhere
    kl_kind: Literal["k1", "abs", "k2", "k3", "kl", "mse", "low_var_kl",
                     "k1+", "abs+", "k3+", "kl+", "low_var_kl+"] = "k3"
    kl_in_reward: bool = False
    # The adaptive KL coefficient (fastrlhf.algorithms.kl_control): kl_coef starts the coefficient, which then moves
    # to keep the measured kl at kl_target, by at most 0.2 x (completions per step) / kl_horizon of itself per step
    kl_target: float | None = None
    kl_horizon: int = 10000
    # PPO: the first critic_warmup_steps steps train the critic alone (a fresh value head learns the returns before
    # its advantages move the actor); the actor, its learning-rate schedule and the rollout weights stay as they are
    critic_warmup_steps: int = 0
    gamma: float = 1.0
    lam: float = 0.95
    vf_clip: float | None = 0.2
    vf_coef: float = 0.5
    whiten_advantages: bool = True
    # GRPO's divisor: true: each group's std; false: none (Dr.GRPO); batch: the std of the whole batch's scores
    scale_by_std: bool | Literal["batch"] = True
    # Importance weights against the rollout engine's logprobs (fastrlhf.algorithms.rollout_is_weights), on when
    # tis_cap is set: the ratio of each token, of each completion (sequence) or its per-token geometric mean,
    # clamped into [tis_floor, tis_cap] (truncate: TIS, TRL's *_truncate) or zeroed above tis_cap and below tis_floor
    # (mask: TRL's *_mask, ICEPOP)
    tis_cap: float | None = None
    tis_level: Literal["token", "sequence", "geometric"] = "token"
    tis_mode: Literal["truncate", "mask"] = "truncate"
    tis_floor: float | None = None
    # sequences per no-grad forward (old/reference logprobs, values, the reward model); None: the micro-batch
    forward_micro_batch: int | None = None
    # With packing: the samples of one prompt share one copy of it in a packed row (each completion attends
    # to it and to itself; the same loss). model.attention flex (GPU) or sdpa (fastrlhf.sequences.attention).
    share_prompts: bool = False
    # auto: skip the old-logprob pass when the update is on-policy (one epoch, one minibatch, no TIS,
    # KL not in the reward); recompute: always (also logs logprob_mismatch_* against the engine)
    old_logprobs: Literal["auto", "recompute"] = "auto"
    # DAPO's dynamic sampling: groups whose rollout.n completions all scored the same (zero advantage) are set aside
    # and more prompts generated until each rank has its share of groups that differ, at most max_sampling_rounds
    # generations per step (then all-equal groups fill the rest); needs a group estimator (grpo, rloo, ...)
    filter_groups: bool = False
    max_sampling_rounds: int = 3
    # DAPO's overlong filtering (TRL's mask_truncated_completions): completions cut at rollout.max_new_tokens are
    # left out of the losses (still scored, still in their group's statistics and in the metrics)
    mask_truncated_completions: bool = False
    # TRL's top_entropy_quantile ("Beyond the 80/20 rule"): only the tokens whose entropy is in this top fraction
    # of the step's completion tokens train the policy term; 1.0: every token. Not with entropy_coef
    top_entropy_quantile: float = 1.0
    # TRL's off_policy_mask_threshold (DeepSeek-V3.2's off-policy sequence masking): a completion with a negative
    # advantage whose mean per-token KL(sampling policy || current policy) exceeds this leaves the policy loss (the
    # engine's logprobs against each micro-batch's own; its KL and entropy terms stay); null: off
    off_policy_mask_threshold: float | None = None


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
    # Modules imported before the config is checked (as --import MODULE does): ones that register a policy loss,
    # an advantage estimator or a reward by name. The current directory is importable; every rank imports them
    imports: list[str] = field(default_factory=list)
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
    chat_template: bool | Literal["auto"] = "auto"  # as data.chat_template of `fastrlhf train`
    chat_template_kwargs: dict = field(default_factory=dict)  # as data.chat_template_kwargs of `fastrlhf train`
    # Which assistant turns of a `messages` chat the loss trains: the last (every earlier turn is prompt), or all
    # (each in the context of the turns before it; the user and tool turns between them are read, not trained)
    assistant_turns: Literal["last", "all"] = "last"
    # Tools ('module:function', as rollout.tools) whose schemas the chat template lists in each chat's prompt:
    # SFT on tool-using demonstrations sees the prompt the RL run's episodes start from
    tools: list[str] = field(default_factory=list)
    # examples over max_len / max_prompt_len: bad lines, left out (skip), or cut (truncate: a prompt keeps its end,
    # then the example its first max_len tokens, as TRL's SFTTrainer); skipped and truncated ones are counted
    overlong: Literal["error", "skip", "truncate"] = "error"
    eval_path: str | None = None  # held-out examples in path's format, evaluated every trainer.eval_every steps


@dataclass(frozen=True)
class SFTTrainerConfig(LoopConfig):
    """``trainer`` of ``fastrlhf sft`` and ``fastrlhf rm``."""

    batch_size: int = 8  # global examples per optimizer step, split across ranks and grad_accum
    eval_every: int = 50  # optimizer steps between evaluations of data.eval_path (and after the last step)


@dataclass(frozen=True)
class SFTConfig:
    output_dir: str
    model: ModelConfig
    data: SFTDataConfig
    trainer: SFTTrainerConfig
    seed: int = 0
    imports: list[str] = field(default_factory=list)  # as TrainConfig.imports
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)


@dataclass(frozen=True)
class RMDataConfig:
    path: str
    max_len: int = 512
    # As data.chat_template_kwargs of `fastrlhf train`: a reward model scores the prompts as the RL run renders them
    # (Qwen3's enable_thinking: false puts an empty think block before every completion)
    chat_template_kwargs: dict = field(default_factory=dict)
    overlong: Literal["error", "skip"] = "error"  # pairs or rows over max_len: bad lines, or left out (counted)
    eval_path: str | None = None  # held-out pairs or rows in path's format, evaluated every trainer.eval_every steps


@dataclass(frozen=True)
class RMConfig:
    output_dir: str
    model: ModelConfig
    data: RMDataConfig
    trainer: SFTTrainerConfig
    kind: Literal["pairwise", "classifier"] = "pairwise"
    num_labels: int | None = None  # None: 1 for pairwise, 2 for classifier
    # TRL's center_rewards_coefficient (pairwise): adds coefficient x mean((r_chosen + r_rejected)^2) to the loss,
    # pulling the rewards toward mean zero (arXiv 2312.09244, Eq. 2; TRL recommends 0.01); null: none
    center_rewards_coefficient: float | None = None
    seed: int = 0
    imports: list[str] = field(default_factory=list)  # as TrainConfig.imports
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    @property
    def resolved_num_labels(self) -> int:
        if self.num_labels is not None:
            return self.num_labels
        return 1 if self.kind == "pairwise" else 2


SCHEMAS = {"train": TrainConfig, "sft": SFTConfig, "rm": RMConfig}
