"""Races 3 and 5: whole GRPO steps of ``fastrlhf train`` (:mod:`benchmarks.gpu.grpo_ours`) against TRL's
``GRPOTrainer`` (:mod:`benchmarks.gpu.grpo_trl`), each run in its own process on the same model folder, prompts and
batch, within the race's time budget; each run's figures and the ratios between them.

3. :func:`grpo_vs_trl`: with HF generate on both sides.
5. :func:`grpo_engines`: fastrlhf with vLLM in the trainer's process against the same steps with HF ``generate``,
   and against TRL's ``GRPOTrainer`` with its colocated vLLM.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from benchmarks.gpu.children import run_child
from benchmarks.gpu.grpo_ours import PROFILE_KEYS, DevicePeak, run_fastrlhf
from benchmarks.gpu.timing import ratio
from benchmarks.gpu.workload import LOSS, model_shape, save_model, write_prompts

GRPO_TARGETS = dict(speedup_min=1.5, memory_ratio_max=0.6)


def grpo_vs_trl(device: str = "cuda", shape: str = "qwen2-1.5b", prompts: int = 16, n: int = 8, prompt_len: int = 64,
                new_tokens: int = 128, grad_accum: int = 4, steps: int = 3, warmup: int = 1,
                runs=("fastrlhf", "trl", "trl_liger"), timeout_s: float = 240.0, budget_s: float = 150.0) -> dict:
    """Seconds per GRPO step (median after ``warmup`` steps) and peak reserved device memory of each run;
    fastrlhf's speed-up over TRL and its memory over TRL's. A run whose package is missing is skipped with
    its reason, and so is one that would start after ``budget_s`` (``make bench-gpu`` must stay under 5
    minutes). The model folder (bf16 on CUDA: ~3 GB for 1.5B) and every output go in the end."""

    started, work = time.perf_counter(), tempfile.mkdtemp(prefix="bench-gpu-grpo-")
    try:
        spec, saved = _grpo_setup(work, device, shape, prompts, n, prompt_len, new_tokens, grad_accum, steps,
                                  timeout_s)
        out = dict(shape=shape, prompts=prompts, n=n, prompt_len=prompt_len, new_tokens=new_tokens, steps=steps,
                   warmup_steps=warmup, engine="hf", **LOSS, **GRPO_TARGETS, **saved)
        needs = {"fastrlhf": (), "trl": ("trl",), "trl_liger": ("trl", "liger_kernel")}
        results = {}
        for name in runs:
            if skipped := _cannot_start(needs[name], started, budget_s):
                out[f"{name}_skipped"] = skipped
                continue
            if name == "fastrlhf":
                results[name] = run_fastrlhf(spec, work, timeout_s)
            else:
                results[name] = run_child("trl_grpo", dict(spec=dict(spec, liger=name == "trl_liger")), timeout_s,
                                          device)
        for name, r in results.items():
            _run_figures(out, name, r, warmup, ("peak_gib", "context_gib", "weights_dtype", "liger_flag",
                                                "ignored_args", *PROFILE_KEYS))
        for other in ("trl", "trl_liger"):
            ratio(out, f"speedup_vs_{other}", f"{other}_step_s", "fastrlhf_step_s")
            ratio(out, f"memory_ratio_vs_{other}", "fastrlhf_peak_gib", f"{other}_peak_gib")
        out["targets_met"] = bool(out.get("speedup_vs_trl", 0) >= GRPO_TARGETS["speedup_min"]
                                  and out.get("memory_ratio_vs_trl", 1e9) <= GRPO_TARGETS["memory_ratio_max"])
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


# Issue #42's targets: vLLM's step against HF generate's, against TRL's colocated vLLM (time and device memory),
# the weight sync of the 1.5B model, and the engine's logprobs against the trainer's (bf16).
ENGINE_TARGETS = dict(vllm_over_hf_min=5.0, speedup_vs_trl_vllm_min=1.5, memory_vs_trl_vllm_max=0.8, sync_ms_max=100.0,
                      mismatch_max=0.02)
ENGINE_RUNS = ("fastrlhf_vllm", "fastrlhf_hf", "trl_vllm", "trl_vllm_liger")
# Asked for by name only: fastrlhf with vLLM on packed rows that hold each group's prompt once. Any fastrlhf run may
# add ``_shared``, ``_liger`` (model.liger_kernels), ``_compile`` (model.compile) and ``_fp32`` (model.fp32_logits:
# the head's logits in fp32 in trainer and engine) to its name: fastrlhf_<engine>[_shared][_liger][_compile][_fp32].
SHARED_RUN = "fastrlhf_vllm_shared"
FASTRLHF_OPTIONS = ("shared", "liger", "compile", "fp32")
TRL_RUNS = {"trl_vllm": ("trl", "vllm"), "trl_vllm_liger": ("trl", "vllm", "liger_kernel")}  # -> what each imports


def _unknown_run(name: str) -> ValueError:
    return ValueError(f"unknown run {name!r}: fastrlhf_<vllm|hf>[_shared][_liger][_compile][_fp32], "
                      f"{' or '.join(TRL_RUNS)}")


def _fastrlhf_run(name: str) -> tuple[str, dict] | None:
    """``(engine, options)`` of a fastrlhf run's name, None for another trainer's; an unknown part is an error."""
    if not name.startswith("fastrlhf_"):
        return None
    engine, *options = name.split("_")[1:]
    if engine not in ("vllm", "hf") or not set(options) <= set(FASTRLHF_OPTIONS) or len(set(options)) < len(options):
        raise _unknown_run(name)
    return engine, {o: o in options for o in FASTRLHF_OPTIONS}


def _run_needs(name: str) -> tuple[str, ...]:
    """The packages a run of :func:`grpo_engines` imports."""
    fastrlhf = _fastrlhf_run(name)
    if fastrlhf is not None:
        engine, options = fastrlhf
        return ("vllm",) * (engine == "vllm") + ("liger_kernel",) * options["liger"]
    if name not in TRL_RUNS:
        raise _unknown_run(name)
    return TRL_RUNS[name]


def _engine_targets_met(out: dict, run: str) -> bool:
    """Whether fastrlhf's ``run`` meets every target of :data:`ENGINE_TARGETS` (the speed-up over HF generate is
    the default layout's)."""
    t, step, memory = ENGINE_TARGETS, out.get(f"{run}_step_s"), out.get(f"{run}_device_peak_gib")
    trl_step, trl_memory = out.get("trl_vllm_step_s"), out.get("trl_vllm_device_peak_gib")
    return bool(step and memory and trl_step and trl_memory and out.get("vllm_over_hf", 0) >= t["vllm_over_hf_min"]
                and trl_step / step >= t["speedup_vs_trl_vllm_min"]
                and memory / trl_memory <= t["memory_vs_trl_vllm_max"]
                and out.get(f"{run}_sync_ms", 1e9) <= t["sync_ms_max"]
                and out.get(f"{run}_mismatch", 1e9) <= t["mismatch_max"])


