"""The arithmetic example from a bare clone: data, tokenizer, a random-init Qwen2 model, SFT, GRPO, report.

    python -m examples.arithmetic.run [--seed 0 [1 ...]] [--engine hf|vllm] [--out runs/arithmetic]

For each seed (data sampling, model init, pretraining, SFT and RL):

1. data (``examples.arithmetic.data``): SFT chats, RL prompts with their ``answer``, the held-out
   validation split (the same for every seed); tokenizer + model (``examples.arithmetic.model``):
   byte-level BPE on the task's text, Qwen2 architecture with the real vocabulary size (151,936),
   random init;
2. pretraining stand-in (``examples.arithmetic.pretrain``): the full-vocabulary loss at a small
   vocabulary's cost, 2000 steps on the SFT chats;
3. SFT: ``python -m fastrlhf sft --config examples/arithmetic/sft.yaml``;
4. greedy validation accuracy of the SFT model (``examples.arithmetic.evaluate``: plain transformers);
5. GRPO: ``python -m fastrlhf train --config examples/arithmetic/grpo.yaml`` with
   ``rollout.engine`` = ``--engine`` (the trainer also validates on the same split: eval/accuracy);
6. greedy validation accuracy of the GRPO model; 7. ``<out>/report.json`` and ``report.md``.

Stages 1-4 are cached per seed (a stamp holds a hash of the code and configs they came from), so a
second engine reuses the SFT model; ``--fresh`` redoes them. Each child's output is in ``<out>/logs/``.
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
from fastrlhf.distributed import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SFT_CONFIG = os.path.join(HERE, "sft.yaml")
GRPO_CONFIG = os.path.join(HERE, "grpo.yaml")

__all__ = ["run_one", "main"]


def _say(text: str) -> None:
    from tqdm import tqdm

    tqdm.write(text)


def _fastrlhf(command: str, config_path: str, sets: list[str]) -> list[str]:
    overrides = [a for s in sets for a in ("--set", s)]
    return [sys.executable, "-m", "fastrlhf", command, "--config", config_path, *overrides]


def _read_stamp(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, "stamp.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _eval_series(metrics_path: str) -> list[dict]:
    """The trainer's own validation: ``[{"step", "accuracy", "reward_mean"}]`` from its metrics.jsonl."""
    out = []
    try:
        with open(metrics_path) as f:
            for line in f:
                m = json.loads(line)
                if "eval/accuracy" in m:
                    out.append({"step": m["step"], "accuracy": m["eval/accuracy"],
                                "reward_mean": m.get("eval/reward_mean")})
    except (OSError, ValueError):
        pass
    return out


