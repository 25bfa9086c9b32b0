"""Command line: ``fastrlhf <command>`` or, under the launcher, ``deepspeed -m fastrlhf <command>``."""

from __future__ import annotations

import argparse
import sys

from fastrlhf.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastrlhf",
        description="Kernel-accelerated RLHF: PPO and GRPO on DeepSpeed ZeRO with vLLM rollouts, plus SFT and "
        "reward-model training.",
    )
    parser.add_argument("--version", action="version", version=f"fastrlhf {__version__}")
    parser.add_subparsers(dest="command", metavar="command")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
