"""Targets for ``helpers.launch.spawn_ranks`` (two gloo ranks) of tests/rl/test_followups_audit6.py."""


def named_reads(rank: int, port: int, out) -> None:
    """The host reads each cross-rank helper makes, by name (None: a read no :func:`host_read` names)."""
    import os

    import torch
    import torch.distributed as dist

    from fastrlhf.distributed import comm
    from fastrlhf.engine.device import watch_host_reads
    from fastrlhf.engine.guards import AgreedStepFailure

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        calls = {
            "agree_on_failure": lambda: comm.agree_on_failure(lambda: rank + 1, AgreedStepFailure),
            "reduce_floats": lambda: comm.reduce_floats([1.0, float(rank)], "max"),
            "mean_over_ranks": lambda: comm.mean_over_ranks({"a": float(rank)}),
            "any_rank_true": lambda: comm.any_rank_true(torch.tensor(rank == 1)),
            "all_ranks_true": lambda: comm.all_ranks_true(rank == 1),
            "gather_bytes": lambda: comm.gather_bytes(b"x" * (rank + 1)),
        }
        for name, call in calls.items():
            with watch_host_reads() as names:
                result = call()
            out[f"{name}{rank}"] = (result, len(names))
    finally:
        dist.destroy_process_group()
