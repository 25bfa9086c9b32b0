"""Running the stages of a multi-stage example as child processes: their environment, a progress
bar that follows the child's ``metrics.jsonl``, one-line failures with the log's tail, and cache
keys. Shared by ``make demo`` (fastrlhf.demo.pipeline), ``examples/arithmetic/run.py`` and the
end-to-end benchmarks' children (benchmarks/e2e_common.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

__all__ = ["StageFailed", "child_env", "last_metrics", "print_failure", "resolved_config", "run_stage",
           "stamp_key"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class StageFailed(RuntimeError):
    pass


def child_env(threads: int, **extra) -> dict:
    """This process's environment for a child stage: no launcher variables (a stage started from a
    test or from under ``deepspeed`` must not join that job), a fixed thread count and the repository
    on ``PYTHONPATH`` (so ``module:function`` rewards in ``examples/`` import)."""
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # Threads are set, not left to torch's default: the results differ with the thread count
    # (reduction order), and more OpenMP threads than cores per machine spin against each other.
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), FASTRLHF_NO_PROGRESS="1",
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p))
    env.update(extra)
    return env


def last_metrics(metrics_path: str) -> dict:
    """The last complete record of a ``metrics.jsonl`` that a child may still be writing ({} if none)."""
    try:
        with open(metrics_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = [line for line in f.read().splitlines() if line.strip()]
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            return record
    return {}


def run_stage(name: str, cmd: list[str], log_path: str, metrics_path: str | None, total: int | None,
              progress: bool, env: dict, show: tuple[str, ...] = ()) -> float:
    """Run ``cmd`` with its output to ``log_path`` and a tqdm bar that follows ``metrics_path`` (the
    metrics named in ``show`` as its postfix); returns wall seconds, raises StageFailed with the log's
    tail when the child fails."""
    from tqdm import tqdm

    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    if metrics_path and os.path.exists(metrics_path):
        os.remove(metrics_path)
    started = time.perf_counter()

    def follow(bar) -> None:
        record = last_metrics(metrics_path) if metrics_path else {}
        done = min(int(record.get("step", 0) or 0), total or 0)
        if done > bar.n:
            bar.update(done - bar.n)
            shown = {k: f"{record[k]:.3g}" for k in show if isinstance(record.get(k), (int, float))}
            if shown:
                bar.set_postfix(shown, refresh=False)

    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=os.getcwd(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        bar = tqdm(total=total, desc=name, unit="step", disable=not progress, dynamic_ncols=True)
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                follow(bar)
            if proc.returncode == 0:
                follow(bar)
        except BaseException:
            # Ctrl-C, and equally a test's timeout (pytest-timeout raises in this loop) or any other error
            # here: the child runs in its own session, so nothing else would stop it, and a 2-rank job left
            # running loads the machine for whatever runs next.
            _stop(proc)
            raise
        finally:
            bar.close()
    if proc.returncode != 0:
        with open(log_path, errors="replace") as f:
            text = f.read()
        tail = text if len(text) <= 3000 else text[-3000:].partition("\n")[2]  # whole lines only
        raise StageFailed(f"stage {name!r} failed (exit {proc.returncode}); log: {log_path}\n{tail}")
    return time.perf_counter() - started


def print_failure(exc: StageFailed, what: str) -> None:
    """``exc``'s log tail, then its one line (what failed, the exit code, the log) and what to do: last, where the
    terminal ends, not buried above 3000 characters of log."""
    summary, _, tail = str(exc).partition("\n")
    if tail.strip():
        print(tail.rstrip("\n"), file=sys.stderr)
    print(f"{what} failed: {summary}; rerun once fixed: finished stages stay cached (FRESH=1 or --fresh redoes them)",
          file=sys.stderr)


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Stop the child's whole process group: SIGTERM (the deepspeed launcher then stops its ranks), SIGKILL
    if it has not exited after ``grace_s``. The grace is not a budget of the child's work: past it the
    child is killed, which is what was asked anyway."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def resolved_config(command: str, config_path: str, sets: list[str]):
    """The config a ``fastrlhf <command> --config config_path --set ...`` child runs with (defaults
    filled, overrides applied), validated here so that a bad override stops before the stage starts."""
    from fastrlhf.config import ConfigError, load_config

    try:
        return load_config(config_path, command, sets)
    except ConfigError as exc:
        raise StageFailed(f"{config_path}: {exc}") from None


def stamp_key(*parts) -> str:
    """A hash of the files (their bytes) and values that a cached stage's output came from."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, str) and os.path.isfile(part):
            with open(part, "rb") as f:
                h.update(f.read())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]