def grpo_engines(device: str = "cuda", shape: str = "qwen2-1.5b", prompts: int = 8, n: int = 8, prompt_len: int = 128,
                 new_tokens: int = 256, grad_accum: int = 4, steps: int = 3, warmup: int = 1, runs=ENGINE_RUNS,
                 timeout_s: float = 300.0, budget_s: float = 540.0) -> dict:
    """Whole GRPO steps (generate, reference, update, weight sync) of ``fastrlhf train`` with vLLM in the trainer's
    process (asleep during the update) and with HF ``generate``, and TRL's ``GRPOTrainer`` with its colocated vLLM
    (sleep mode on; with and without Liger), each in its own process on the same model folder, prompts, group
    size, token limits and batch. Per run: s/step (median after ``warmup``), generated tokens/s (over the
    generation), trained tokens/s (prompt and completion tokens over the update), the device's peak memory above
    idle (:class:`DevicePeak`), and for fastrlhf with vLLM the sync's ms and GB/s and the logprob mismatch. A run
    whose package is missing, or that would start after ``budget_s``, is skipped with the reason. ``runs`` may add
    fastrlhf's options to a run's name (:func:`_fastrlhf_run`), e.g. :data:`SHARED_RUN` (each group's prompt
    once): each such vLLM run's ratios against TRL carry its options as a prefix (``shared_speedup_vs_trl_vllm``),
    and ``targets_met`` holds where any fastrlhf vLLM run meets every target."""

    needs = {name: _run_needs(name) for name in runs}  # an unknown name fails before anything starts
    started, work = time.perf_counter(), tempfile.mkdtemp(prefix="bench-gpu-engines-")
    try:
        spec, saved = _grpo_setup(work, device, shape, prompts, n, prompt_len, new_tokens, grad_accum, steps,
                                  timeout_s)
        out = dict(shape=shape, prompts=prompts, n=n, prompt_len=prompt_len, new_tokens=new_tokens, steps=steps,
                   warmup_steps=warmup, **LOSS, **ENGINE_TARGETS, **saved)
        for name in runs:
            if skipped := _cannot_start(needs[name], started, budget_s, MIN_RUN_S):
                out[f"{name}_skipped"] = skipped
                continue
            # The time left, so that a slow or hung run still leaves the race its figures (a device call's cap).
            run_s = min(timeout_s, budget_s - (time.perf_counter() - started))
            try:
                if (fastrlhf := _fastrlhf_run(name)) is not None:
                    r = run_fastrlhf(spec, work, run_s, engine=fastrlhf[0], **fastrlhf[1])
                else:
                    with DevicePeak(device) as peak:
                        r = run_child("trl_grpo", dict(spec=dict(spec, vllm=True, liger=name.endswith("liger"))),
                                      run_s, device)
                    r["device_peak_gib"] = peak.gib
            except (RuntimeError, OSError) as e:  # the others' figures still count
                out[f"{name}_error"] = str(e)[-3000:]
                continue
            _run_figures(out, name, r, warmup, ("device_peak_gib", "peak_gib", "liger_flag", "ignored_args",
                                                "weights_dtype", "vllm_gpu_memory_utilization", *PROFILE_KEYS))
        ratio(out, "vllm_over_hf", "fastrlhf_hf_step_s", "fastrlhf_vllm_step_s")
        ours = ["fastrlhf_vllm"] + [r for r in runs if r.startswith("fastrlhf_vllm_")]
        for other in ("trl_vllm", "trl_vllm_liger"):
            for run in ours:
                prefix = run[len("fastrlhf_vllm_"):] + "_" if run != "fastrlhf_vllm" else ""
                ratio(out, f"{prefix}speedup_vs_{other}", f"{other}_step_s", f"{run}_step_s")
                ratio(out, f"{prefix}memory_vs_{other}", f"{run}_device_peak_gib", f"{other}_device_peak_gib")
        ratio(out, "shared_over_padded", "fastrlhf_vllm_step_s", f"{SHARED_RUN}_step_s")
        out["targets_met"] = any(_engine_targets_met(out, run) for run in ours)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _grpo_setup(work, device, shape, prompts, n, prompt_len, new_tokens, grad_accum, steps, timeout_s):
    """The spec every GRPO race's runs share, with its model folder saved (bf16 on CUDA, in a child so that this
    process holds no CUDA context while the trainers measure the device) and its prompts written; returns the
    spec and what saving the model reported."""
    spec = dict(device=device, work=work, model_dir=os.path.join(work, "model"), prompts=prompts, n=n,
                prompt_len=prompt_len, new_tokens=new_tokens, grad_accum=grad_accum, steps=steps,
                prompts_file=os.path.join(work, "prompts.jsonl"))
    model = dict(device=device, shape=shape, dtype="bfloat16" if device == "cuda" else "float32",
                 out_dir=spec["model_dir"])
    saved = save_model(**model) if device == "cpu" else run_child("save_model", model, timeout_s, device)
    write_prompts(spec, model_shape(shape)["vocab_size"])
    return spec, saved


