"""Targets for ``helpers.launch.spawn_ranks`` (two gloo ranks) of tests/rl/test_reward_normalize.py, and the score
batches each rank holds: different sizes and scales on purpose, one non-finite score among them."""

import torch


def rank_batches(rank: int) -> list[torch.Tensor]:
    """Three fp32 score batches of ``rank``: rank 0 holds 3, 5 and 2 scores, rank 1 6, 1 and 4 (one a NaN)."""
    g = torch.Generator().manual_seed(5 + rank)
    sizes = (3, 5, 2) if rank == 0 else (6, 1, 4)
    batches = [torch.randn(n, generator=g) * (1.0 + 2.0 * rank) + 0.5 * i for i, n in enumerate(sizes)]
    if rank == 1:
        batches[2][1] = float("nan")
    return batches


def normalize_rank(rank: int, port: int, out) -> None:
    """Each rank's normalised batches and its moments after every batch."""
    import datetime

    import torch.distributed as dist

    from fastrlhf.rl.reward_norm import RunningMoments

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        moments, results = RunningMoments(), []
        for batch in rank_batches(rank):
            normalized = moments.normalize(batch)
            results.append((normalized, {k: v.clone() for k, v in moments.state_dict().items()}))
        out[rank] = results
    finally:
        dist.destroy_process_group()
