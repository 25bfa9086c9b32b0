"""``trainer.profile_step: N``: step N of a run under torch.profiler, summed where one looks first.

Each rank writes ``output_dir/profile/step-N-rank-R.json``:

- ``stages``: each stage of the step (the RL step's ``generate``, ``score``, ``train``, ``sync``, which
  :class:`fastrlhf.rl.step_metrics.StepClock` marks ``fastrlhf:<stage>``): its wall time and, on CUDA, the
  device time of the kernels it launched, and their ratio (``busy``). A stage far under 1 waits on the host
  (Python, launches, host reads), one near 1 on its kernels;
- ``host``: per stage, what the host did in it: ``ops`` (top-level torch ops, each a kernel or more on a GPU),
  ``launches`` (CUDA kernel launches) and ``syncs`` with ``sync_wait_ms`` (the host waiting on the device:
  stream, event and device synchronizations, blocking copies), ``allocs`` with ``alloc_ms`` (the caching allocator
  calling the driver: cudaMalloc, cudaFree, expandable segments' mappings). A stage that is not busy yet waits
  little on its syncs and allocations spends its time in the host's own work, and ``ops`` says how much of it
  there is;
- ``compiles``: torch.compile's work during the step (Dynamo frames compiled, graphs, and frames run eagerly past
  the recompile limit) and since the process started: a step that compiles is not a steady step;
- ``profile_top``: the largest kernels by device time (CUDA), or ops by CPU time (elsewhere), with their calls
  and share; ``profile_gemm_share``: the GEMMs' share of the whole;

and ``step-N-rank-R.trace.json.gz``, the timeline (chrome://tracing, Perfetto). The profiled step runs slower
than the others (the profiler's own cost); its metrics are logged as any step's. The benchmarks sum one call's
kernels with :func:`summarize_kernels` as well.
"""

from __future__ import annotations

import contextlib
import json
import os

__all__ = ["GEMM_KERNEL_WORDS", "STAGE_PREFIX", "profile_step", "summarize_kernels"]

STAGE_PREFIX = "fastrlhf:"
GEMM_KERNEL_WORDS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                     "aten::matmul", "aten::linear")


def summarize_kernels(prof, cuda: bool, top: int = 10) -> dict:
    """A finished profile's time summed by kernel name: on CUDA each kernel's device time (self), elsewhere each op's
    CPU time (self). The ``top`` names with their calls, milliseconds and share of the whole, the whole, and the
    share of GEMM kernels (by name)."""
    import torch

    rows = []
    for e in prof.key_averages():
        if cuda:
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        else:
            us = e.self_cpu_time_total
        if us > 0 and not e.key.startswith(("ProfilerStep", STAGE_PREFIX)):
            rows.append((e.key, int(e.count), us / 1e3))
    rows.sort(key=lambda r: -r[2])
    whole = sum(r[2] for r in rows) or 1.0
    gemm = sum(r[2] for r in rows if any(w in r[0].lower() for w in GEMM_KERNEL_WORDS))
    return dict(profile_ms=round(whole, 3), profile_gemm_share=round(gemm / whole, 4),
                profile_top=[[name[:120], calls, round(ms, 3), round(ms / whole, 4)] for name, calls, ms in rows[:top]],
                profile_of="CUDA kernels (device time)" if cuda else "CPU ops (self time)")


# CUDA runtime and driver calls, as the profiler names them on the host's timeline.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"})
# The caching allocator reaching the driver: new segments (cudaMalloc, or expandable segments' mappings) and
# releases (cudaFree waits for the device).
ALLOC_CALLS = frozenset({"cudaMalloc", "cudaFree", "cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemRelease",
                         "cuMemSetAccess", "cuMemAddressReserve", "cuMemAddressFree"})


def _on_device(e) -> bool:
    """A device timeline's event (a kernel, a copy, a range's span there), not the host's."""
    import torch

    return getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA


def _host_events_and_stages(events) -> tuple[list, list[tuple[str, float, float]]]:
    """A profile's host events, and its ``fastrlhf:<stage>`` ranges among them as ``(stage, start, end)``."""
    host = [e for e in events if not _on_device(e)]
    return host, [(e.name[len(STAGE_PREFIX):], e.time_range.start, e.time_range.end)
                  for e in host if e.name.startswith(STAGE_PREFIX)]


