"""The memory plan's GPU cases, shared by the plan's tests (tests/memory/test_plan.py) and the launch
check that stops a run which cannot fit its GPUs (tests/rollout/test_rollout_colocate.py): the published
Qwen2.5 shapes, a model folder holding only a ``config.json``, and the settings of the GPU GRPO example."""

import json

from fastrlhf.config import (
    DataConfig,
    DeepSpeedConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
)

GiB = 1 << 30

# Published shapes (the models' config.json on the Hugging Face hub).
QWEN25_1_5B = dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                   max_position_embeddings=32768)
QWEN25_7B = dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                 max_position_embeddings=32768)


def model_folder(path, dims):
    """A model folder at ``path`` (a ``pathlib.Path``) with only ``config.json``: enough for the plan."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dims))
    return str(path)


def gpu_grpo(model_path, zero_stage, offload=False, **rollout):
    """The settings of examples/gpu/grpo_qwen2.5_1.5b.yaml: 128 prompts x 8 completions of up to 512 + 1024
    tokens, minibatches of 256 in 4 micro-batches per rank, gradient checkpointing, vLLM with 8 GiB of KV."""
    return TrainConfig(
        algorithm="grpo", output_dir="unused",
        model=ModelConfig(path=model_path, gradient_checkpointing=True),
        data=DataConfig(prompts="unused.jsonl", prompt_field="prompt", max_prompt_len=512),
        trainer=TrainerConfig(max_steps=1, prompts_per_step=128, minibatch_size=256, grad_accum=4, kl_coef=0.001),
        reward=RewardConfig(function="match_answer"),
        rollout=RolloutConfig(**{"engine": "vllm", "n": 8, "max_new_tokens": 1024, "kv_cache_bytes": 8 * GiB,
                                 **rollout}),
        deepspeed=DeepSpeedConfig(zero_stage=zero_stage, offload_optimizer=offload, offload_param=offload),
    )
