"""Command line: ``fastrlhf <command>`` or, under the launcher, ``deepspeed --module fastrlhf <command>``.

The config is read and validated before anything heavy is imported, so a bad config fails in a
fraction of a second with one line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from fastrlhf import __version__

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C

COMMANDS = {
    "train": "PPO or GRPO on DeepSpeed ZeRO with vLLM or HF rollouts",
    "sft": "supervised fine-tuning (loss on response tokens)",
    "rm": "reward model: pairwise Bradley-Terry or classifier",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastrlhf",
        description="Kernel-accelerated RLHF: PPO and GRPO on DeepSpeed ZeRO with vLLM rollouts, plus SFT and "
        "reward-model training.",
    )
    parser.add_argument("--version", action="version", version=f"fastrlhf {__version__}")
    # The deepspeed launcher passes --local_rank=N before the command; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", required=True, help="run config (YAML)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set trainer.lr=1e-5 (repeatable; YAML scalars)")
        p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
        p.add_argument("--overwrite", action="store_true",
                       help="replace the earlier run's files in output_dir: set aside at the start, deleted once "
                            "this run has logged a step, put back if it ends before (a used output_dir is refused "
                            "without --resume or --overwrite)")
        p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                       help="import MODULE before the config is checked, e.g. one that registers a policy loss, "
                            "an advantage estimator or a reward (repeatable; also the config key imports)")
        p.add_argument("--dry-run", action="store_true",
                       help="run the checks the run makes before a model loads (config, reward functions, data), "
                            "print the config with every auto setting resolved for this machine, exit")
        p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    # No torch: plans answer before anything heavy loads.
    from fastrlhf.memory.plan_command import PLAN_HELP, add_arguments

    add_arguments(sub.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP))
    return parser


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _error(prefix: str, message: str) -> None:
    """An error every rank raises alike (a check the ranks agree on), said once: on rank 0."""
    if _is_main_process():
        print(f"{prefix}: {message}", file=sys.stderr)


def _rank_error(line: str, exc: BaseException) -> None:
    """``line`` (one or more lines) for ``exc``, raised once the process group started. One that every rank raised
    alike (``fastrlhf.distributed.comm.agreed``) is said once, on rank 0. Any other may have been raised on this
    rank alone, while rank 0 waits for it in a collective (until this rank's exit closes its connections, or
    FASTRLHF_DIST_TIMEOUT): each rank that raised it says it, naming itself, ``[rank 3] config error: ...``."""
    from fastrlhf.distributed import comm, ranks

    if comm.is_agreed(exc) or ranks.world_size() <= 1:
        _say(line)
        return
    name = f"[rank {ranks.rank()}] "
    print(name + line.replace("\n", "\n" + name), file=sys.stderr, flush=True)


def _say(line: str, local: bool = False) -> None:
    """``line`` on rank 0; with ``local``, on the first rank of this node too (what only it knows)."""
    if _is_main_process() or (local and os.environ.get("LOCAL_RANK", "0") == "0"):
        print(line, file=sys.stderr, flush=True)


def _data_error_lines(exc) -> str:
    """A DataError's bad lines, each as its own ``data error:`` line."""
    return "data error: " + str(exc).replace("\n", "\ndata error: ")


def _group_started() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: no group (and no torch import for a config error)
    return dist is not None and dist.is_available() and dist.is_initialized()


def _failed_checks(line: str, gate: bool = True) -> int:
    """This rank's own check failed (``line``). Before the process group on several nodes, the other nodes
    may have passed theirs and wait at the start gate: tell them (``fastrlhf.distributed.multinode``).
    Not with ``gate`` false (``--dry-run``): no rank goes to the gate then, and rank 0 would wait there for
    the others until FASTRLHF_DIST_TIMEOUT. Returns exit 2."""
    from fastrlhf.distributed import multinode

    several = multinode.is_multi_node() and not _group_started()
    _say(line, local=several)
    if several and gate:
        try:
            multinode.start_gate(failure=line)
        except multinode.NodeError as exc:
            _say(str(exc), local=True)
    return EXIT_BAD_INPUT


