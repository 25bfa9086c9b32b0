"""Validation during RL: greedy completions of held-out prompts, scored by a reward function.

Every rank generates for its shard of the validation prompts with its own rollout engine (the
weights it will sample the next step with), scores them, and the sums are reduced over ranks in
one collective. ``eval_reward`` is the mean over all prompts; with ``group_by`` set, each value of
that meta key gets its own ``eval_reward/<value>`` (e.g. per task type), which is what tells a user
which kind of prompt RL is still getting wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastrlhf import comm

__all__ = ["Validator"]


class Validator:
    """``validator() -> {"eval_reward": ..., "eval_reward/<group>": ...}`` (a collective: call it on every rank)."""

    def __init__(self, prompts: Sequence[list[int]], metas: Sequence[dict], reward_fn: Callable, rollout,
                 max_new_tokens: int, stop_token_ids: Sequence[int] = (), group_by: str | None = None,
                 rank: int = 0, world: int = 1):
        if not prompts:
            raise ValueError("validation needs at least one prompt")
        self.reward_fn = reward_fn
        self.rollout = rollout
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = tuple(stop_token_ids)
        self.group_by = group_by
        # Every rank knows every group, so the reduced vector has the same layout on all of them.
        self.groups = sorted({self._group(m) for m in metas}) if group_by else []
        mine = range(rank, len(prompts), world)
        self.prompts = [list(prompts[i]) for i in mine]
        self.metas = [metas[i] for i in mine]

    def _group(self, meta: dict) -> str:
        return str((meta or {}).get(self.group_by, "none"))

    def __call__(self) -> dict[str, float]:
        from fastrlhf.rollout import SamplingConfig

        sums = [0.0] * (1 + len(self.groups))
        counts = [0.0] * (1 + len(self.groups))
        if self.prompts:
            greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=self.max_new_tokens,
                                    stop_token_ids=self.stop_token_ids)
            completions = self.rollout.generate(self.prompts, greedy)
            for prompt, meta, (completion,) in zip(self.prompts, self.metas, completions, strict=True):
                score = float(self.reward_fn(prompt, completion.token_ids, meta))
                slots = [0] + ([1 + self.groups.index(self._group(meta))] if self.groups else [])
                for slot in slots:
                    sums[slot] += score
                    counts[slot] += 1.0
        totals = comm.reduce_floats(sums + counts, "sum")
        sums, counts = totals[:len(sums)], totals[len(sums):]
        metrics = {"eval_reward": sums[0] / max(counts[0], 1.0)}
        for i, group in enumerate(self.groups, start=1):
            metrics[f"eval_reward/{group}"] = sums[i] / max(counts[i], 1.0)
        return metrics
