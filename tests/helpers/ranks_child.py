"""One rank of a launched run through fastrlhf's command line (``fastrlhf.cli.entry``) whose command joins the
process group (``fastrlhf.distributed.init_distributed``: gloo on a CPU, with FASTRLHF_DIST_TIMEOUT) and then
raises on some ranks while the others wait for them in a collective, as a step does.

``python ranks_child.py CONFIG RANKS KIND``: RANKS, the ranks that raise (``1``, ``0,1``); KIND, what they raise:
``config`` (a ConfigError naming the rank), ``data`` (a DataError of two lines), ``agreed`` (the same ConfigError on
every rank, marked agreed as a collective check marks it: ``fastrlhf.distributed.comm.agreed``)."""

import sys

from fastrlhf import cli


def _error(kind: str, rank: int) -> Exception:
    from fastrlhf.config import ConfigError
    from fastrlhf.data import DataError

    if kind == "data":
        return DataError([f"rank{rank}.jsonl:3: empty prompt", f"rank{rank}.jsonl:7: empty prompt"])
    if kind == "agreed":
        from fastrlhf.distributed import comm

        return comm.agreed(ConfigError("trainer.lr", "the same on every rank"))
    return ConfigError("data.prompts", f"only rank {rank} cannot read it")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher's, when under it
    path, failing, kind = args[0], {int(r) for r in args[1].split(",")}, args[2]

    def dispatch(command, config, resume):
        from fastrlhf import distributed as D
        from fastrlhf.distributed import comm

        D.init_distributed(shared_dir=config.output_dir)
        if D.rank() in failing:
            raise _error(kind, D.rank())
        comm.barrier()  # waits for the failing ranks, as the next collective of a step would
        print(f"rank {D.rank()} passed the barrier", flush=True)

    cli._dispatch = dispatch
    sys.argv = ["fastrlhf", "train", "--config", path]
    cli.entry()


if __name__ == "__main__":
    main()