def _lost_peer(config, reason: str) -> None:
    """A collective failed because a peer is gone: one line with the checkpoint to resume from, then exit at
    once (tearing down a process group, or vLLM, with a dead peer can block: nothing is left to save)."""
    from fastrlhf.distributed import DEFAULT_TIMEOUT_S

    timeout = os.environ.get("FASTRLHF_DIST_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    latest = _last_checkpoint(config)
    resume = (f"the last complete checkpoint is {latest}: restart every node with --resume" if latest else
              "no checkpoint was written yet: restart the run")
    _say(f"distributed error: lost contact with another rank ({reason}): a rank stopped on an error of its own (its "
         f"line says which), a node died, was killed, or did not answer for FASTRLHF_DIST_TIMEOUT ({timeout} s); "
         f"{resume}", local=True)
    if restored := _settle_overwrite(False):  # os._exit runs no finally
        _say(f"note: --overwrite: the earlier run in {config.output_dir} is back ({', '.join(restored)})")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILED)


def _claim_output_dir(output_dir: str, resume: bool, overwrite: bool) -> None:
    """A used ``output_dir`` is refused without ``--resume`` or ``--overwrite``, and one that cannot be written
    is refused always (``fastrlhf.engine.outputs``). With ``--overwrite`` rank 0 moves the earlier run's files
    aside once every rank has passed every check (a run that fails its checks moves nothing) and before the
    process group starts: the other ranks wait for it in the rendezvous, and none writes into ``output_dir``
    before the group is up, so none races the move (``fastrlhf.distributed.launch.before_group``). They are
    deleted once this run is under way, and put back by :func:`_settle_overwrite` if it ends before. The
    other ranks do not look: the folder is rank 0's to clear."""
    from fastrlhf.config import ConfigError
    from fastrlhf.distributed.launch import before_group
    from fastrlhf.engine.outputs import Overwrite, check_output_dir

    if resume and overwrite:
        raise ConfigError("--overwrite", "conflicts with --resume (--resume continues the run in output_dir, "
                                         "--overwrite deletes it)")
    if overwrite and not _is_main_process():
        return
    check_output_dir(output_dir, resume, overwrite)
    if overwrite:
        def set_aside() -> None:
            global _overwrite
            _overwrite = Overwrite(output_dir, _say)
            _overwrite.start()

        before_group(set_aside)


# Rank 0's --overwrite of this command once the earlier run is set aside (fastrlhf.engine.outputs.Overwrite).
_overwrite = None


def _settle_overwrite(succeeded: bool) -> list[str]:
    """The command ends: the earlier run that ``--overwrite`` set aside is deleted if this run succeeded or got
    under way, else put back; returns what was put back ([] if nothing)."""
    global _overwrite
    overwrite, _overwrite = _overwrite, None
    if overwrite is None:
        return []
    from fastrlhf.config import ConfigError

    try:
        return overwrite.finish(succeeded)
    except (OSError, ConfigError) as exc:
        _say(f"warning: --overwrite: could not put the earlier run back from {overwrite.aside} ({exc}); move its "
             f"files back into {overwrite.output_dir} by hand")
        return []


def _resume_command(args) -> str:
    """The command line that continues this run: this one with ``--resume`` (and without ``--overwrite``,
    which would delete it)."""
    import shlex

    words = [args.command, "--config", args.config]
    for item in args.overrides:
        words += ["--set", item]
    for module in args.imports:
        words += ["--import", module]
    line = shlex.join([*words, "--resume"])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched: the same launcher options, this command
        return f"`deepspeed <the same options> --module fastrlhf {line}`"
    return f"`fastrlhf {line}`"


def _last_checkpoint(config) -> str | None:
    """The run's latest complete checkpoint, or None (none yet, or its folder cannot be read)."""
    from fastrlhf.engine.checkpoint import latest_checkpoint

    try:
        return latest_checkpoint(config.output_dir)
    except OSError:
        return None


def _interrupted(config, args) -> None:
    """Ctrl-C: one line naming the checkpoint to continue from and the command that does, no traceback."""
    latest = _last_checkpoint(config)
    where = (f"the last checkpoint is {latest}" if latest else
             "no checkpoint was written yet (--resume then starts again at step 0)")
    _say(f"interrupted (Ctrl-C): {where}; continue with {_resume_command(args)}")


