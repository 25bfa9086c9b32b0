"""Which rollout engine a trainer should use by default."""

from __future__ import annotations

__all__ = ["CPU_VLLM_CROSSOVER_PARAMS", "choose_engine_kind"]

# Parameter count above which VLLMEngine generates more tokens/s than HFEngine on CPU. Below it a
# decode step is so cheap that vLLM's per-step scheduling overhead dominates and HF's plain loop on
# the trainer's own weights wins; above it vLLM's batched decoding over a paged KV cache does.
# benchmarks/test_bench_rollout.py measures the crossover and checks this constant against it on
# every run (its ratios are in benchmarks/results/rollout.md).
CPU_VLLM_CROSSOVER_PARAMS = 2_000_000


def choose_engine_kind(num_params: int, device) -> str:
    """ "vllm" or "hf" for a model of ``num_params`` parameters on ``device`` ("cpu", "cuda", torch.device)."""
    if not isinstance(num_params, int) or num_params <= 0:
        raise ValueError(f"num_params must be a positive int, got {num_params!r}")
    device_type = getattr(device, "type", None) or str(device).split(":")[0]
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not _vllm_installed():
        return "hf"
    if device_type == "cuda":
        return "vllm"
    return "vllm" if num_params >= CPU_VLLM_CROSSOVER_PARAMS else "hf"


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
