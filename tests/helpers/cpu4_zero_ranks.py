"""One rank of a two-rank ZeRO 1-2 run (gloo, under ``torch.distributed.run``) that trains the same fp32 model with
the master partition shared with the weights (``fastrlhf.cpu.zero_master``) and with DeepSpeed's own cloned one, on
data that differs by rank, then saves and resumes the shared engine from a checkpoint.

``python -m torch.distributed.run --standalone --nproc_per_node 2 cpu4_zero_ranks.py FOLDER``; for ZeRO 1 and 2
each rank prints ``STAGE s RANK r SHARED_BYTES n MOVED m MAX_DIFF d RESUME_DIFF e``: n, the bytes the shared engine
no longer holds; m, whether training changed every weight; d, the largest difference between the two engines'
weights after training; e, the same between the shared engine and its copy resumed from the checkpoint."""

import os
import sys

import torch

from fastrlhf import distributed as D
from fastrlhf.config import DeepSpeedConfig
from fastrlhf.cpu import zero_master
from fastrlhf.engine.checkpoint import load_latest, save_checkpoint
from fastrlhf.engine.deepspeed import build_train_engine
from fastrlhf.modeling.tiny import make_tiny_llama


def _engine(stage: int, share: bool):
    real = zero_master.share_master_weights
    freed = []
    zero_master.share_master_weights = lambda optimizer: freed.append(real(optimizer) if share else 0) or freed[-1]
    try:
        # A vocabulary of 61: an odd number of weights, so the last rank's partition ends in padding.
        model = make_tiny_llama(vocab_size=61, hidden_size=32, num_heads=2, num_layers=2).train()
        engine = build_train_engine(
            model, DeepSpeedConfig(zero_stage=stage), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5
        )
    finally:
        zero_master.share_master_weights = real
    return engine, freed[0]


def _train(engine, steps: int) -> None:
    g = torch.Generator().manual_seed(100 + D.rank())  # each rank its own batches: the reduction matters
    for _ in range(steps):
        ids = torch.randint(3, 61, (2, 7), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def _max_diff(a, b) -> float:
    return max(
        (x.detach() - y.detach()).abs().max().item()
        for x, y in zip(a.module.parameters(), b.module.parameters(), strict=True)
    )


def main() -> None:
    D.init_distributed(timeout_s=120)
    for stage in (1, 2):
        _compare(stage, os.path.join(sys.argv[1], f"stage{stage}"))


def _compare(stage: int, folder: str) -> None:
    shared, freed = _engine(stage, True)
    copied, _ = _engine(stage, False)
    start = [p.detach().clone() for p in shared.module.parameters()]
    _train(shared, 3)
    _train(copied, 3)
    diff = _max_diff(shared, copied)
    moved = min((p.detach() - q).abs().max().item() for p, q in zip(shared.module.parameters(), start, strict=True))
    save_checkpoint(folder, 3, {"actor": shared})
    _train(shared, 2)
    resumed, _ = _engine(stage, True)
    load_latest(folder, {"actor": resumed})
    _train(resumed, 2)
    resume_diff = _max_diff(shared, resumed)
    print(
        f"STAGE {stage} RANK {D.rank()} SHARED_BYTES {freed} MOVED {moved > 0} MAX_DIFF {diff} RESUME_DIFF "
        f"{resume_diff}",
        flush=True,
    )


if __name__ == "__main__":
    from fastrlhf.cli import exit_with

    main()
    exit_with(0)  # as a launched fastrlhf rank leaves: torch's c10d stores abort some plain exits on two CPU ranks
