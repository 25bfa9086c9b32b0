"""One vLLM engine driven by the ranks of a tensor-parallel group together.

Under the launcher with ``rollout.tensor_parallel_size: k``, vLLM's external launcher makes each k
consecutive ranks one engine that holds 1/k of every weight. Every rank of the group runs the
engine's driver loop, so all k must submit the same requests in the same order with the same seed.
The trainer, though, gives each rank its own prompts. :class:`TensorParallelGroup` bridges the two:
``generate`` gathers the group's prompts (in rank order), generates them once, and returns each
rank its own share. Weight sync is unchanged: every rank pushes the full HF tensors, and vLLM's
weight loaders keep this rank's shard of each.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import torch

from fastrlhf.distributed import comm
from fastrlhf.rollout.base import RolloutEngine
from fastrlhf.rollout.sampling import Completion, SamplingConfig

__all__ = ["TensorParallelGroup"]


class TensorParallelGroup(RolloutEngine):
    """``engine`` (built with ``tensor_parallel_size=group_size``) shared by ranks
    ``[rank - rank % group_size, ... + group_size)``; everything but ``generate`` passes through."""

    def __init__(self, engine: RolloutEngine, group_size: int, rank: int):
        if group_size < 2:
            raise ValueError(f"a tensor-parallel group has at least 2 ranks, got {group_size}")
        self.engine, self.group_size, self.rank = engine, group_size, rank
        self.kind, self.tokenizer = engine.kind, engine.tokenizer
        self._vocab_size, self._max_model_len = engine.vocab_size, engine.max_model_len

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return self.engine.weight_dtype

    @property
    def needs_sync(self) -> bool:  # the engine's sleep dropped its weights: the step syncs even a skipped update
        return self.engine.needs_sync

    @property
    def sync_at_start(self) -> bool:
        return self.engine.sync_at_start

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                 limits: Sequence[int] | None = None, seeds: Sequence[int] | None = None) -> list[list[Completion]]:
        if limits is not None or seeds is not None:  # config checks keep episodes off tensor-parallel groups
            raise ValueError("a tensor-parallel group generates whole single-turn batches: no limits or seeds")
        mine = [[int(t) for t in p] for p in prompt_token_ids]
        # Every rank takes part (collective); only the own group's prompts are kept.
        every_rank = [json.loads(part) for part in comm.gather_bytes(json.dumps(mine).encode())]
        first = self.rank - self.rank % self.group_size
        group = every_rank[first:first + self.group_size]
        results = self.engine.generate([p for prompts in group for p in prompts], sampling)
        start = sum(len(prompts) for prompts in group[:self.rank - first])
        return results[start:start + len(mine)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)

    @property
    def sleep_frees_device(self) -> bool:
        return self.engine.sleep_frees_device

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        self.engine.wake_up(tags)

    def asleep_bytes(self) -> int:
        return self.engine.asleep_bytes()

    def close(self) -> None:
        self.engine.close()