def run_one(seed: int, engine: str, out: str, threads: int = 2, fresh: bool = False, ranks: int = 1,
            pretrain_steps: int = 2000, sft_set=(), grpo_set=(), progress: bool = True,
            val_size: int | None = None) -> dict:
    """Run the example for one seed and rollout engine; returns its report entry."""
    import torch

    from examples.arithmetic import data as task_data
    from examples.arithmetic import model as task_model
    from examples.arithmetic.evaluate import evaluate, outside_mass

    torch.set_num_threads(threads)  # the evaluations run in this process
    w = os.path.join(out, f"seed{seed}")
    paths = {name: os.path.join(w, name) for name in ("data", "init", "pretrain", "sft")}
    logs = os.path.join(out, "logs")
    data_file = {name: os.path.join(paths["data"], f"{name}.jsonl") for name in ("sft", "rl", "val")}
    pretrained = os.path.join(paths["pretrain"], "final")
    sft_final = os.path.join(paths["sft"], "final")
    times: dict[str, float] = {}
    code = [os.path.join(HERE, f) for f in ("data.py", "model.py", "pretrain.py", "evaluate.py", "reward.py")]
    key_parts = [*code, SFT_CONFIG, pretrain_steps, list(sft_set), seed, threads, "v3"]
    if val_size is not None:  # a smaller validation split (tests); the default's key stays as it was
        key_parts.append(("val_size", val_size))
    key = stamp_key(*key_parts)
    stamp = None if fresh else _read_stamp(sft_final)
    _say(f"== seed {seed}, rollout engine {engine} -> {w}")
    if stamp is not None and stamp.get("key") == key:
        _say(f"[1-4/7] data, model, pretraining, SFT, evaluation: cached in {sft_final} (--fresh redoes them)")
        times.update(stamp["times"])
        before, init_info = stamp["before"], stamp["init"]
    else:
        _say("[1/7] data + tokenizer + model")
        t0 = time.perf_counter()
        task_data.write_data(paths["data"], seed=seed)
        if val_size is not None:  # the first val_size questions of the fixed split
            with open(data_file["val"]) as f:
                rows = f.readlines()[:val_size]
            with open(data_file["val"], "w") as f:
                f.writelines(rows)
        init_info = task_model.make_initial_model(paths["init"], task_data.corpus_text(seed), seed=seed)
        times["data_and_model"] = time.perf_counter() - t0
        _say(f"    Qwen2 {init_info['parameters'] / 1e6:.1f}M parameters "
             f"({init_info['embedding_parameters'] / 1e6:.1f}M in the tied {init_info['model_vocab']}-row embedding), "
             f"tokenizer of {init_info['tokenizer_vocab']} tokens")

        _say(f"[2/7] pretrain ({pretrain_steps} steps, examples/arithmetic/pretrain.py)")
        cmd = [sys.executable, "-m", "examples.arithmetic.pretrain", "--init", paths["init"], "--data",
               data_file["sft"], "--out", paths["pretrain"], "--steps", str(pretrain_steps), "--seed", str(seed)]
        times["pretrain"] = run_stage("pretrain", cmd, os.path.join(logs, f"pretrain-seed{seed}.log"),
                                      os.path.join(paths["pretrain"], "metrics.jsonl"), pretrain_steps, progress,
                                      child_env(threads), ("loss",))

        _say("[3/7] SFT (fastrlhf sft, sft.yaml)")
        sets = [f"output_dir={paths['sft']}", f"model.path={pretrained}", f"data.path={data_file['sft']}",
                f"seed={seed}", *sft_set]
        steps = resolved_config("sft", SFT_CONFIG, sets).trainer.max_steps
        shutil.rmtree(paths["sft"], ignore_errors=True)
        times["sft"] = run_stage("SFT", _fastrlhf("sft", SFT_CONFIG, sets), os.path.join(logs, f"sft-seed{seed}.log"),
                                 os.path.join(paths["sft"], "metrics.jsonl"), steps, progress, child_env(threads),
                                 ("loss",))

        _say("[4/7] evaluate the SFT model (greedy, held-out split)")
        t0 = time.perf_counter()
        before = evaluate(sft_final, data_file["val"])
        before["outside_mass"] = outside_mass(sft_final, data_file["sft"])
        times["evaluate_sft"] = time.perf_counter() - t0
        padded = init_info["model_vocab"] - init_info["tokenizer_vocab"]
        _say(f"    probability on the {padded} padded vocabulary rows: "
             f"{before['outside_mass']:.3%} per answer token")
        with open(os.path.join(sft_final, "stamp.json"), "w") as f:
            json.dump({"key": key, "times": times, "before": before, "init": init_info}, f, indent=1)
    _say(f"    accuracy after SFT: {_accuracy_line(before)}")

    _say(f"[5/7] GRPO (fastrlhf train, rollout.engine {engine}, {ranks} rank{'s' if ranks > 1 else ''})")
    run_dir = os.path.join(w, f"grpo-{engine}")
    sets = [f"output_dir={run_dir}", f"model.path={sft_final}", f"data.prompts={data_file['rl']}",
            f"eval.data={data_file['val']}", f"rollout.engine={engine}", f"seed={seed}", *grpo_set]
    rl_config = resolved_config("train", GRPO_CONFIG, sets)
    shutil.rmtree(run_dir, ignore_errors=True)
    if ranks > 1:
        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        cmd = [deepspeed, "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module", "fastrlhf",
               *_fastrlhf("train", GRPO_CONFIG, sets)[3:]]
    else:
        cmd = _fastrlhf("train", GRPO_CONFIG, sets)
    times["grpo"] = run_stage("GRPO", cmd, os.path.join(logs, f"grpo-seed{seed}-{engine}.log"),
                              os.path.join(run_dir, "metrics.jsonl"), rl_config.trainer.max_steps, progress,
                              child_env(max(1, threads // ranks)), ("reward/correctness",))

    _say("[6/7] evaluate the GRPO model (greedy, held-out split)")
    t0 = time.perf_counter()
    after = evaluate(os.path.join(run_dir, "final"), data_file["val"])
    after["outside_mass"] = outside_mass(os.path.join(run_dir, "final"), data_file["sft"])
    times["evaluate_grpo"] = time.perf_counter() - t0

    entry = {"seed": seed, "engine": engine, "before": before, "after": after,
             "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1),
             "trainer_eval": _eval_series(os.path.join(run_dir, "metrics.jsonl")),
             "seconds": {k: round(v, 1) for k, v in times.items()}, "model": init_info,
             "grpo": {"steps": rl_config.trainer.max_steps, "prompts_per_step": rl_config.trainer.prompts_per_step,
                      "n": rl_config.rollout.n, "lr": rl_config.trainer.lr, "ranks": ranks},
             "threads": threads, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
             "date": time.strftime("%Y-%m-%d %H:%M")}
    _say(f"[7/7] after GRPO: {_accuracy_line(after)}")
    _say(f"    {before['accuracy']:.1%} -> {after['accuracy']:.1%} ({entry['gain_points']:+.1f} points) on "
         f"{after['n']} held-out problems")
    return entry


def _accuracy_line(result: dict) -> str:
    kinds = ", ".join(f"{k} {v:.0%}" for k, v in result["per_kind"].items())
    return (f"{result['accuracy']:.1%} of {result['n']} ({kinds}); answer stated in {1 - result['no_answer']:.0%}, "
            f"right last number in {result['lenient_accuracy']:.1%}, work shown in {result['worked']:.0%}")


def _write_report(out: str, entries: list[dict]) -> dict:
    """Merge ``entries`` into ``<out>/report.json`` (one entry per seed and engine) and write report.md."""
    path = os.path.join(out, "report.json")
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        report = {"runs": {}}
    for e in entries:
        report["runs"][f"seed{e['seed']}-{e['engine']}"] = e
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    lines = ["| seed | engine | accuracy after SFT | after GRPO | gain | right last number | work shown | pretrain s | "
             "SFT s | GRPO s | total s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, e in sorted(report["runs"].items()):
        s = e["seconds"]
        lines.append(f"| {e['seed']} | {e['engine']} | {e['before']['accuracy']:.1%} | {e['after']['accuracy']:.1%} | "
                     f"{e['gain_points']:+.1f} | {e['before']['lenient_accuracy']:.1%} -> "
                     f"{e['after']['lenient_accuracy']:.1%} | "
                     f"{e['before']['worked']:.0%} -> {e['after']['worked']:.0%} | "
                     f"{s.get('pretrain', 0):.0f} | {s.get('sft', 0):.0f} | {s.get('grpo', 0):.0f} | "
                     f"{sum(s.values()):.0f} |")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="one run per seed (default 0)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="GRPO's rollout.engine")
    parser.add_argument("--out", default="runs/arithmetic")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads per process (default 2; the results depend on it)")
    parser.add_argument("--ranks", type=int, default=1, help="GRPO processes (deepspeed launcher when > 1)")
    parser.add_argument("--fresh", action="store_true", help="redo data, model and SFT even if cached")
    parser.add_argument("--pretrain-steps", type=int, default=2000)
    parser.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE", help="override sft.yaml")
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE", help="override grpo.yaml")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--val-size", type=int, default=None, help="validate on the first N held-out questions")
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
            entries.append(run_one(seed, args.engine, out, args.threads, args.fresh, args.ranks, args.pretrain_steps,
                                   args.sft_set, args.grpo_set, progress=not args.no_progress,
                                   val_size=args.val_size))
            _write_report(out, entries)
    except StageFailed as exc:
        print_failure(exc, "make arithmetic")
        return 1
    _say(f"\nreport: {os.path.join(out, 'report.json')} ({time.perf_counter() - started:.0f} s in all)")
    with open(os.path.join(out, "report.md")) as f:
        _say(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
