"""Targets for ``helpers.launch.spawn_ranks`` (two gloo ranks) of tests/distributed/test_distributed_audit5.py."""

import math


def _join(rank: int, port: int) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _shown(values) -> list:
    """NaN as the string "nan" (NaN != NaN would make equal results compare unequal)."""
    return ["nan" if math.isnan(v) else v for v in values]


def nan_extremes(rank: int, port: int, out) -> None:
    """Max and min over the ranks where rank 1 alone holds a NaN (gloo's MAX dropped it there), and the guard's
    ``largest`` read of a NaN on rank 1."""
    import torch
    import torch.distributed as dist

    from fastrlhf.distributed import comm
    from fastrlhf.engine.guards import StepGuard

    _join(rank, port)
    try:
        nan = float("nan")
        mine = [nan, 0.25, -1.0, float("inf"), 2.0] if rank == 1 else [0.1, 0.5, float("-inf"), 3.0, 2.0]
        out[f"max{rank}"] = _shown(comm.all_reduce_(torch.tensor(mine, dtype=torch.float64), "max").tolist())
        out[f"min{rank}"] = _shown(comm.all_reduce_(torch.tensor(mine, dtype=torch.float32), "min").tolist())
        out[f"floats{rank}"] = _shown(comm.reduce_floats(mine[:2], "max"))
        out[f"sum{rank}"] = _shown(comm.all_reduce_(torch.tensor(mine[1:3]), "sum").tolist())
        out[f"ints{rank}"] = comm.all_reduce_(torch.tensor([rank, 7 - rank], dtype=torch.int64), "max").tolist()
        guard = StepGuard()
        ok = guard.inputs_ok(torch.ones(3), largest={"mismatch": torch.tensor(nan if rank == 1 else 0.1)})
        out[f"guard{rank}"] = (ok, _shown([guard.largest["mismatch"]]))
    finally:
        dist.destroy_process_group()
