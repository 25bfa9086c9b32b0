"""Rollout generation (vLLM or transformers) and trainer -> engine weight sync.

Importing this package imports neither vLLM nor DeepSpeed; the engines import them when built.
"""

from fastrlhf.rollout.base import RolloutEngine, validate_prompts
from fastrlhf.rollout.engine_choice import CPU_VLLM_CROSSOVER_PARAMS, choose_engine_kind
from fastrlhf.rollout.hf_engine import HFEngine
from fastrlhf.rollout.sampling import Completion, SamplingConfig
from fastrlhf.rollout.vllm_engine import VLLMEngine
from fastrlhf.rollout.weight_sync import DEFAULT_BUCKET_BYTES, SyncStats, iter_bucketed_weights, sync_weights

__all__ = [
    "CPU_VLLM_CROSSOVER_PARAMS",
    "DEFAULT_BUCKET_BYTES",
    "Completion",
    "HFEngine",
    "RolloutEngine",
    "SamplingConfig",
    "SyncStats",
    "VLLMEngine",
    "choose_engine_kind",
    "iter_bucketed_weights",
    "sync_weights",
    "validate_prompts",
]
