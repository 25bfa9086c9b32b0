"""Targets for ``helpers.launch.spawn_ranks`` (two gloo ranks) of tests/rl/test_top_entropy_quantile.py, and the batches
each rank holds: different lengths, widths and entropies on purpose."""

import torch


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entropy, mask)`` of ``rank``: rank 0 holds 3 rows of 5 low entropies, rank 1 4 rows of 9 higher ones."""
    g = torch.Generator().manual_seed(11 + rank)
    rows, width = (3, 5) if rank == 0 else (4, 9)
    entropy = torch.rand(rows, width, generator=g) * (1.0 + 3.0 * rank)
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    return entropy, mask


def threshold_rank(rank: int, port: int, out) -> None:
    """Each rank's threshold, kept tokens and kept fraction at quantile 0.2, from its own share of the batch."""
    import datetime

    import torch.distributed as dist

    from fastrlhf.rl.entropy_mask import high_entropy_mask

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        entropy, mask = rank_batch(rank)
        keep, metrics = high_entropy_mask(entropy, mask, 0.2)
        out[rank] = (keep, metrics["entropy_threshold"], metrics["entropy_kept_fraction"])
    finally:
        dist.destroy_process_group()
