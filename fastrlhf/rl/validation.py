"""Validation during RL: completions of held-out prompts, scored, reduced over ranks, written out.

Every rank generates for its shard of the validation prompts with its own rollout engine (the
weights it will sample the next step with) and scores them with the run's reward (or ``eval.reward``).
Metrics, reduced over ranks in one collective:

- ``eval/reward_mean``: the mean reward over all completions;
- ``eval/accuracy``: the fraction of completions whose reward reaches ``max_reward`` (a correct answer);
- ``eval/pass@n`` (``n > 1``): the fraction of prompts with at least one such completion;
- ``eval/reward_mean/<value>``: per value of the meta key ``group_by`` (which kind of prompt RL
  still gets wrong).

Rank 0 writes every completion (gathered from all ranks) to ``<output_dir>/eval/step-N.jsonl``.

With ``max_sequences_per_call`` (the HF engine's: a step's sequences per rank, what the memory plan sizes its KV
cache for) a rank's shard is generated in calls of at most that many sequences: GSM8K's 1,319 prompts x ``eval.n``
4 over 8 ranks asked one ``generate`` for 660 sequences, a KV cache five times the step's. vLLM schedules its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import torch

from fastrlhf.distributed import comm

__all__ = ["Validator"]


class Validator:
    """``validator(step) -> {"eval/reward_mean": ..., ...}`` (a collective: call it on every rank).

    ``score(prompts, completions, metas) -> [B]`` scores completions prompt-major (``completions``
    holds ``sampling.n`` per prompt); ``tokenizer`` (optional) decodes the written samples.
    """

    def __init__(self, prompts: Sequence[list[int]], metas: Sequence[dict], score: Callable, rollout, sampling,
                 max_reward: float = 1.0, group_by: str | None = None, rank: int = 0, world: int = 1,
                 output_dir: str | None = None, tokenizer=None, max_sequences_per_call: int | None = None):
        if not prompts:
            raise ValueError("validation needs at least one prompt")
        self.score, self.rollout, self.sampling = score, rollout, sampling
        self.max_reward, self.group_by = float(max_reward), group_by
        self.output_dir, self.tokenizer, self.rank = output_dir, tokenizer, rank
        self.prompts_per_call = None if max_sequences_per_call is None else max(1, max_sequences_per_call // sampling.n)
        # Every rank knows every group, so the reduced vector has the same layout on all of them.
        self.groups = sorted({self._group(m) for m in metas}) if group_by else []
        mine = range(rank, len(prompts), world)
        self.indices = list(mine)
        self.prompts = [list(prompts[i]) for i in mine]
        self.metas = [metas[i] for i in mine]

    def _group(self, meta: dict) -> str:
        return str((meta or {}).get(self.group_by, "none"))

    def __call__(self, step: int) -> dict[str, float]:
        n = self.sampling.n
        # Slots: [reward sum, correct count, samples] overall, passed prompts, prompts, then per group.
        sums = torch.zeros(5 + 2 * len(self.groups), dtype=torch.float64)
        records = []
        if self.prompts:
            from fastrlhf.rollout.episodes import EpisodeRunner

            episodes = isinstance(self.rollout, EpisodeRunner)
            size = self.prompts_per_call or len(self.prompts)
            completions = []
            for i in range(0, len(self.prompts), size):
                extra = {"metas": self.metas[i:i + size]} if episodes else {}
                completions += self.rollout.generate(self.prompts[i:i + size], self.sampling, **extra)
            rewards = self.score(self.prompts, completions, self.metas).double().cpu().view(len(self.prompts), n)
            correct = rewards >= self.max_reward
            sums[:5] = torch.stack([rewards.sum(), correct.sum(), torch.tensor(float(rewards.numel())),
                                    correct.any(dim=1).sum(), torch.tensor(float(len(self.prompts)))])
            for i, meta in enumerate(self.metas):
                if self.groups:
                    g = 5 + 2 * self.groups.index(self._group(meta))
                    sums[g] += rewards[i].sum()
                    sums[g + 1] += n
                records += [self._record(self.indices[i], self.prompts[i], meta, c, float(r), bool(ok))
                            for c, r, ok in zip(completions[i], rewards[i], correct[i], strict=True)]
        totals = comm.reduce_floats(sums.tolist(), "sum")
        metrics = {"eval/reward_mean": totals[0] / max(totals[2], 1.0),
                   "eval/accuracy": totals[1] / max(totals[2], 1.0)}
        if n > 1:
            metrics[f"eval/pass@{n}"] = totals[3] / max(totals[4], 1.0)
        for j, group in enumerate(self.groups):
            metrics[f"eval/reward_mean/{group}"] = totals[5 + 2 * j] / max(totals[6 + 2 * j], 1.0)
        self._write(step, records)
        return metrics

    def _record(self, index: int, prompt: list[int], meta: dict, completion, reward: float, correct: bool) -> dict:
        record = {"index": index, "reward": reward, "correct": correct, "finish_reason": completion.finish_reason}
        if completion.mask is not None:  # an episode: its turns and tool calls
            record.update(turns=completion.extra.get("turns"), tool_calls=completion.extra.get("tool_calls"))
        if self.tokenizer is not None:
            record["prompt"] = self.tokenizer.decode(prompt, skip_special_tokens=False)
            record["completion"] = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
        else:
            record["completion_ids"] = list(completion.token_ids)
        return {**record, **{k: v for k, v in (meta or {}).items() if k not in record}}

    def _write(self, step: int, records: list[dict]) -> None:
        """Every rank's records, in prompt order, to ``eval/step-N.jsonl`` on rank 0 (written atomically)."""
        lines = "".join(json.dumps(r, default=str) + "\n" for r in records).encode()
        parts = comm.gather_bytes(lines) if self.output_dir is not None else []
        if self.output_dir is None or self.rank != 0:
            return
        gathered = [json.loads(line) for part in parts for line in part.decode().splitlines()]
        gathered.sort(key=lambda r: r["index"])  # stable: a prompt's samples stay in sample order
        folder = os.path.join(self.output_dir, "eval")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"step-{step}.jsonl")
        with open(f"{path}.tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in gathered)
        os.replace(f"{path}.tmp", path)
