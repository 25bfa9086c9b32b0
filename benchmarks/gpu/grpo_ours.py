"""The fastrlhf side of the GRPO races: ``fastrlhf train`` through DeepSpeed's launcher on the race's model folder and
prompts, its per-step figures read from metrics.jsonl, its profiled step's summary and timeline, and the device's
peak memory over the run (:class:`DevicePeak`, which TRL's runs are measured with as well)."""

from __future__ import annotations

import json
import os
import shutil
import sys

from benchmarks.gpu.children import child_env, run_command
from benchmarks.gpu.workload import AGG, LOSS

# The allocator's churn per stage in fastrlhf's step metrics (memory/<stage>_alloc_retries, _cuda_mallocs).
ALLOCATOR_SUFFIXES = ("_alloc_retries", "_cuda_mallocs")
# What run_fastrlhf reads from its profiled step (trainer.profile_step).
PROFILE_KEYS = ("profile_stages", "profile_host", "profile_compiles", "profile_top", "profile_gemm_share",
                "profile_error", "profile_trace")


def run_fastrlhf(spec: dict, work: str, timeout_s: float, engine: str = "hf", shared: bool = False,
                 liger: bool = False, compile: bool = False, fp32: bool = False) -> dict:
    """``fastrlhf train`` through DeepSpeed's launcher on one device (``engine``: ``hf``, or ``vllm`` in the
    trainer's process, asleep during the update on CUDA); the per-step figures of its metrics.jsonl. ``shared``:
    packed rows with each group's prompt once (``trainer.packing``, ``trainer.share_prompts``); ``liger``:
    Liger-Kernel's RMSNorm, SwiGLU and rotary kernels in the actor and reference (``model.liger_kernels``);
    ``compile``: their decoder layers torch.compiled (``model.compile``; the first step compiles); ``fp32``: the LM
    head's logits in fp32 in the trainer and the engine (``model.fp32_logits``). With
    ``spec["profile"]`` (the races' default) one more step runs under ``trainer.profile_step``, left out of the
    figures: its stages' wall and device time, what the host did in each, what it compiled and its largest kernels
    (``profile_stages``, ``profile_host``, ``profile_compiles``, ``profile_top``). A run that fails in that step
    keeps the figures of the steps before it."""
    import yaml

    from fastrlhf.distributed import free_port

    profiled = spec["steps"] + 1 if spec.get("profile", True) else None
    name = ("fastrlhf" if engine == "hf" else f"fastrlhf-{engine}") + ("-shared" if shared else "") + (
        "-liger" if liger else "") + ("-compile" if compile else "") + ("-fp32" if fp32 else "")
    out_dir = os.path.join(work, name)
    vllm = {"engine": "vllm", "sleep": spec["device"] == "cuda", "max_logprob_mismatch": None}
    raw = {
        "algorithm": "grpo", "output_dir": out_dir, "seed": 0,
        "model": {"path": spec["model_dir"], "dtype": "auto", "gradient_checkpointing": True,
                  **({"liger_kernels": True} if liger else {}), **({"compile": True} if compile else {}),
                  **({"fp32_logits": True} if fp32 else {})},
        "reward": {"function": "benchmarks.e2e_common:even_fraction_reward"},
        "data": {"prompts": spec["prompts_file"], "max_prompt_len": spec["prompt_len"]},
        "rollout": {"engine": "hf", "n": spec["n"], "temperature": 1.0, "max_new_tokens": spec["new_tokens"],
                    "max_logprob_mismatch": None, **(vllm if engine == "vllm" else {})},
        "trainer": {"max_steps": profiled or spec["steps"], "profile_step": profiled,
                    "prompts_per_step": spec["prompts"],
                    "minibatch_size": spec["prompts"] * spec["n"], "grad_accum": spec["grad_accum"], "lr": 1e-6,
                    "agg": AGG, **LOSS, "save_final": False, "log_every": 1,
                    **({"packing": True, "share_prompts": True} if shared else {})},
        "deepspeed": {"zero_stage": 2},
    }
    path = out_dir + ".yaml"
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    failed = None
    with DevicePeak(spec["device"]) as device_peak:
        try:
            run_command([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port",
                  str(free_port()), "--module", "fastrlhf", "train", "--config", path], child_env(spec["device"]),
                 timeout_s)
        except RuntimeError as e:
            failed = e
    metrics_file = os.path.join(out_dir, "metrics.jsonl")
    rows = []
    if os.path.exists(metrics_file):
        with open(metrics_file) as f:
            rows = [r for r in map(json.loads, filter(str.strip, f)) if "step_time" in r]
    rows = [r for r in rows if r.get("step", 0) <= spec["steps"]]
    if failed is not None and (profiled is None or len(rows) < spec["steps"]):
        raise failed
    profile = {}
    profile_file = os.path.join(out_dir, "profile", f"step-{profiled}-rank-0.json")
    if profiled and os.path.exists(profile_file):
        with open(profile_file) as f:
            p = json.load(f)
        profile = dict(profile_stages=p["stages"], profile_host=p["host"], profile_compiles=p["compiles"],
                       profile_top=p["profile_top"], profile_gemm_share=p["profile_gemm_share"],
                       **_keep_trace(profile_file, name))
    elif profiled:
        profile = dict(profile_error=str(failed)[-1500:] if failed else "no profile written")
    steps = [dict(step_s=r.get("wall_time", r["step_time"]), tokens=r["generated_tokens"],
                  generate_s=r["time/generate"], score_s=r["time/score"], train_s=r["time/train"],
                  sync_s=r["time/sync"],
                  sync_bytes=r.get("sync_bytes", 0.0), trained_tokens=r["rank_tokens"],
                  mismatch=r.get("logprob_mismatch_mean"),
                  peak_gib=r.get("memory/peak_reserved_gib"), context_gib=r.get("memory/context_gib"),
                  peak_rss_gib=r.get("memory/peak_rss_gib"),
                  allocator={k[len("memory/"):]: v for k, v in r.items() if k.endswith(ALLOCATOR_SUFFIXES)})
             for r in rows]
    # TRL's peak_gib is its process's max_memory_reserved over the whole run: here the set-up's peak counts as well
    # (logged with the first step: the trainer empties the set-up's cache before it, so no step's peak holds it).
    peaks = [p for r in rows for p in (r.get("memory/peak_reserved_gib"), r.get("memory/setup_peak_reserved_gib"))
             if p is not None]
    contexts = [s["context_gib"] for s in steps if s["context_gib"] is not None]
    return dict(steps=steps, peak_gib=max(peaks) if peaks else None, context_gib=max(contexts) if contexts else None,
                device_peak_gib=device_peak.gib, **profile)


