"""``make demo-matrix``: the demo over pretraining seeds, RL seeds, algorithms, thread counts and rewards.

A result of the demo counts when it holds for other seeds and on other machines, not for the one
pretrained model it was tuned on. Each row is a whole ``run_demo`` (pretraining cached per
(pretraining seed, threads)); the table (``<workdir>/matrix.md``, rows also in ``matrix.json``) gives
every run's accuracy against its bar, then the minimum and median per variant.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

from fastrlhf.demo.data import EVAL_SIZE
from fastrlhf.demo.pipeline import DemoOptions, run_demo
from fastrlhf.demo.report import per_script_line
from fastrlhf.demo.stages import StageFailed

__all__ = ["MatrixRun", "MATRIX", "run_matrix"]


@dataclass(frozen=True)
class MatrixRun:
    pretrain_seed: int
    rl_seed: int
    algo: str = "grpo"
    reward: str = "rule"
    threads: int = 2
    bar: float = 0.99  # the accuracy (greedy, 1000 test prompts) this run must reach

    @property
    def variant(self) -> str:
        return f"{self.algo.upper()}, {self.reward} reward, {self.threads} thread(s)"


MATRIX = (
    *(MatrixRun(p, r) for p in (0, 1, 2) for r in (0, 1, 2)),
    *(MatrixRun(0, r, algo="ppo") for r in (0, 1, 2)),
    MatrixRun(0, 0, threads=1),
    MatrixRun(0, 0, reward="model", bar=0.95),
)


def _load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _passed(row: dict) -> bool:
    return "error" not in row and row["accuracy_after"] >= row["bar"]


def _table(rows: list[dict]) -> str:
    lines = ["| pretrain seed | RL seed | algorithm | reward | threads | before | after | bar | per prefix after "
             "(digits / lower / upper) | RL steps | RL time (s) | total time (s) | load before (1/5/15 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['pretrain_seed']} | {r['rl_seed']} | {r['algo']} | {r['reward']} | {r['threads']} | "
                         f"FAILED: {r['error']} ||||||||")
            continue
        per = per_script_line(r["per_script_after"])
        ok = "" if _passed(r) else " **below**"
        lines.append(f"| {r['pretrain_seed']} | {r['rl_seed']} | {r['algo']} | {r['reward']} | {r['threads']} | "
                     f"{r['accuracy_before']:.1%} | {r['accuracy_after']:.1%}{ok} | {r['bar']:.0%} | {per} | "
                     f"{r['steps']} | {r['rl_seconds']:.0f} | {r['seconds']:.0f} | {r['load']} |")
    lines += ["", "| variant | runs | min | median | max | at or above bar |", "|---|---|---|---|---|---|"]
    variants: dict[str, list[dict]] = {}
    for r in rows:
        variants.setdefault(r["variant"], []).append(r)
    for name, group in variants.items():
        acc = [r["accuracy_after"] for r in group if "error" not in r]
        passed = sum(1 for r in group if _passed(r))
        if acc:
            lines.append(f"| {name} | {len(group)} | {min(acc):.1%} | {statistics.median(acc):.1%} | "
                         f"{max(acc):.1%} | {passed}/{len(group)} |")
        else:
            lines.append(f"| {name} | {len(group)} | - | - | - | 0/{len(group)} |")
    return "\n".join(lines) + "\n"


def run_matrix(workdir: str = "runs/demo", runs=MATRIX, progress: bool = True) -> int:
    """Run every row, writing the table after each; returns 0 when every run reached its bar, else 1."""
    out_md, out_json = os.path.join(workdir, "matrix.md"), os.path.join(workdir, "matrix.json")
    os.makedirs(workdir, exist_ok=True)
    rows: list[dict] = []
    started = time.strftime("%Y-%m-%d %H:%M")
    for i, run in enumerate(runs, 1):
        print(f"\n=== matrix run {i}/{len(runs)}: pretrain seed {run.pretrain_seed}, RL seed {run.rl_seed}, "
              f"{run.variant}", flush=True)
        row = {**run.__dict__, "variant": run.variant, "load": _load_average()}
        opts = DemoOptions(algo=run.algo, reward=run.reward, pretrain_seed=run.pretrain_seed, rl_seed=run.rl_seed,
                           threads=run.threads, progress=progress,
                           workdir=os.path.join(workdir, "matrix", f"pretrain{run.pretrain_seed}-threads{run.threads}"))
        t0 = time.perf_counter()
        try:
            report = run_demo(opts)
        except StageFailed as exc:
            row["error"] = str(exc).splitlines()[0]
        else:
            row.update({k: report[k] for k in ("accuracy_before", "accuracy_after", "per_script_after", "steps")},
                       rl_seconds=report["wall_time"]["rl_stage_total"])
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        header = (f"# Demo seed matrix\n\nStarted {started}; {len(rows)}/{len(runs)} runs; machine: {os.cpu_count()} "
                  f"CPUs. Accuracy: greedy exact match on the {EVAL_SIZE} test prompts. Total time includes "
                  f"pretraining when it was not cached for that (pretrain seed, threads).\n\n")
        with open(f"{out_md}.tmp", "w") as f:
            f.write(header + _table(rows))
        os.replace(f"{out_md}.tmp", out_md)
        with open(f"{out_json}.tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(f"{out_json}.tmp", out_json)
    print(f"\n{out_md}:\n")
    with open(out_md) as f:
        print(f.read())
    return 0 if all(_passed(r) for r in rows) else 1