def _host_side(events) -> dict:
    """Per ``fastrlhf:<stage>`` range: the top-level torch ops, kernel launches and synchronizations the host made
    in it, and the milliseconds it waited in those (a nested stage counts in its parent too)."""
    events, stages = _host_events_and_stages(events)
    out = {name: dict(ops=0, launches=0, syncs=0, sync_wait_ms=0.0, allocs=0, alloc_ms=0.0) for name, _, _ in stages}
    waits = {"syncs": "sync_wait_ms", "allocs": "alloc_ms"}
    for e in events:
        if e.name in LAUNCH_CALLS:
            kind = "launches"
        elif e.name in SYNC_CALLS:
            kind = "syncs"
        elif e.name in ALLOC_CALLS:
            kind = "allocs"
        elif e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            kind = "ops"
        else:
            continue
        t = e.time_range.start
        for name, start, end in stages:
            if start <= t < end:
                out[name][kind] += 1
                if kind in waits:
                    out[name][waits[kind]] += (e.time_range.end - e.time_range.start) / 1e3
    return {name: {**c, **{w: round(c[w], 3) for w in waits.values()}} for name, c in out.items()}


def _is_range(e) -> bool:
    """A range's span (``record_function``, the profiler's step) rather than an op or a kernel: on the device's
    timeline too, where it lasts as long as its kernels."""
    return bool(getattr(e, "is_user_annotation", False)) or e.name.startswith((STAGE_PREFIX, "ProfilerStep"))


def _stages(events, cuda: bool) -> dict:
    """Each ``fastrlhf:<stage>`` range's calls and wall time and, on CUDA, the device time of the kernels launched
    inside it. A kernel belongs to the stage in which the host launched it: the start of the host event torch links
    it to (``FunctionEvent.kernels``: the innermost op or range open at its launch, on any thread, since the
    backward's ops run on autograd's thread), or its own start where it is linked to none."""
    from collections import Counter

    cpu, ranges = _host_events_and_stages(events)
    out: dict = {}
    for name, start, end in ranges:
        row = out.setdefault(name, dict(calls=0, wall_ms=0.0, device_ms=0.0 if cuda else None, busy=None))
        row["calls"] += 1
        row["wall_ms"] += (end - start) / 1e3

    def add(t: float, us: float) -> None:
        for name, start, end in ranges:
            if start <= t < end:
                out[name]["device_ms"] += us / 1e3

    if cuda:
        # Torch lists a kernel under the host event it is linked to, by name and duration (FunctionEvent has no
        # link id in torch 2.11): those found there are counted at that event's start, the rest at their own.
        # A range's span on the device may be listed under its host range too: it lasts as long as its kernels.
        spans = {k.name for k in events if _on_device(k) and _is_range(k)}
        linked = Counter()
        for e in cpu:
            for k in getattr(e, "kernels", ()):
                if k.name in spans:
                    continue
                add(e.time_range.start, k.duration)
                linked[(k.name, k.duration)] += 1
        for k in events:
            if not _on_device(k) or _is_range(k):
                continue
            key = (k.name, k.time_range.end - k.time_range.start)
            if linked[key] > 0:
                linked[key] -= 1
            else:
                add(k.time_range.start, key[1])
    for row in out.values():
        row["wall_ms"] = round(row["wall_ms"], 3)
        if cuda:
            row["busy"] = round(row["device_ms"] / row["wall_ms"], 4) if row["wall_ms"] > 0 else None
            row["device_ms"] = round(row["device_ms"], 3)
    return out


@contextlib.contextmanager
def profile_step(config, step: int, rank: int = 0):
    """Runs the block (one step) under torch.profiler where ``step`` is ``trainer.profile_step``, then writes its
    summary and timeline; elsewhere just runs it. CUDA is profiled where the run has initialised it (a CPU run
    never does)."""
    if getattr(config.trainer, "profile_step", None) != step:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    from fastrlhf.modeling.compile import compile_counts

    before = compile_counts()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()  # the step's last kernels belong to it
    folder = os.path.join(config.output_dir, "profile")
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, f"step-{step}-rank-{rank}")
    summary = dict(step=step, rank=rank, device=torch.cuda.get_device_name() if cuda else "cpu",
                   stages=_stages(prof.events(), cuda), host=_host_side(prof.events()),
                   **summarize_kernels(prof, cuda, top=20))
    total = compile_counts()
    summary["compiles"] = dict(in_step={k: total[k] - before[k] for k in total}, in_process=total)
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    prof.export_chrome_trace(stem + ".trace.json.gz")  # torch gzips a path ending in .gz