TRACE_KEEP_MAX_BYTES = 12 << 20  # a device call brings back files of 16 MiB at most


def _keep_trace(profile_file: str, name: str) -> dict:
    """The profiled step's timeline (``.trace.json.gz`` beside its summary) copied to ``$FASTRLHF_RACE_TRACES``
    (scripts/gpu_session.sh sets it), since the race's work folder is deleted: where a step's host time goes (a
    stage far under 1 busy) is read there, not in the kernel table. Returns ``profile_trace`` (its name, or why
    it was not kept)."""
    keep = os.environ.get("FASTRLHF_RACE_TRACES")
    trace = profile_file.removesuffix(".json") + ".trace.json.gz"
    if not keep or not os.path.exists(trace):
        return {}
    if os.path.getsize(trace) > TRACE_KEEP_MAX_BYTES:
        return {"profile_trace": f"not kept: {os.path.getsize(trace) >> 20} MiB"}
    os.makedirs(keep, exist_ok=True)
    kept = f"{name}-{os.path.basename(trace)}"
    shutil.copy(trace, os.path.join(keep, kept))
    return {"profile_trace": kept}


class DevicePeak:
    """The most memory the GPU had in use while the block ran, above what it had at the start (every process:
    the trainer, vLLM's pools, CUDA contexts), from ``nvidia-smi`` sampled every 50 ms: the one measure that
    reads fastrlhf, TRL and vLLM's allocators alike. ``gib`` is None on a CPU or without nvidia-smi."""

    def __init__(self, device: str):
        self.on = device == "cuda" and shutil.which("nvidia-smi") is not None
        self.gib = None

    def _query(self, *loop: str):
        import subprocess

        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0", *loop]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def __enter__(self):
        if self.on:
            self.base = float(self._query().communicate(timeout=30)[0].split()[0])
            self.proc = self._query("-lms", "50")
        return self

    def __exit__(self, *exc):
        if self.on:
            self.proc.terminate()
            samples = [float(x) for x in self.proc.communicate(timeout=30)[0].split() if x.strip().isdigit()]
            self.gib = round((max(samples, default=self.base) - self.base) / 1024, 2)  # MiB -> GiB
        return False
