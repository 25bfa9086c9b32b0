"""``fastrlhf plan --config X.yaml [--gpus N] [--gpu-memory 80GiB] [--device cuda|cpu]``: the command that
prints :func:`fastrlhf.memory.plan.plan_memory`'s plan, made before a model is downloaded (config.json only)."""

from __future__ import annotations

import contextlib
import sys

from fastrlhf.config.errors import ConfigError
from fastrlhf.memory.plan import GiB, PlanError, parse_bytes, plan_memory

__all__ = ["PLAN_HELP", "add_arguments", "load_plan_config", "main"]


@contextlib.contextmanager
def _config_json_only():
    """Validate as ``fastrlhf train`` does, except that model folders need only their config.json and
    data files need not exist yet: a plan is made before a model is downloaded."""
    from fastrlhf.config import checks

    saved = checks._check_path, checks._check_model_folder
    checks._check_path = lambda path, key, base: None
    checks._check_model_folder = lambda path, key, base: {}
    try:
        yield
    finally:
        checks._check_path, checks._check_model_folder = saved


def load_plan_config(path: str, overrides: list[str] | None = None, device: str = "cuda",
                     imports: list[str] | None = None):
    """The ``TrainConfig`` of a YAML file, validated except for the files a plan does not read; ``imports`` as
    ``fastrlhf train --import`` (a policy loss or estimator the config names is checked against the registry)."""
    from fastrlhf.config import load_config

    with _config_json_only():
        return load_config(path, "train", overrides, on_gpu=device == "cuda", imports=imports)


PLAN_HELP = "whether an RL run fits in memory: per-GPU bytes by component, from the config and config.json"


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, help="run config of `fastrlhf train` (YAML)")
    parser.add_argument("--gpus", type=int, default=1, help="ranks (GPUs, or CPU processes) of the run (default 1)")
    parser.add_argument("--gpu-memory", dest="gpu_memory", default=None, metavar="SIZE",
                        help="memory per GPU in GiB, e.g. 80, or with a unit: 80GiB, 80GB, 81920MiB (default: this "
                             "machine's GPU; on --device cpu: MemAvailable over the ranks)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="plan a GPU (default) or CPU run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set deepspeed.zero_stage=3 (repeatable)")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first, as `fastrlhf train --import` does (repeatable)")


def main(args) -> int:
    """``fastrlhf plan``: print the plan (exit 0), or one line saying why not (exit 2)."""
    try:
        if args.gpus < 1:
            raise PlanError(f"--gpus must be >= 1, got {args.gpus}")
        try:
            budget = parse_bytes(args.gpu_memory, unit=GiB) if args.gpu_memory is not None else None
        except ValueError as exc:
            raise PlanError(f"--gpu-memory: {exc}") from None
        config = load_plan_config(args.config, args.overrides, args.device, args.imports)
        plan = plan_memory(config, args.gpus, budget, args.device)
        print(plan.table())
        plan.check()
    except PlanError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return 0
