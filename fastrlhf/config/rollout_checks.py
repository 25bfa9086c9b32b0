"""The rules of ``rollout``: how completions are sampled and what the engines and episodes may be given, each
failure a one-line ConfigError naming the key (``fastrlhf.config.checks`` calls :func:`check_rollout`)."""

from __future__ import annotations

from . import model_checks as M
from .errors import ConfigError, positive

__all__ = ["check_rollout", "context_of", "reshaping_settings"]

# vLLM samples at this temperature at least (SamplingParams' _MAX_TEMP, read in 0.32): a lower one is raised to it
# with only a log line, its logprobs then of another distribution than the trainer's.
VLLM_MIN_TEMPERATURE = 1e-2


def reshaping_settings(s) -> list[str]:
    """The settings of ``s`` (a RolloutConfig or a SamplingConfig) under which the engines sample from, and report
    logprobs of, another distribution than the policy's at the temperature: top-k, top-p and min-p keep some tokens
    only (the logprobs renormalised over them), a repetition penalty rescales the logits of the tokens seen. Empty:
    the engines' logprobs are the trainer's, so a mismatch between them means other weights."""
    on = [f"top_k {s.top_k}" if s.top_k != -1 else "", f"top_p {s.top_p}" if s.top_p < 1.0 else "",
          f"min_p {s.min_p}" if s.min_p > 0.0 else "",
          f"repetition_penalty {s.repetition_penalty}" if s.repetition_penalty != 1.0 else ""]
    return [x for x in on if x]


def check_rollout(c, actor: dict) -> None:
    """``c``: a TrainConfig; ``actor``: model.path's config.json (``{}`` unread)."""
    ro = c.rollout
    if ro.temperature < 0:
        raise ConfigError("rollout.temperature", f"must be >= 0, got {ro.temperature}")
    if ro.temperature == 0 and ro.n > 1:
        _refuse_greedy_group(c)
    if ro.temperature == 0:
        raise ConfigError("rollout.temperature", "0 (greedy) samples nothing to learn from, and the trainer scores the "
                                                 "completions at rollout.temperature: set it > 0 (greedy is for "
                                                 "eval.temperature)")
    if 0 < ro.temperature < VLLM_MIN_TEMPERATURE and ro.engine != "hf":
        raise ConfigError("rollout.temperature", f"vLLM samples at {VLLM_MIN_TEMPERATURE} at least (it would raise "
                                                 f"{ro.temperature} silently, its logprobs then off the trainer's): "
                                                 f"set it >= {VLLM_MIN_TEMPERATURE}, or rollout.engine: hf")
    if not 0.0 < ro.top_p <= 1.0:
        raise ConfigError("rollout.top_p", f"must be in (0, 1], got {ro.top_p}")
    if ro.top_k == 0 or ro.top_k < -1:
        raise ConfigError("rollout.top_k", f"must be -1 (off) or >= 1, got {ro.top_k}")
    if not 0.0 <= ro.min_p < 1.0:
        raise ConfigError("rollout.min_p", f"must be in [0, 1) (0: off), got {ro.min_p}")
    if not ro.repetition_penalty > 0.0:  # the loader refuses a non-finite float
        raise ConfigError("rollout.repetition_penalty", f"must be > 0 (1: off), got {ro.repetition_penalty}")
    positive(ro.max_new_tokens, "rollout.max_new_tokens")
    positive(ro.sync_bucket_bytes, "rollout.sync_bucket_bytes")
    if ro.kv_cache_bytes != "auto":
        positive(ro.kv_cache_bytes, "rollout.kv_cache_bytes")
    if ro.gpu_memory_utilization != "auto" and not 0.0 < ro.gpu_memory_utilization <= 1.0:
        raise ConfigError("rollout.gpu_memory_utilization", f"must be in (0, 1] or auto, got "
                                                             f"{ro.gpu_memory_utilization}")
    positive(ro.tensor_parallel_size, "rollout.tensor_parallel_size")
    if ro.tensor_parallel_size > 1 and ro.engine == "hf":
        raise ConfigError("rollout.tensor_parallel_size", "tensor parallelism is vLLM's; set rollout.engine: vllm")
    positive(ro.max_logprob_mismatch, "rollout.max_logprob_mismatch")
    positive(ro.mismatch_probe, "rollout.mismatch_probe")
    positive(ro.max_turns, "rollout.max_turns")
    positive(ro.tool_timeout_s, "rollout.tool_timeout_s")
    positive(ro.max_tool_tokens, "rollout.max_tool_tokens")
    env = ro.environment
    if env is not None and (not isinstance(env, str) or env.count(":") != 1 or not all(env.split(":"))):
        raise ConfigError("rollout.environment", f"expected 'module:Class' (or null for none), got {env!r}")
    if (ro.tools or ro.environment) and ro.tensor_parallel_size > 1:
        raise ConfigError("rollout.tools", "multi-turn episodes advance each rank's engine on its own; they do not run "
                          "with rollout.tensor_parallel_size > 1 yet")
    if any(not isinstance(x, str) or not x for x in ro.stop):
        raise ConfigError("rollout.stop", f"stop strings must be non-empty strings, got {ro.stop!r}")
    M.check_stop_token_ids(ro.stop_token_ids, actor)
    reshaped = reshaping_settings(ro)
    if c.trainer.tis_cap is not None and reshaped:
        raise ConfigError("trainer.tis_cap", "weights tokens by the trainer's logprobs over the engine's, but with "
                                             f"rollout.{', rollout.'.join(reshaped)} the engines report logprobs of "
                                             "what they sampled from (over the kept tokens only, penalised), not of "
                                             "the policy (the weights fall off 1 by that alone): leave tis_cap unset, "
                                             "or sample with top_p 1, top_k -1, min_p 0 and repetition_penalty 1")


def context_of(c) -> tuple[int, str, str]:
    """``(tokens, key, sum)``: the most tokens one sequence may hold, the key that sizes it, and the sum. An episode's
    tool turns count where the engine may be vLLM, whose context is sized so (``fastrlhf.memory.components.seq_len``)
    and which refuses one past the model's positions once the models are loaded (the HF engine ends an episode at the
    model's positions instead: ``fastrlhf.rollout.hf_engine``)."""
    ro = c.rollout
    total = c.data.max_prompt_len + ro.max_new_tokens
    if (not ro.tools and ro.environment is None) or ro.engine == "hf":
        return total, "rollout.max_new_tokens", "data.max_prompt_len + rollout.max_new_tokens = "
    return (total + ro.max_tool_tokens, "rollout.max_tool_tokens",
            "data.max_prompt_len + rollout.max_new_tokens + rollout.max_tool_tokens = ")


def _refuse_greedy_group(c) -> None:
    """``rollout.temperature`` 0 with ``rollout.n > 1``: the n completions of a prompt are one completion n times."""
    from fastrlhf.algorithms import ADV_ESTIMATOR_TRAITS, adv_estimator_of

    name = adv_estimator_of(c)
    traits = ADV_ESTIMATOR_TRAITS.get(name)
    why = f" ({name} compares them: every advantage would be 0)" if traits is not None and traits.needs_groups else ""
    raise ConfigError("rollout.n", f"{c.rollout.n} greedy completions of a prompt are all the same{why}; set "
                                   "rollout.temperature > 0, or rollout.n: 1")
