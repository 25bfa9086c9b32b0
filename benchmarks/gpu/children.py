"""Each race, and each trainer a GRPO race starts, in a fresh process: its environment, its command run in its own
process group (killed whole on timeout), and a race's result read back from its ``GPU_RACE`` line."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT_PREFIX = "GPU_RACE "


def child_env(device: str) -> dict:
    """This environment without the in-process group's variables (each child makes its own); on a CPU, no
    CUDA and the threads this machine has."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(FASTRLHF_DIST_TIMEOUT="120", FASTRLHF_NO_PROGRESS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    # The children import benchmarks.* (the launcher's too); whatever the path had first stays first.
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path + ([ROOT] if ROOT not in path else []))
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(os.cpu_count() or 1))
    return env


def run_command(cmd: list[str], env: dict, timeout_s: float) -> str:
    """Run ``cmd`` from the repository root in its own process group (killed whole on timeout); its stdout."""
    from benchmarks.e2e_common import run_in_own_group

    returncode, stdout, stderr = run_in_own_group(cmd, env, timeout_s, " ".join(cmd[:6]))
    if returncode != 0:
        raise RuntimeError(f"exit {returncode}: {' '.join(cmd[:6])}\n{(stdout + stderr)[-6000:]}")
    return stdout


def run_child(race: str, params: dict, timeout_s: float = 600.0, device: str = "cuda") -> dict:
    """``RACES[race](**params)`` in a fresh ``python -m benchmarks.gpu.races`` process; its result."""
    out = run_command([sys.executable, "-m", "benchmarks.gpu.races", race, json.dumps(params)], child_env(device),
                      timeout_s)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(f"{race}: no {RESULT_PREFIX.strip()} line in its output:\n{out[-4000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])
