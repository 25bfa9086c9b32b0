"""How the GPU races measure: median times (CUDA events on a GPU), paired rounds on one clock, peak memory, the
device's GEMM rate (the MFU denominator), a step's time by kernel, and the ratios the races report."""

from __future__ import annotations

import gc
import statistics
import time

import torch

MIB, GIB = float(1 << 20), float(1 << 30)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(step, device: torch.device, warmup: int = 1, repeats: int = 5) -> tuple[dict, object]:
    """Median time of ``repeats`` calls of ``step`` after ``warmup`` ones (CUDA events on a GPU), and on CUDA
    the peak memory the calls allocated above what was allocated before them, warm-up included (what a
    first call allocates and later calls reuse must count). Returns the figures and the last call's value."""
    cuda = device.type == "cuda"
    free_device_memory(device)
    sync(device)
    if cuda:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        last = step()
    times = []
    for _ in range(repeats):
        ms, last = _timed_ms(step, cuda)
        times.append(ms)
    peak = (torch.cuda.max_memory_allocated(device) - base) / MIB if cuda else None
    return {"time_ms": statistics.median(times), "times_ms": [round(t, 3) for t in times], "peak_mib": peak}, last


def measure_paired(steps: dict, device: torch.device, rounds: int = 5) -> dict[str, list[float]]:
    """Each of ``steps`` (name: callable) timed once per round, the rounds one after another, the order reversed
    every other round, so that two contenders' times of one round share the device's clock and temperature: a
    ratio of one round's times is not moved by the clock drifting between two blocks of repeats (the 7B head's
    repeats spread over 79-90 ms on an H100). Each step runs once untimed first (the allocator's blocks, any
    compilation). Returns each step's times in ms, round by round."""
    cuda = device.type == "cuda"
    names, times = list(steps), {name: [] for name in steps}
    for name in names:
        steps[name]()
    sync(device)
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            times[name].append(_timed_ms(steps[name], cuda)[0])
    return times


def _timed_ms(step, cuda: bool) -> tuple[float, object]:
    """One call of ``step``: its milliseconds (between CUDA events on a GPU, the wall clock elsewhere) and value."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        value = step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), value
    t0 = time.perf_counter()
    value = step()
    return (time.perf_counter() - t0) * 1e3, value


def gemm_tflops(device: torch.device, size: int = 8192, dtype: torch.dtype = torch.bfloat16, repeats: int = 10
                ) -> float:
    """The dense GEMM rate of this device (median of ``repeats`` ``size``-cubed matmuls), the MFU denominator."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(size, size, device=device, dtype=dtype)
    stats, _ = measure(lambda: torch.mm(a, b, out=c), device, warmup=3, repeats=repeats)
    return 2 * size**3 / (stats["time_ms"] / 1e3) / 1e12


def profile_kernels(step, device: torch.device, top: int = 10) -> dict:
    """One warm call of ``step`` under torch.profiler, its time summed by kernel name
    (:func:`fastrlhf.engine.step_profile.summarize_kernels`)."""
    from torch.profiler import ProfilerActivity, profile

    from fastrlhf.engine.step_profile import summarize_kernels

    cuda = device.type == "cuda"
    step()  # warm: compiled kernels, allocator blocks
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        sync(device)
    return summarize_kernels(prof, cuda, top)


def ratio(out: dict, key: str, num: str, den: str) -> None:
    if out.get(num) is not None and out.get(den):
        out[key] = round(out[num] / out[den], 4)