def _dispatch(command: str, config, resume: bool):
    if command == "sft":
        from fastrlhf.supervised.sft import run

        return run(config, resume=resume)
    if command == "rm":
        from fastrlhf.supervised.reward_model import run

        return run(config, resume=resume)
    from fastrlhf.rl.trainer import run

    return run(config, resume=resume)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "plan":
        from fastrlhf.memory.plan_command import main as plan

        return plan(args)

    from fastrlhf.config import ConfigError, check_world_size, load_config

    try:
        config = load_config(args.config, args.command, args.overrides, imports=args.imports)
        # The launcher has set the world size already: batch-vs-ranks errors need no process group.
        check_world_size(config, int(os.environ.get("WORLD_SIZE", "1")))
        if args.command == "train":  # rollout.tools import (or fail) here, --dry-run too: no model needed
            from fastrlhf.rollout.tools import run_toolbox

            run_toolbox(config)
        if not args.dry_run:
            _claim_output_dir(config.output_dir, args.resume, args.overwrite)
    except ConfigError as exc:
        return _failed_checks(f"config error: {exc}", gate=not args.dry_run)
    except KeyboardInterrupt:
        _say("interrupted (Ctrl-C) before the run started")
        return EXIT_INTERRUPTED
    if args.dry_run:
        try:
            return _dry_run(args.command, config)
        except KeyboardInterrupt:  # reading a large data set or a tokenizer can take a while
            _say("interrupted (Ctrl-C) before the run started")
            return EXIT_INTERRUPTED

    from fastrlhf.data import DataError
    from fastrlhf.distributed.launch import discard_before_group
    from fastrlhf.distributed.multinode import NodeError, lost_peer_reason
    from fastrlhf.engine.checkpoint import CheckpointError
    from fastrlhf.engine.guards import AgreedStepFailure, TooManySkippedSteps

    succeeded = False
    try:
        _dispatch(args.command, config, args.resume)
        succeeded = True
    except KeyboardInterrupt:
        if restored := _settle_overwrite(False):
            _say(f"interrupted (Ctrl-C) before this run's first step; the earlier run in {config.output_dir} is "
                 f"back ({', '.join(restored)})")
        else:
            _interrupted(config, args)
        return EXIT_INTERRUPTED
    except ConfigError as exc:  # checks that need the launched world (e.g. batch size vs ranks)
        if not _group_started():
            return _failed_checks(f"config error: {exc}")
        _rank_error(f"config error: {exc}", exc)
        return EXIT_BAD_INPUT
    except DataError as exc:
        line = _data_error_lines(exc)
        if not _group_started():
            return _failed_checks(line)
        _rank_error(line, exc)
        return EXIT_BAD_INPUT
    except NodeError as exc:  # another node failed its checks, never came, or does not share output_dir
        _say(str(exc), local=exc.local)
        return exc.exit_code
    except CheckpointError as exc:  # agreed ones (the ranks' files, engine.checkpoint._rank_state) said once
        _rank_error(f"checkpoint error: {exc}", exc)
        return EXIT_BAD_INPUT
    except TooManySkippedSteps as exc:
        _error("error", f"{exc} (a checkpoint was saved; fix and rerun with --resume)")
        return EXIT_FAILED
    except AgreedStepFailure as exc:  # a reward function's, an environment's (agreed: comm.agree_on_failure)
        # Every rank holds the failing rank's message (one line, then the user's frames) and exit code: 1, a checkpoint
        # of the last good step was saved and --resume retries the step; 2, wrong as written.
        _say(f"{exc.said_as}: {exc}", local=True)
        return exc.exit_code
    except Exception as exc:
        reason = lost_peer_reason(exc)
        if reason is None:
            raise
        _lost_peer(config, reason)
    finally:
        discard_before_group()  # the command ended before its process group started: --overwrite moved nothing
        if restored := _settle_overwrite(succeeded):
            _say(f"note: --overwrite: this run ended before its first step; the earlier run in {config.output_dir} "
                 f"is back ({', '.join(restored)})")
    return 0


