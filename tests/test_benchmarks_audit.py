"""The GPU benchmarks' comparisons and the lent machine's session script, checked on a CPU: that the two sides of a
race do the same work and are measured alike (``benchmarks/gpu/grpo*.py``), and that ``scripts/gpu_session.sh``
keeps within its cap and never kills its own shell (run here with stand-ins for nvidia-smi, python3 and the
carried set-up)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import types

import pytest
import torch

from benchmarks.gpu import grpo, grpo_ours, grpo_trl, rl_update, workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------ TRL's side
def _fake_trl(captured: dict) -> types.ModuleType:
    """A ``trl`` with GRPOConfig's fields (TRL's defaults where the race relies on them) and a GRPOTrainer that keeps
    its arguments and runs one timed step."""
    names = ["output_dir", "seed", "use_cpu", "bf16", "fp16", "model_init_kwargs", "gradient_checkpointing",
             "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_iterations",
             "num_generations", "max_completion_length", "max_prompt_length", "temperature", "top_p", "learning_rate",
             "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "optim", "beta", "epsilon",
             "scale_rewards", "loss_type", "max_steps", "logging_steps", "report_to", "save_strategy", "disable_tqdm",
             "dataloader_num_workers", "log_completions", "vllm_mode", "vllm_enable_sleep_mode", "use_liger_kernel"]
    config = dataclasses.make_dataclass("GRPOConfig", [(n, object, None) for n in names] + [
        ("use_vllm", bool, False), ("vllm_importance_sampling_correction", bool, True),
        ("vllm_gpu_memory_utilization", float, 0.3)])

    class GRPOTrainer:
        def __init__(self, model, reward_funcs, args, train_dataset, processing_class, callbacks):
            captured["args"], self.callbacks, self.model = args, callbacks, torch.nn.Linear(1, 1)

        def train(self):
            for cb in self.callbacks:
                cb.on_step_begin(None, None, None)
                cb.on_step_end(None, None, None)

    return types.SimpleNamespace(__version__="1.16.0", GRPOConfig=config, GRPOTrainer=GRPOTrainer)


def test_trls_colocated_vllm_step_runs_no_old_logprob_pass_that_ours_skips(monkeypatch, tmp_path):
    """TRL's importance-sampling correction (on by default) adds a forward pass of the whole batch after generation;
    fastrlhf's on-policy step has no such pass, so the race turns it off: the same passes on both sides."""
    captured: dict = {}
    monkeypatch.setitem(sys.modules, "trl", _fake_trl(captured))
    workload.word_tokenizer(64).save_pretrained(tmp_path / "model")
    spec = dict(device="cpu", work=str(tmp_path), model_dir=str(tmp_path / "model"), prompts=2, n=4, prompt_len=8,
                new_tokens=8, grad_accum=2, steps=1, prompts_file=str(tmp_path / "prompts.jsonl"), vllm=True)
    workload.write_prompts(spec, 64)
    r = grpo_trl.trl_grpo(spec)
    args = captured["args"]
    assert args.use_vllm and args.vllm_mode == "colocate", args
    assert args.vllm_importance_sampling_correction is False, args
    assert r["vllm_gpu_memory_utilization"] == 0.3 and len(r["steps"]) == 1, r  # its KV pool's share: reported


