"""Time and peak memory of one benchmark variant, measured in a fresh child process.

A variant is a function ``make(**params) -> step`` in some Python file: ``make`` allocates the
inputs, ``step()`` runs the work once (e.g. forward + backward) and keeps nothing alive afterwards.
The child process

1. sets ``torch.set_num_threads(threads)`` and calls ``make``;
2. takes the baseline: resident memory after the inputs exist, and resets the kernel's
   high-water mark (``/proc/self/clear_refs`` 5) so that allocating the inputs does not count;
3. runs ``step`` once to warm up (not timed), then ``repeats`` timed runs;
4. reports the per-run times and the peak resident memory above the baseline over ALL runs,
   the warm-up included (so nothing a first run allocates and later runs reuse is hidden).

Peak RSS of a separate process is the honest number on CPU: it counts everything (allocator
caches, temporaries autograd keeps, thread-local buffers), and a fresh process per variant means
no variant inherits another's freed memory. Linux only (reads ``/proc/self/status``).

Run as a script it is the child: ``python memory.py FILE FUNCTION JSON_PARAMS THREADS REPEATS``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

_RESULT_PREFIX = "BENCH_RESULT "


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux is required for peak-RSS measurement)")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _child(path: str, function: str, params: dict, threads: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    spec = importlib.util.spec_from_file_location("_bench_variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    step = getattr(module, function)(**params)

    baseline = _status_kib("VmRSS")
    if not _reset_peak():
        # Without a reset the high-water mark may include temporaries made while building the
        # inputs; the peak below is then an overestimate, never an underestimate.
        baseline = min(baseline, _status_kib("VmHWM"))
    step()  # warm-up: one-off allocations and thread-pool start, excluded from the times
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = _status_kib("VmHWM")
    return {
        "times_s": times,
        "baseline_bytes": baseline * 1024,
        "peak_extra_bytes": max(0, peak - baseline) * 1024,
        "threads": torch.get_num_threads(),
    }


def measure(path: str, function: str, params: dict | None = None, threads: int = 2, repeats: int = 3,
            timeout_s: float = 300.0) -> dict:
    """Run ``function(**params)``'s step in a fresh child; returns times, ``time_s`` (fastest run), the spread
    (``time_s_median``, ``time_s_max``) and peak.

    The fastest of ``repeats`` runs is the figure least disturbed by other work on the machine; the median and
    the slowest go with it, so that a ratio of two fastest runs is never read without the runs' spread.
    """
    cmd = [sys.executable, os.path.abspath(__file__), os.path.abspath(path), function,
           json.dumps(params or {}), str(threads), str(repeats)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"benchmark child for {function} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    result = json.loads(lines[-1][len(_RESULT_PREFIX):])
    result["time_s"] = min(result["times_s"])
    result["time_s_median"] = statistics.median(result["times_s"])
    result["time_s_max"] = max(result["times_s"])
    return result


if __name__ == "__main__":
    _path, _function, _params, _threads, _repeats = sys.argv[1:6]
    _result = _child(_path, _function, json.loads(_params), int(_threads), int(_repeats))
    print(_RESULT_PREFIX + json.dumps(_result), flush=True)
