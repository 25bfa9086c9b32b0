"""Rollouts -> padded tensors, and the per-step batch the PPO/GRPO updates iterate over.

Layout of one batch of B sequences (prompt p_i, completion c_i)::

    input_ids      [B, P + T]   pad.. p_i | c_i ..pad    prompts LEFT-padded to P, completions RIGHT-padded to T
    attention_mask [B, P + T]   1 on real tokens
    response_mask  [B, T]       1 on completion tokens (the only tokens a loss sees)

Every per-token RL tensor (logprobs, values, advantages...) is ``[B, T]`` and aligned on the
completion: column t is completion token t, predicted by the hidden state at position ``P - 1 + t``.
So "the model's outputs for the response" is always ``outputs[:, P - 1 : P - 1 + T]``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["Experience", "build_experience", "split_batch"]


@dataclass
class Experience:
    """A batch of sampled sequences plus everything the update needs, all tensors on one device.

    Optional fields are filled in as the step goes (old/ref logprobs, values, advantages...).
    ``group_ids[b]`` is the index of the prompt sequence b was sampled from (GRPO groups).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int
    group_ids: torch.Tensor
    engine_logprobs: torch.Tensor
    scores: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # truncated importance-sampling weights (tis_cap)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @property
    def labels(self) -> torch.Tensor:
        """[B, T] the completion tokens (pad where masked)."""
        return self.input_ids[:, self.prompt_width:]

    def response_slice(self) -> slice:
        """Positions whose outputs predict the completion tokens."""
        return slice(self.prompt_width - 1, self.prompt_width - 1 + self.response_width)

    def select(self, index: torch.Tensor | slice) -> Experience:
        """Rows ``index`` of every batch tensor (a minibatch); padding columns are kept as they are."""
        updates = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == self.batch_size:
                updates[f.name] = value[index]
        return replace(self, **updates)


def build_experience(
    prompts: list[list[int]],
    completions: list[list],
    pad_token_id: int,
    device: torch.device | str = "cpu",
    group_offset: int = 0,
) -> Experience:
    """Pad ``completions[i][j]`` (``Completion`` objects, j-th sample of prompt i) into an Experience.

    Sequences are ordered prompt-major (all samples of prompt 0, then prompt 1...), so a GRPO
    group is a contiguous run of rows. A completion with no tokens keeps an all-zero mask row.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but completions for {len(completions)}")
    pairs = enumerate(zip(prompts, completions, strict=True))
    rows = [(i, prompt, c) for i, (prompt, samples) in pairs for c in samples]
    if not rows:
        raise ValueError("build_experience: no completions to pad")
    P = max(len(p) for _, p, _ in rows)
    T = max(1, max(len(c.token_ids) for _, _, c in rows))
    B = len(rows)
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    engine_logprobs = torch.zeros((B, T), dtype=torch.float32)
    group_ids = torch.empty(B, dtype=torch.long)
    for b, (i, prompt, c) in enumerate(rows):
        n = len(c.token_ids)
        input_ids[b, P - len(prompt):P] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[b, P - len(prompt):P + n] = 1
        if n:
            input_ids[b, P:P + n] = torch.tensor(c.token_ids, dtype=torch.long)
            engine_logprobs[b, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
        response_mask[b, :n] = 1.0
        group_ids[b] = group_offset + i
    # Left padding shifts every prompt; positions count real tokens only so that a padded
    # sequence sees exactly the positions it would see alone.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Experience(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        response_mask=response_mask.to(device),
        prompt_width=P,
        group_ids=group_ids.to(device),
        engine_logprobs=engine_logprobs.to(device),
    )


def split_batch(batch_size: int, num_parts: int, generator: torch.Generator | None = None,
                shuffle: bool = False) -> list[torch.Tensor]:
    """Row indices of ``num_parts`` equal minibatches (optionally shuffled); raises if B % parts != 0."""
    if num_parts < 1 or batch_size % num_parts:
        raise ValueError(f"cannot split {batch_size} sequences into {num_parts} equal parts")
    order = torch.randperm(batch_size, generator=generator) if shuffle else torch.arange(batch_size)
    return list(order.view(num_parts, -1))