# ------------------------------------------------------------------------------------------------ memory
def test_ours_peak_counts_the_set_up_as_trls_whole_run_peak_does(monkeypatch, tmp_path):
    """TRL's ``peak_gib`` is its process's max_memory_reserved over the run; fastrlhf's steps' peaks leave out the
    set-up's (its cache is emptied before the first step), which the first step's metrics log apart."""
    spec = dict(device="cpu", model_dir="m", prompts_file="p", prompt_len=8, n=4, new_tokens=8, prompts=2,
                grad_accum=2, steps=2, profile=False)

    def fake_run(cmd, env, timeout_s):
        (tmp_path / "fastrlhf").mkdir(exist_ok=True)
        rows = [{"step": s, "step_time": 1.0, "generated_tokens": 8, "time/generate": 0.5, "time/score": 0.1,
                 "time/train": 0.3, "time/sync": 0.0, "rank_tokens": 16, "memory/peak_reserved_gib": 30.0,
                 **({"memory/setup_peak_reserved_gib": 40.0} if s == 1 else {})} for s in (1, 2)]
        (tmp_path / "fastrlhf" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
        return ""

    monkeypatch.setattr(grpo_ours, "run_command", fake_run)
    r = grpo_ours.run_fastrlhf(spec, str(tmp_path), 60)
    assert r["peak_gib"] == 40.0, r
    out: dict = {}
    grpo._run_figures(out, "fastrlhf", r, 1, ("peak_gib",))
    assert out["fastrlhf_peak_gib"] == 40.0, out


# ------------------------------------------------------------------------------------------------ gpu_session.sh
def _session(tmp_path, mode: str, cap: int, setup_s: int = 0, python_s: int = 0, gpu_pids: str = ""):
    """``scripts/gpu_session.sh MODE CAP`` in a copy of its folder: the carried set-up takes ``setup_s``, every
    python3 ``python_s``, and nvidia-smi lists ``gpu_pids`` (``SELF``: the script's own shell) as compute
    processes. Returns (exit code, what it printed)."""
    root, bin_dir = tmp_path / "root", tmp_path / "bin"
    (root / "scripts").mkdir(parents=True)
    (root / ".gpu-carry").mkdir()
    bin_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "gpu_session.sh"), root / "scripts")
    (root / ".gpu-carry" / "on_device.sh").write_text(f"sleep {setup_s}\n")
    smi = ("#!/bin/bash\ncase \"$*\" in *query-compute-apps*) echo \"${GPU_PIDS//SELF/$SELF}\" | tr ' ' '\\n' ;;\n"
           "*) echo 'Fake GPU, 1 MiB' ;; esac\n")
    for name, text in (("nvidia-smi", smi), ("python3", f"#!/bin/bash\nsleep {python_s}\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), GPU_PIDS=gpu_pids,
               VPARTS=str(tmp_path / "vparts"), FASTRLHF_RACE_TRACES=str(tmp_path / "traces"))
    proc = subprocess.run(["bash", "-c", f'export SELF=$$; exec bash scripts/gpu_session.sh {mode} {cap}'], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("mode,part", [("bench", "bench-gpu"), ("tests", "test-gpu")])
def test_the_session_cap_counts_its_set_up(tmp_path, mode, part):
    """A call's cap is the device call's time: what the set-up took (the carried wheels, vLLM's and TRL's unpacking)
    is not given again to the parts after it."""
    rc, out = _session(tmp_path, mode, cap=10, setup_s=4)
    line = next(line for line in out.splitlines() if line.startswith(f"== {part} (cap "))
    cap = int(line.split("(cap ")[1].split("s)")[0])
    assert cap <= 6, out
    assert "== done" in out, out


def test_killing_a_cut_commands_leftovers_spares_the_session_itself(tmp_path):
    """nvidia-smi may list PIDs of another PID namespace (a container's host): one that is this shell's is not killed,
    while a real leftover still is."""
    leftover = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        rc, out = _session(tmp_path, "bench", cap=2, python_s=30, gpu_pids=f"SELF {leftover.pid}")
        assert "bench-gpu exit 124" in out and "== done" in out, (rc, out)
        assert rc == 0, (rc, out)
        assert leftover.wait(timeout=10) == -signal.SIGKILL
    finally:
        if leftover.poll() is None:
            os.kill(leftover.pid, signal.SIGKILL)
            leftover.wait()


# ------------------------------------------------------------------------------------------------ MFU
def test_the_updates_mfu_is_also_given_with_the_head_on_completion_positions_only(monkeypatch):
    """6 x params x tokens runs the LM head on every prompt token, where the update computes no logits: at the 1.5B
    race's shape (head 15% of the parameters, prompts a third of the tokens) MFU reads 5% high. The exact count is
    reported beside it (a GEMM rate of 1e-6 TFLOP/s here, so that the rounded figures keep their digits)."""
    monkeypatch.setattr(rl_update, "gemm_tflops", lambda *a, **k: 1e-6)
    r = rl_update.rl_update_race(device="cpu", shape="tiny", dtype="float32", prompts=2, n=4, prompt_len=8,
                                 new_tokens=8, grad_accum=2, updates=2, gemm_size=128, profile=False)
    head = workload.TINY_QWEN2["vocab_size"] * workload.TINY_QWEN2["hidden_size"]  # tied: the embedding too
    params, tokens, completions = r["params"], r["trained_tokens"], r["completion_tokens"]
    expected = r["mfu"] * ((params - head) * tokens + head * completions) / (params * tokens)
    assert r["mfu_head_on_completions"] == pytest.approx(expected, rel=1e-3), r
    assert r["mfu_head_on_completions"] < r["mfu"], r
    assert r["mfu"] > 1, r  # the stand-in GEMM rate is the denominator: a real one leaves a CPU's MFU far below 1
