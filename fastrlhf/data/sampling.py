"""Which examples a step trains on: a seeded, resumable epoch shuffle, and the deal of a step's examples to
the ranks (contiguous slices, or balanced by their tokens).
"""

from __future__ import annotations

import random

__all__ = [
    "EpochSampler", "shard", "balanced_shard"
]


class EpochSampler:
    """Endless seeded shuffles of ``range(n)``; ``state_dict`` makes the position part of a checkpoint.

    Every rank builds the same sampler and draws the same global batch, then takes its own slice,
    so no communication is needed to agree on the data. That every rank loaded the same data is checked
    once, by the commands, as the process group starts (:func:`fastrlhf.data.check_same_data`).
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        if n <= 0:
            raise ValueError(f"EpochSampler needs at least one example, got {n}")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        """The next ``k`` example indices (crossing into the next epoch's shuffle when needed)."""
        out = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(k - len(out), self.n - self.position)
            out.extend(self._order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"the checkpoint's sampler covered {state['n']} examples but the data now has {self.n}; "
                             "resume with the same data")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._make_order()


def shard(items: list, rank: int, world_size: int) -> list:
    """This rank's contiguous slice of a global batch (the batch size must divide evenly)."""
    if len(items) % world_size:
        raise ValueError(f"a batch of {len(items)} does not split evenly over {world_size} ranks")
    per = len(items) // world_size
    return items[rank * per:(rank + 1) * per]


def balanced_shard(items: list, lengths: list[int], rank: int, world_size: int) -> list:
    """This rank's share of a global batch, as many items as every other rank's, dealt so that the
    ranks' token counts (``lengths``, one per item) are even: longest first, each to the rank with the
    fewest tokens so far among those with room. The step's collectives wait for the rank with the most
    tokens, and a contiguous slice can hand one rank all the long prompts. Where the deal would not
    lower the largest rank's tokens (equal lengths, or slices already even) the contiguous slices are
    kept: a different split changes which rank's engine samples which prompt, and nothing else.
    Every rank computes the same result from the same batch; a rank's items keep their sampled order."""
    if len(lengths) != len(items):
        raise ValueError(f"{len(lengths)} lengths for a batch of {len(items)}")
    sliced = max(sum(shard(lengths, r, world_size)) for r in range(world_size))  # also checks the split
    per = len(items) // world_size
    tokens, dealt = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(items)), key=lambda i: (-lengths[i], i)):
        to = min((r for r in range(world_size) if len(dealt[r]) < per), key=lambda r: (tokens[r], r))
        tokens[to] += lengths[i]
        dealt[to].append(i)
    if max(tokens) >= sliced:
        return shard(items, rank, world_size)
    return [items[i] for i in sorted(dealt[rank])]
