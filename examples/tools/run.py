"""``make tools``: a small Qwen2-shaped model learns to call a calculator, from a bare clone, on a CPU.

    python -m examples.tools.run [--seed 0 [1 ...]] [--out runs/tools] [--fresh]

For each seed, two arms trained the same way with the same budget, one with the tool and one without:

1. data (``examples.tools.data``: products of two 4-digit numbers, the calculator's demonstrations) and the
   model (``examples.tools.model``: the arithmetic example's Qwen2 shape, 151,936-row vocabulary, random init);
2. pretraining stand-in (``examples.tools.pretrain``): whole episodes at a small vocabulary's cost;
3. SFT on a few hundred demonstrations (``fastrlhf sft --config examples/tools/sft.yaml``);
4. GRPO (``fastrlhf train --config examples/tools/grpo.yaml``): episodes in which the policy may call the
   calculator (``rollout.tools``), or single turns for the no-tool arm; the trainer validates greedily on the
   200 held-out questions before RL (step 0) and after it;
5. ``<out>/report.md`` and ``report.json``: accuracy before and after RL with and without the tool, tool calls
   per episode, three sample episodes, stage times.

Stages 1-3 are cached per seed and arm (a stamp of the code and configs they came from); ``--fresh`` redoes them.
Each child's output is in ``<out>/logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time

from fastrlhf.demo.stages import StageFailed, child_env, print_failure, resolved_config, run_stage, stamp_key

HERE = os.path.dirname(os.path.abspath(__file__))
SFT_CONFIG = os.path.join(HERE, "sft.yaml")
GRPO_CONFIG = os.path.join(HERE, "grpo.yaml")
DATA_FILES = ("pretrain-tool", "pretrain-direct", "sft-tool", "sft-direct", "rl", "val")  # examples.tools.data
ARMS = ("tool", "direct")
PRETRAIN_STEPS = 2000  # both arms: the same budget
PRETRAIN_LR = 2e-3

__all__ = ["main", "run_arm"]


def _say(text: str) -> None:
    from tqdm import tqdm

    tqdm.write(text)


def _fastrlhf(command: str, config_path: str, sets: list[str]) -> list[str]:
    overrides = [a for s in sets for a in ("--set", s)]
    return [sys.executable, "-m", "fastrlhf", command, "--config", config_path, *overrides]


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prepare(seed: int, out: str, fresh: bool, val_size: int | None = None) -> dict:
    """Stage 1, shared by both arms: the data files and the initial model (cached)."""
    from examples.tools import data as task_data
    from examples.tools.model import make_initial_model

    w = os.path.join(out, f"seed{seed}")
    paths = {"data": os.path.join(w, "data"), "init": os.path.join(w, "init")}
    key = stamp_key(*(os.path.join(HERE, f) for f in ("data.py", "model.py", "calculator.py")), seed, val_size)
    stamp = None if fresh else _read_json(os.path.join(paths["init"], "stamp.json"))
    # The data files sit beside the stamped model: without them the cached stage is not whole.
    files = (os.path.join(paths["data"], f"{name}.jsonl") for name in DATA_FILES)
    if stamp is not None and stamp.get("key") == key and all(os.path.isfile(f) for f in files):
        _say("[1/4] data + tokenizer + model: cached")
        return {**paths, **stamp}
    _say("[1/4] data + tokenizer + model")
    started = time.perf_counter()
    task_data.write_data(paths["data"], seed=seed)
    if val_size is not None:  # the first val_size questions of the fixed split (tests)
        val = os.path.join(paths["data"], "val.jsonl")
        with open(val) as f:
            rows = f.readlines()[:val_size]
        with open(val, "w") as f:
            f.writelines(rows)
    info = make_initial_model(paths["init"], seed=seed)
    stamp = {"key": key, "model": info, "seconds": round(time.perf_counter() - started, 1)}
    with open(os.path.join(paths["init"], "stamp.json"), "w") as f:
        json.dump(stamp, f)
    return {**paths, **stamp}


def run_arm(arm: str, seed: int, out: str, base: dict, threads: int, fresh: bool, progress: bool,
            pretrain_steps: int = PRETRAIN_STEPS, sft_set=(), grpo_set=()) -> dict:
    """Stages 2-4 of one arm; returns its report entry."""
    from examples.tools.data import CALCULATOR
    from examples.tools.pretrain import pretrain
    from fastrlhf.rollout.tools import load_toolbox

    w = os.path.join(out, f"seed{seed}")
    logs = os.path.join(out, "logs")
    data = {name: os.path.join(base["data"], f"{name}.jsonl") for name in
            ("pretrain-tool", "pretrain-direct", "sft-tool", "sft-direct", "rl", "val")}
    tools = arm == "tool"
    pre_dir, sft_dir, rl_dir = (os.path.join(w, f"{stage}-{arm}") for stage in ("pretrain", "sft", "grpo"))
    sft_final = os.path.join(sft_dir, "final")
    seconds: dict[str, float] = {}
    sft_sets = [f"output_dir={sft_dir}", f"model.path={os.path.join(pre_dir, 'final')}",
                f"data.path={data[f'sft-{arm}']}", f"seed={seed}", *([] if tools else ["data.tools=[]"]), *sft_set]
    key = stamp_key(base["key"], os.path.join(HERE, "pretrain.py"), SFT_CONFIG, pretrain_steps, PRETRAIN_LR, sft_sets,
                    threads)
    stamp = None if fresh else _read_json(os.path.join(sft_final, "stamp.json"))
    if stamp is not None and stamp.get("key") == key:
        _say(f"[2-3/4] {arm}: pretraining + SFT cached in {sft_final}")
        seconds.update(stamp["seconds"])
    else:
        _say(f"[2/4] {arm}: pretraining stand-in ({pretrain_steps} steps)")
        import torch

        torch.set_num_threads(threads)
        started = time.perf_counter()
        pretrain(base["init"], data[f"pretrain-{arm}"], pre_dir, pretrain_steps,
                 load_toolbox([CALCULATOR]).schemas if tools else None, lr=PRETRAIN_LR, seed=seed)
        seconds["pretrain"] = round(time.perf_counter() - started, 1)
        _say(f"[3/4] {arm}: SFT (fastrlhf sft, sft.yaml)")
        steps = resolved_config("sft", SFT_CONFIG, sft_sets).trainer.max_steps
        shutil.rmtree(sft_dir, ignore_errors=True)
        seconds["sft"] = round(run_stage(f"SFT {arm}", _fastrlhf("sft", SFT_CONFIG, sft_sets),
                                         os.path.join(logs, f"sft-{arm}-seed{seed}.log"),
                                         os.path.join(sft_dir, "metrics.jsonl"), steps, progress, child_env(threads),
                                         ("loss",)), 1)
        with open(os.path.join(sft_final, "stamp.json"), "w") as f:
            json.dump({"key": key, "seconds": seconds}, f)

    _say(f"[4/4] {arm}: GRPO (fastrlhf train, grpo.yaml{'' if tools else ', rollout.tools=[]'})")
    sets = [f"output_dir={rl_dir}", f"model.path={sft_final}", f"data.prompts={data['rl']}",
            f"eval.data={data['val']}", f"seed={seed}", *([] if tools else ["rollout.tools=[]"]), *grpo_set]
    config = resolved_config("train", GRPO_CONFIG, sets)
    shutil.rmtree(rl_dir, ignore_errors=True)
    seconds["grpo"] = round(run_stage(f"GRPO {arm}", _fastrlhf("train", GRPO_CONFIG, sets),
                                      os.path.join(logs, f"grpo-{arm}-seed{seed}.log"),
                                      os.path.join(rl_dir, "metrics.jsonl"), config.trainer.max_steps, progress,
                                      child_env(threads), ("reward/correctness",)), 1)
    return _arm_entry(arm, seed, rl_dir, config, seconds)


def _eval_at(rl_dir: str, step: int) -> dict:
    """The trainer's validation at ``step``: accuracy, tool calls per episode, the episodes."""
    with open(os.path.join(rl_dir, "eval", f"step-{step}.jsonl")) as f:
        records = [json.loads(line) for line in f]
    called = [r for r in records if r.get("tool_calls")]
    # The calculator is always right: accuracy where it was called measures copying its result.
    return {"accuracy": sum(r["correct"] for r in records) / len(records), "questions": len(records),
            "called": len(called), "accuracy_when_called": sum(r["correct"] for r in called) / max(1, len(called)),
            "tool_calls_per_episode": sum(r.get("tool_calls") or 0 for r in records) / len(records),
            "turns_per_episode": sum(r.get("turns") or 1 for r in records) / len(records), "records": records}


