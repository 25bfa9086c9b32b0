"""PPO advantages are whitened with the statistics of the whole batch, whichever rank holds a token, and GRPO's
``scale_by_std: batch`` divides by the std of every rank's scores together."""

import torch
import torch.distributed as dist
from helpers.launch import spawn_ranks

from fastrlhf.algorithms import masked_whiten, std_across_ranks, whiten_across_ranks


def batch():
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64) * 3 + 1
    mask = (torch.rand(4, 6, generator=g) > 0.3).double()
    return adv, mask


def test_single_process_equals_masked_whiten():
    adv, mask = batch()
    torch.testing.assert_close(whiten_across_ranks(adv, mask), masked_whiten(adv, mask))


def test_fewer_than_two_kept_tokens_are_returned_unchanged():
    """No variance to divide by: not whitened to zeros (one token) or NaN (none)."""
    adv, _ = batch()
    for kept in (0, 1):
        mask = torch.zeros_like(adv)
        mask.view(-1)[:kept] = 1.0
        torch.testing.assert_close(whiten_across_ranks(adv, mask), adv, rtol=0, atol=0)


def _rank(rank, port, out):
    import datetime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        adv, mask = batch()
        rows = slice(0, 1) if rank == 0 else slice(1, 4)  # uneven shares, on purpose
        out[rank] = whiten_across_ranks(adv[rows], mask[rows])
        out[f"std{rank}"] = std_across_ranks(adv[rows].flatten())
    finally:
        dist.destroy_process_group()


def test_two_ranks_use_global_statistics():
    out = spawn_ranks(_rank)
    adv, mask = batch()
    torch.testing.assert_close(torch.cat([out[0], out[1]]), masked_whiten(adv, mask))
    for std in (out["std0"], out["std1"]):  # every rank's std is the whole batch's, not its share's
        torch.testing.assert_close(std, adv.flatten().std())
