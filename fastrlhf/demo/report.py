"""``report.md`` / ``report.json`` and PNG plots (reward, accuracy, KL, entropy against step) of a demo run."""

from __future__ import annotations

import json
import math
import os

__all__ = ["write_report", "per_script_line", "PLOTS"]

# file name -> (title, y label)
PLOTS = {
    "reward.png": ("Mean reward of the sampled completions", "reward"),
    "accuracy.png": ("Exact-match accuracy", "accuracy"),
    "kl.png": ("KL(policy || reference), rollout tokens", "KL"),
    "entropy.png": ("Policy entropy per token", "entropy (nats)"),
}


def per_script_line(per_script: dict) -> str:
    """``100.0% / 99.1% / 100.0%``: accuracy per requested script, in the task's script order."""
    from fastrlhf.demo.script_doubling import SCRIPTS

    return " / ".join(f"{per_script.get(s, float('nan')):.1%}" for s in SCRIPTS)


def _num(value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return float("nan")
    return value


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        if key in r and math.isfinite(_num(r[key])):
            steps.append(int(r["step"]))
            values.append(_num(r[key]))
    return steps, values


def _exact_match_per_step(exact_log: str, calls_per_step: int, ranks: int) -> tuple[list[int], list[float]]:
    """Training exact-match rate per step from the learned-reward adapter's per-rank logs."""
    per_rank = []
    for r in range(ranks):
        path = f"{exact_log}.rank{r}"
        if not os.path.exists(path):
            return [], []
        with open(path) as f:
            per_rank.append([int(line) for line in f if line.strip()])
    steps = min(len(v) for v in per_rank) // calls_per_step
    xs, ys = [], []
    for s in range(steps):
        chunk = [x for v in per_rank for x in v[s * calls_per_step:(s + 1) * calls_per_step]]
        xs.append(s + 1)
        ys.append(sum(chunk) / len(chunk))
    return xs, ys


def _plot(path: str, title: str, ylabel: str, lines: list[tuple[str, list, list, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for label, xs, ys, style in lines:
        if xs:
            ax.plot(xs, ys, label=label, **style)
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(run_dir: str, algo: str, reward: str, before: dict, after: dict, stage_seconds: dict,
                 exact_log: str | None = None, exact_calls_per_step: int | None = None, ranks: int = 2,
                 rollout_engine: str | None = None, run: dict | None = None) -> dict:
    """``run``: what the run came from that its folder does not hold (the seeds, the thread count, the pretrained
    model's stamp and whether it was cached): without it two reports cannot be told apart or reproduced."""
    from fastrlhf.engine.metrics import read_metrics

    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    last = records[-1] if records else {}
    steps = int(last.get("step", 0))
    split = {k: sum(_num(r.get(f"time/{k}", 0.0)) for r in records) for k in ("generate", "score", "train", "sync")}
    tokens = sum(_num(r.get("generated_tokens", 0.0)) for r in records)
    tokens_per_second = tokens / split["generate"] if split["generate"] > 0 else 0.0

    reward_x, reward_y = _series(records, "reward_mean")
    if reward == "rule":
        acc_x, acc_y = reward_x, reward_y  # the rule reward is the exact-match indicator
        acc_label = "sampled completions (T=1), = reward"
    else:
        acc_x, acc_y = _exact_match_per_step(exact_log, exact_calls_per_step, ranks) if exact_log else ([], [])
        acc_label = "sampled completions (T=1)"
    eval_x = [0, steps]
    eval_y = [before["accuracy"], after["accuracy"]]
    val_lines = [("validation, greedy: all", *_series(records, "eval/reward_mean"), {"marker": ".", "linewidth": 2})]
    val_lines += [(f"validation: {script}", *_series(records, f"eval/reward_mean/{script}"),
                   {"marker": ".", "linestyle": "--", "alpha": 0.8}) for script in before["per_script"]]
    plots = {}
    plot_lines = {
        "reward.png": [("reward_mean", reward_x, reward_y, {})],
        "accuracy.png": [(acc_label, acc_x, acc_y, {"alpha": 0.5}), *val_lines,
                         (f"test, greedy ({before['n']} prompts)", eval_x, eval_y,
                          {"marker": "o", "linestyle": "none", "markersize": 8})],
        "kl.png": [("kl", *_series(records, "kl"), {})],
        "entropy.png": [("update (actor)", *_series(records, "entropy"), {}),
                        ("rollout", *_series(records, "rollout_entropy"), {"alpha": 0.6})],
    }
    for name, lines in plot_lines.items():
        title, ylabel = PLOTS[name]
        _plot(os.path.join(run_dir, name), f"{title} ({algo.upper()}, {reward} reward)", ylabel, lines)
        plots[name.removesuffix(".png")] = name

    rl_wall = stage_seconds.get("rl", 0.0)
    report = {
        "algorithm": algo,
        "reward": reward,
        "run": dict(run or {}),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "right_number_before": before["right_number"],
        "right_number_after": after["right_number"],
        "scripts_before": before["scripts"],
        "scripts_after": after["scripts"],
        "per_script_before": before["per_script"],
        "per_script_after": after["per_script"],
        "validation": [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/reward_mean")}
                       for r in records if "eval/reward_mean" in r],
        "eval_prompts": before["n"],
        "steps": steps,
        "ranks": ranks,
        "rollout_engine": rollout_engine,
        "wall_time": {**{k: round(v, 2) for k, v in split.items()},
                      "rl_stage_total": round(rl_wall, 2),
                      "rl_startup_and_export": round(max(0.0, rl_wall - sum(split.values())), 2),
                      "stages": {k: round(v, 2) for k, v in stage_seconds.items()}},
        "generated_tokens": tokens,
        "tokens_per_second": round(tokens_per_second, 1),
        "final_reward_mean": last.get("reward_mean"),
        "final_kl": last.get("kl"),
        "samples_before": before["samples"],
        "samples_after": after["samples"],
        "plots": plots,
    }
    with open(os.path.join(run_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
    with open(os.path.join(run_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(_markdown(report))
    return report


def _run_line(run: dict) -> str:
    """``Seeds: pretraining 0, RL 0; 2 threads; pretrained model 68552948dfdd06bd (cached, pretrained in 139 s).``"""
    cached = run.get("pretrained_cached")
    how = ("cached" if cached else "pretrained in this run") if cached is not None else ""
    if cached and run.get("pretrain_seconds") is not None:
        how += f", pretrained in {run['pretrain_seconds']:.0f} s"
    return (f"Seeds: pretraining {run.get('pretrain_seed')}, RL {run.get('rl_seed')}; {run.get('threads')} threads; "
            f"pretrained model {run.get('pretrain_key')}" + (f" ({how})." if how else "."))


def _markdown(r: dict) -> str:
    wt = r["wall_time"]
    lines = [
        f"# fastrlhf demo: {r['algorithm'].upper()} with the {r['reward']} reward",
        "",
        "Task: `S` + prefix + `:` + a number + `x2=`, answer twice the number in the script the prefix asks for "
        "(`数字` digits, `小写` lower-case, `大写` upper-case numerals), then `E`.",
        "",
        f"| exact-match accuracy on {r['eval_prompts']} held-out prompts (greedy) | before RL | after RL |",
        "|---|---|---|",
        f"| answer exactly right | {r['accuracy_before']:.1%} | {r['accuracy_after']:.1%} |",
        f"| right number, any script | {r['right_number_before']:.1%} | {r['right_number_after']:.1%} |",
        *(f"| exactly right, prompts asking for {script} | {r['per_script_before'][script]:.1%} | "
          f"{r['per_script_after'].get(script, float('nan')):.1%} |" for script in r["per_script_before"]),
        "",
        "Per prefix after RL (digits / lower / upper): "
        + per_script_line(r["per_script_after"]),
        "",
        f"RL: {r['steps']} steps, {r['generated_tokens']:.0f} generated tokens, "
        f"{r['tokens_per_second']:.0f} tokens/s while generating; {r['ranks']} ranks, rollout engine "
        f"{r['rollout_engine']}.",
        "",
        "| time (s) | generate | score | train | sync | RL stage total (incl. start-up, export) |",
        "|---|---|---|---|---|---|",
        f"| | {wt['generate']:.1f} | {wt['score']:.1f} | {wt['train']:.1f} | {wt['sync']:.1f} | "
        f"{wt['rl_stage_total']:.1f} |",
        "",
        "Stages (s): " + ", ".join(f"{k} {v:.1f}" for k, v in wt["stages"].items()),
        *(["", _run_line(r["run"])] if r["run"] else []),
        "",
        "## Plots",
        "",
    ]
    lines += [f"![{name}]({file})" for name, file in r["plots"].items()]
    if r["validation"]:
        groups = [k.removeprefix("eval/reward_mean/") for k in r["validation"][0] if k.startswith("eval/reward_mean/")]
        lines += ["", "## Validation during RL (greedy exact match on the validation prompts)", "",
                  "| step | all | " + " | ".join(groups) + " |", "|---|---|" + "---|" * len(groups)]
        lines += [f"| {v['step']} | {v['eval/reward_mean']:.1%} | "
                  + " | ".join(f"{v.get(f'eval/reward_mean/{g}', float('nan')):.1%}" for g in groups) + " |"
                  for v in r["validation"]]
    for when in ("before", "after"):
        lines += ["", f"## Sample completions {when} RL", "", "| prompt | completion | expected | ok |",
                  "|---|---|---|---|"]
        lines += [f"| `{s['prompt']}` | `{s['completion']}` | `{s['expected']}` | {'yes' if s['correct'] else 'no'} |"
                  for s in r[f"samples_{when}"]]
    return "\n".join(lines) + "\n"