def _arm_entry(arm: str, seed: int, rl_dir: str, config, seconds: dict) -> dict:
    before, after = _eval_at(rl_dir, 0), _eval_at(rl_dir, config.trainer.max_steps)
    samples = [{"question": r["messages"][-1]["content"] if "messages" in r else r.get("prompt", "")[-80:],
                "answer": r.get("answer"), "correct": r["correct"], "episode": r["completion"]}
               for r in after.pop("records")[:3]]
    before.pop("records")
    with open(os.path.join(rl_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    calls = [m["tools/calls_per_episode"] for m in steps if "tools/calls_per_episode" in m]
    return {"arm": arm, "seed": seed, "before": before, "after": after, "samples": samples,
            "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1),
            "train_calls_per_episode": calls, "seconds": seconds,
            "grpo": {"steps": config.trainer.max_steps, "prompts_per_step": config.trainer.prompts_per_step,
                     "n": config.rollout.n, "lr": config.trainer.lr, "max_turns": config.rollout.max_turns,
                     "max_new_tokens": config.rollout.max_new_tokens}}


def _when_called(summary: dict) -> str:
    return f"{summary['accuracy_when_called']:.1%} of {summary['called']}" if summary["called"] else "-"


def _write_report(out: str, entries: list[dict], meta: dict) -> None:
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({**meta, "runs": entries}, f, indent=1)
    lines = ["# make tools", "", f"{meta['date']}, {meta['machine']}, {meta['threads']} threads, "
             f"{meta['seconds']:.0f} s in all.", "",
             "| seed | arm | accuracy before RL | after RL | gain | tool calls per episode (after) | right when "
             "called (after) | pretrain s | SFT s | GRPO s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        s = e["seconds"]
        lines.append(f"| {e['seed']} | {e['arm']} | {e['before']['accuracy']:.1%} | {e['after']['accuracy']:.1%} | "
                     f"{e['gain_points']:+.1f} | {e['after']['tool_calls_per_episode']:.2f} | "
                     f"{_when_called(e['after'])} | "
                     f"{s.get('pretrain', 0):.0f} | {s.get('sft', 0):.0f} | {s.get('grpo', 0):.0f} |")
    by_seed = {}
    for e in entries:
        by_seed.setdefault(e["seed"], {})[e["arm"]] = e["after"]["accuracy"]
    lines += ["", "With the tool minus without it, after RL: " + ", ".join(
        f"seed {s}: {100 * (a['tool'] - a['direct']):+.1f} points" for s, a in by_seed.items()
        if "tool" in a and "direct" in a), ""]
    for e in entries:
        if e["arm"] != "tool":
            continue
        lines += [f"## Sample episodes, seed {e['seed']}, after RL (greedy)", ""]
        for sample in e["samples"]:
            lines += [f"{'right' if sample['correct'] else 'wrong'} (answer {sample['answer']}):", "", "```",
                      sample["episode"], "```", ""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default="runs/tools")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process (the results depend on it)")
    parser.add_argument("--fresh", action="store_true", help="redo data, model, pretraining and SFT")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS)
    parser.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE", help="override sft.yaml")
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE", help="override grpo.yaml")
    parser.add_argument("--val-size", type=int, default=None, help="validate on the first N held-out questions")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    entries = []
    try:
        for seed in args.seed:
            base = prepare(seed, out, args.fresh, args.val_size)
            for arm in args.arms:
                entries.append(run_arm(arm, seed, out, base, args.threads, args.fresh, not args.no_progress,
                                       args.pretrain_steps, args.sft_set, args.grpo_set))
                e = entries[-1]
                _say(f"    {arm}: {e['before']['accuracy']:.1%} -> {e['after']['accuracy']:.1%} on "
                     f"{e['after']['questions']} held-out questions, "
                     f"{e['after']['tool_calls_per_episode']:.2f} tool calls per episode")
    except StageFailed as exc:
        print_failure(exc, "make tools")
        return 1
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "threads": args.threads, "seconds": round(time.perf_counter() - started, 1)}
    _write_report(out, entries, meta)
    _say(f"\nreport: {os.path.join(out, 'report.md')} ({meta['seconds']:.0f} s in all)")
    with open(os.path.join(out, "report.md")) as f:
        _say(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
