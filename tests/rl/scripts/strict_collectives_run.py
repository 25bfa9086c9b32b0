"""Run under ``deepspeed --num_gpus 2``: fastrlhf commands one after another, under strict collectives.

argv: <plan.json> <log dir>. The plan is a list of CLI argument lists (``["train", "--config", ...]``),
run in-process through ``fastrlhf.cli.main`` on every rank; any non-zero exit stops the rank with
that code. Strict collectives (tests/helpers/strict_collectives.py) declare the default group NCCL, as on
a GPU node, so a host tensor handed to it raises here as NCCL would raise there. Each rank writes
``<log dir>/strict-rank<r>.json`` with the counts of checked calls.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: helpers

from helpers.strict_collectives import install  # noqa: E402


def main():
    plan_path, log_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    install(os.path.join(log_dir, f"strict-rank{os.environ['RANK']}.json"))
    from fastrlhf.cli import main as cli

    with open(plan_path) as f:
        plan = json.load(f)
    for argv in plan:
        rc = cli(argv)
        if rc != 0:
            from fastrlhf.cli import exit_with

            exit_with(rc)


if __name__ == "__main__":
    main()
    from fastrlhf.cli import exit_with

    exit_with(0)  # as a launched fastrlhf rank leaves: without the c10d stores' exit-time abort