def _cannot_start(modules, started: float, budget_s: float, min_left: float = 0.0) -> str | None:
    """Why a run is skipped (a package missing, or less than ``min_left`` of the race's time budget left), or
    None."""
    import importlib.util

    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if absent:
        return f"{', '.join(absent)} not installed"
    left = budget_s - (time.perf_counter() - started)
    return f"{left:.0f} s of the race's {budget_s:.0f} s left" if left <= min_left else None


MIN_RUN_S = 60.0  # a trainer's start on the 1.5B model and a step or two: less left, and a run is not begun


def _run_figures(out: dict, name: str, r: dict, warmup: int, keys) -> None:
    """One run's figures into ``out`` as ``<name>_<figure>``: medians over the steps after ``warmup`` (all of them
    if there are no more), fastrlhf's rates, sync and mismatch where its metrics hold them, the run's ``keys``
    (floats to 2 decimals), and TRL's version."""
    steps = r["steps"][warmup:] or r["steps"]

    def median(key):
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(values) if values else None

    out[f"{name}_step_s"] = round(median("step_s"), 3)
    out[f"{name}_steps_s"] = [round(s["step_s"], 3) for s in r["steps"]]
    if median("tokens") is not None:  # fastrlhf's metrics
        out[f"{name}_generated_tokens_per_s"] = round(median("tokens") / median("generate_s"), 1)
        out[f"{name}_trained_tokens_per_s"] = round(median("trained_tokens") / median("train_s"), 1)
    # Where the step's time goes (fastrlhf's metrics; TRL's timed methods): what a faster engine can win against
    # what it shares with the other run.
    for stage in ("generate", "score", "train", "sync"):
        if median(f"{stage}_s") is not None:
            out[f"{name}_{stage}_s"] = round(median(f"{stage}_s"), 3)
    if median("sync_bytes"):
        out[f"{name}_sync_ms"] = round(median("sync_s") * 1e3, 2)
        out[f"{name}_sync_gb_per_s"] = round(median("sync_bytes") / 1e9 / median("sync_s"), 2)
    if median("mismatch") is not None:
        out[f"{name}_mismatch"] = round(median("mismatch"), 5)
    churn = {}  # summed over the measured steps: a retry synchronizes the device and empties the cache
    for s in steps:
        for key, n in (s.get("allocator") or {}).items():
            churn[key] = churn.get(key, 0) + int(n)
    if churn:
        out[f"{name}_allocator"] = churn
    for key in keys:
        if r.get(key) is not None:
            out[f"{name}_{key}"] = round(r[key], 2) if isinstance(r[key], float) else r[key]
    if "trl_version" in r:
        out["trl_version"] = r["trl_version"]
