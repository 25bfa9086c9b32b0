"""GAE on CPU, side by side in one process: ``compute_gae`` (the recursion in blocks of 32 positions) against
``gae_by_recursion`` (one position at a time, as peers write it), PPO's 64 completions of 1,024 and 4,096 tokens,
fp32, 90% of the tokens kept.

Two figures per shape: the ops each dispatches (counted with a dispatch mode, views included; on a GPU most are
a kernel launch, so this is the figure that carries over) and the CPU time (the fastest of the repeats; a
regression guard, not a GPU figure), with the median and the slowest of the repeats beside it. Targets (asserted):
at most 1/50 of the recursion's ops, at most its time.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastrlhf.algorithms.advantages import compute_gae, gae_by_recursion

REPEATS = 5
GAMMA, LAM = 0.99, 0.95


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _figures(fn, inputs) -> dict:
    with _Ops() as ops:
        fn(*inputs, GAMMA, LAM)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(*inputs, GAMMA, LAM)
        times.append(time.perf_counter() - start)
    return {"ops": ops.count, "time_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
            "max_ms": max(times) * 1e3}


@pytest.mark.parametrize("length", [1024, 4096])
def test_gae_in_blocks_vs_per_token(benchmark, length):
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(64, length, generator=g), torch.randn(64, length, generator=g),
              (torch.rand(64, length, generator=g) < 0.9).float())
    result = {}
    benchmark.pedantic(lambda: result.update(blocks=_figures(compute_gae, inputs),
                                             per_token=_figures(gae_by_recursion, inputs)), rounds=1, iterations=1)
    blocks, per_token = result["blocks"], result["per_token"]
    info = {"shape": f"64x{length}", "blocks_ops": blocks["ops"], "per_token_ops": per_token["ops"],
            "blocks_ms": round(blocks["time_ms"], 2), "per_token_ms": round(per_token["time_ms"], 2),
            "blocks_median_ms": round(blocks["median_ms"], 2), "blocks_max_ms": round(blocks["max_ms"], 2),
            "per_token_median_ms": round(per_token["median_ms"], 2), "per_token_max_ms": round(per_token["max_ms"], 2),
            "ops_ratio": round(blocks["ops"] / per_token["ops"], 4),
            "time_ratio": round(blocks["time_ms"] / per_token["time_ms"], 3)}
    benchmark.extra_info.update(info)
    assert info["ops_ratio"] <= 1 / 50, info
    assert info["time_ratio"] <= 1.0, info
