"""``python -m fastrlhf.demo [--algo grpo|ppo] [--reward rule|model] [--fresh] [--matrix]`` (``make demo``,
``make demo-matrix``)."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastrlhf.demo",
                                     description="The embedded default job: pretrain a tiny model on CPU, then RL "
                                                 "teaches it which script each prompt asks for.")
    parser.add_argument("--algo", choices=("grpo", "ppo"), default="grpo")
    parser.add_argument("--reward", choices=("rule", "model"), default="rule",
                        help="rule: exact match; model: a learned script classifier (fastrlhf rm)")
    parser.add_argument("--fresh", action="store_true", help="redo the cached stages (data, pretraining, RM)")
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra --set for the RL config (repeatable)")
    parser.add_argument("--pretrain-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rm-set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--pretrain-seed", type=int, default=0, help="data order, model init and pretraining")
    parser.add_argument("--rl-seed", type=int, default=0, help="RL sampling and minibatch order")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of the single-process stages (pretrain, RM, evaluation); each RL rank "
                             "gets threads // 2")
    parser.add_argument("--matrix", action="store_true",
                        help="run the seed matrix instead (fastrlhf.demo.matrix) and write <workdir>/matrix.md")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")

    if args.matrix:
        from fastrlhf.demo.matrix import run_matrix

        return run_matrix(args.workdir, progress=not args.no_progress)

    from fastrlhf.demo.pipeline import DemoOptions, run_demo
    from fastrlhf.demo.stages import StageFailed, print_failure

    opts = DemoOptions(algo=args.algo, reward=args.reward, fresh=args.fresh, workdir=args.workdir,
                       pretrain_set=args.pretrain_set, rm_set=args.rm_set, rl_set=args.rl_set,
                       progress=not args.no_progress, pretrain_seed=args.pretrain_seed, rl_seed=args.rl_seed,
                       threads=args.threads)
    started = time.perf_counter()
    try:
        report = run_demo(opts)
    except StageFailed as exc:
        print_failure(exc, "demo")
        return 1
    run_dir = f"{args.workdir}/{args.algo}-{args.reward}"
    print(f"\nreport: {run_dir}/report.md (plots: {', '.join(report['plots'].values())})")
    from fastrlhf.demo.report import per_script_line

    per_script = per_script_line(report["per_script_after"])
    print(f"accuracy before RL: {report['accuracy_before']:.1%}  ->  after {report['steps']} "
          f"{args.algo.upper()} steps: {report['accuracy_after']:.1%} (digits / lower / upper: {per_script})   "
          f"(total {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