def _dry_run(command: str, config) -> int:
    """``--dry-run``: the checks, then the config with its ``auto`` settings decided, printed by rank 0 (under a
    launcher every rank checks, with the launch's world size). Returns the exit code."""
    if (code := _dry_run_checks(command, config)) is not None:
        return code
    if not _is_main_process():
        return 0
    import yaml

    from fastrlhf.config import config_to_dict

    config, decided = _decide_auto(command, config)
    print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
    for note in decided:
        print(f"# {note}")
    _print_cpu_fast_paths(command, config)
    return 0


def _dry_run_checks(command: str, config) -> int | None:
    """``--dry-run``: the checks the run itself makes before a model loads, so that a dry run passes no config
    the run would refuse there: ``output_dir`` can be written (whether it is used is for the real run's flags
    to say), then ``train``'s preflight (``fastrlhf.rl.trainer.preflight``: reward functions, tokenizers, the
    memory plan, the prompts) or the data of ``sft`` and ``rm`` (``data.path``, ``data.eval_path``). Their notes go
    to stderr (stdout is the config). Returns the exit code of a failed check, None when all pass."""
    import contextlib

    from fastrlhf.config import ConfigError
    from fastrlhf.data import DataError
    from fastrlhf.engine.outputs import check_writable

    try:
        check_writable(config.output_dir)
        with contextlib.redirect_stdout(sys.stderr):
            if command == "train":
                from fastrlhf.rl.trainer import preflight

                preflight(config)
            elif command == "rm":
                from fastrlhf.supervised.reward_model import load_eval_examples, load_examples

                load_examples(config)
                load_eval_examples(config)
            else:
                from fastrlhf.supervised.sft import load_eval_examples, load_examples

                load_examples(config)
                load_eval_examples(config)
    except ConfigError as exc:
        return _failed_checks(f"config error: {exc}", gate=False)
    except DataError as exc:
        return _failed_checks(_data_error_lines(exc), gate=False)
    return None


def _decide_auto(command: str, config):
    """``(config, notes)``: the ``auto`` settings the memory plan decides (``fastrlhf.memory.auto``) decided as the
    run will decide them (the plan of this launch), with the reasons; ``(config, [])`` where none is ``auto``."""
    if command != "train":
        return config, []
    from fastrlhf.memory.auto import decides, resolve_auto_settings

    if not decides(config):
        return config, []
    from fastrlhf.config import ConfigError
    from fastrlhf.memory.plan import plan_for_launch

    try:
        return resolve_auto_settings(config, plan_for_launch(config))
    except ConfigError as exc:
        config, notes = resolve_auto_settings(config, None)
        return config, [f"{note} ({exc})" for note in notes]


def _print_cpu_fast_paths(command: str, config) -> None:
    """On a CPU, what the weight sync of an RL run with a vLLM engine does on this CPU (the CPU probe's
    answer), as a YAML comment: a run whose CPU allows no in-place packing is not silently slower."""
    from fastrlhf.engine.platform import cpu_tools

    cpu = cpu_tools()
    if command != "train" or cpu is None or config.rollout.engine == "hf":
        return
    print(f"# {cpu.probe.cpu_probe().summary()}")


def exit_with(code: int) -> None:
    """Leave the process with ``code``. A launched rank (its process group started) runs Python's exit
    handlers (logging, W&B, vLLM) and then leaves without C++ static destructors: at that point torch's
    c10d stores abort the process about one exit in three on two CPU ranks ("terminate called without an
    active exception", SIGABRT), which turned finished runs and clean one-line errors into crashes."""
    if _group_started():
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def entry() -> None:
    """The ``fastrlhf`` command and ``python -m fastrlhf``. A launched rank that crashes prints its traceback
    and leaves with 1 the same way (else the exit-time abort can turn it into a SIGABRT)."""
    try:
        code = main()
    except Exception:
        if not _group_started():
            raise
        import traceback

        traceback.print_exc()
        code = EXIT_FAILED
    exit_with(code)


if __name__ == "__main__":
    entry()
