"""How the cost of one GRPO step grows with the work, for fastrlhf and for TRL's ``GRPOTrainer``.

Model: workload B's 19M-parameter Llama with a 32,000-token vocabulary (``benchmarks/e2e_common.py``),
64-token prompts, n=8, fp32, 2 threads, one optimizer step per RL step, same settings as
``test_bench_e2e.py``. Two series, each doubling one factor three times over:

- batch: prompts x n = 8, 16, 32 completions at 32 new tokens;
- length: 16, 32, 64 new tokens at 16 completions (2 prompts x 8).

Each point runs both trainers in fresh child processes (fastrlhf first, then TRL), 1 warm-up step
and 2 measured steps each; the figure is the median measured step time (with the fastest and the
slowest measured step beside it). ``test_scaling_growth``
turns each series into a growth exponent ``log(t_last / t_first) / log(work_last / work_first)``:
1.0 is linear, below 1.0 means fixed costs are being amortised. Target: ours <= 1.0 over the
measured range (reported as ``ours_*_linear_or_better``; with ``FASTRLHF_BENCH_STRICT=1`` a miss
beyond a 0.1 noise allowance fails).
"""

from __future__ import annotations

import math
import os

import pytest

from benchmarks.e2e_common import WORKLOADS, loadavg, pooled, prepare, run_child, trl_available

THREADS = 2
N = 8
WARMUP, STEPS = 1, 2
BATCH_SERIES = [(1, 32), (2, 32), (4, 32)]  # (prompts, new tokens): 8, 16, 32 completions
LENGTH_SERIES = [(2, 16), (2, 32), (2, 64)]
POINTS = {f"batch-{p * N}x{t}": (p, t) for p, t in BATCH_SERIES}
POINTS.update({f"length-{p * N}x{t}": (p, t) for p, t in LENGTH_SERIES})
STRICT = os.environ.get("FASTRLHF_BENCH_STRICT") == "1"
_measured: dict[str, dict] = {}


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bench_scaling"))


def _trainers():
    return ("fastrlhf", "trl") if trl_available() else ("fastrlhf",)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("point", list(POINTS))
def test_scaling_point(benchmark, work_dir, point):
    prompts, new_tokens = POINTS[point]
    w = dict(WORKLOADS["B"], prompts_per_step=prompts, max_new_tokens=new_tokens, warmup=WARMUP, steps=STEPS)
    spec = dict(w, **prepare(work_dir, w), threads=THREADS)
    results = {}
    load_before = loadavg()

    def run_both():
        for trainer in _trainers():
            out = os.path.join(work_dir, f"{point}-{trainer}")
            results[trainer] = pooled([run_child(trainer, dict(spec, out_dir=out))], WARMUP)

    benchmark.pedantic(run_both, rounds=1, iterations=1)
    info = benchmark.extra_info
    info.update(series=point.split("-")[0], completions=prompts * N, new_tokens=new_tokens)
    for trainer, prefix in (("fastrlhf", "ours"), ("trl", "trl")):
        if trainer in results:
            med = results[trainer]
            info[f"{prefix}_step_s"] = round(med["step_s"], 4)
            info[f"{prefix}_step_s_min"] = round(med["step_s_min"], 4)  # the spread of the measured steps
            info[f"{prefix}_step_s_max"] = round(med["step_s_max"], 4)
            info[f"{prefix}_trained_tokens_per_s"] = round(med["trained_tokens_per_s"], 1)
            info[f"{prefix}_tokens_per_step"] = med["trained_tokens"]
            info[f"{prefix}_peak_rss_mib"] = round(med["peak_rss_bytes"] / (1 << 20), 1)
    if "trl" in results:
        ours_tps, trl_tps = results["fastrlhf"]["trained_tokens_per_s"], results["trl"]["trained_tokens_per_s"]
        info["speedup_vs_trl"] = round(ours_tps / trl_tps, 3)
    info["load_avg_before"] = load_before
    info["load_avg_after"] = loadavg()
    _measured[point] = results


@pytest.mark.timeout(60)
def test_scaling_growth(benchmark):
    if len(_measured) != len(POINTS):
        pytest.skip("needs every test_scaling_point case of this run")
    benchmark.pedantic(lambda: None, rounds=1)
    info = benchmark.extra_info
    for series, pts in (("batch", BATCH_SERIES), ("length", LENGTH_SERIES)):
        names = [f"{series}-{p * N}x{t}" for p, t in pts]
        work = [p * t for p, t in pts]
        for trainer, prefix in (("fastrlhf", "ours"), ("trl", "trl")):
            if trainer not in _measured[names[0]]:
                continue
            times = [_measured[n][trainer]["step_s"] for n in names]
            exponent = math.log(times[-1] / times[0]) / math.log(work[-1] / work[0])
            info[f"{prefix}_{series}_growth_x{work[-1] // work[0]}"] = round(times[-1] / times[0], 3)
            info[f"{prefix}_{series}_exponent"] = round(exponent, 3)
            for a, b, na, nb in zip(times, times[1:], names, names[1:], strict=False):
                info[f"{prefix}_{series}_{na.split('-')[1]}_to_{nb.split('-')[1]}"] = round(b / a, 3)
            if trainer == "fastrlhf":
                info[f"ours_{series}_linear_or_better"] = bool(exponent <= 1.0)
                if STRICT:
                    assert exponent <= 1.1, f"our step time grows as work^{exponent:.2f} over the {series} series"
