"""Rollouts -> padded tensors, and the per-step batch the PPO/GRPO updates iterate over.

Layout of one batch of B sequences (prompt p_i, completion c_i)::

    input_ids      [B, P + T]   pad.. p_i | c_i ..pad    prompts LEFT-padded to P, completions RIGHT-padded to T
    attention_mask [B, P + T]   1 on real tokens
    response_mask  [B, T]       1 on completion tokens (the only tokens a loss sees)

Every per-token RL tensor (logprobs, values, advantages...) is ``[B, T]`` and aligned on the
completion: column t is completion token t, predicted by the hidden state at position ``P - 1 + t``.
So "the model's outputs for the response" is always ``outputs[:, P - 1 : P - 1 + T]``.

The host keeps each row's token counts (``prompt_lens``, ``completion_lens``): micro-batch grouping
and packing (``fastrlhf.sequences.packing``, :meth:`Experience.packed_layout`) are computed from them, never
from device values. A forward pass may take rows :meth:`Experience.trimmed` (no column that no row
needs) or packed; per-token results come back in this ``[B, T]`` layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

from fastrlhf.engine.device import to_device

if TYPE_CHECKING:
    from fastrlhf.sequences.packed_attention import SharedBlockMasks

__all__ = ["Experience", "build_experience", "pad_response", "split_batch"]


def _shared_block_masks() -> SharedBlockMasks:
    from fastrlhf.sequences.packed_attention import SharedBlockMasks

    return SharedBlockMasks()


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
    # [B, T] the old policy's per-token entropy, from the old-logprob pass to the step's entropy threshold
    # (trainer.top_entropy_quantile, fastrlhf.rl.entropy_mask), which releases it; None otherwise
    entropy: torch.Tensor | None = None
    # Host-side token counts of each row (known from the rollout: grouping and packing read them,
    # never the device); None: counted once from the masks by :meth:`with_lengths`.
    prompt_lens: list[int] | None = None
    completion_lens: list[int] | None = None
    # Host-side count of each row's policy tokens (response_mask 1), where episodes mask tokens between turns;
    # None: every completion token is the policy's (completion_lens)
    policy_lens: list[int] | None = None
    # Host copy of group_ids (rows with the same value share their prompt's tokens); None: unknown,
    # every row its own (nothing is shared).
    prompt_groups: list[int] | None = None
    # [B, T] per-token loss weights of the minibatch the rows belong to (fastrlhf.algorithms.loss_weights),
    # set by the update; None: a loss aggregates its own rows by trainer.agg.
    loss_weights: torch.Tensor | None = None
    # [B] 1 for the rows the losses train, 0 for those they leave out (trainer.mask_truncated_completions);
    # None: every row.
    loss_rows: torch.Tensor | None = None
    # The FlexAttention block masks of this batch's packed rows, by layout: built once, read by every model that runs
    # a micro-batch of that layout (fastrlhf.sequences.packed_attention.SharedBlockMasks). Every batch taken from this
    # one (select, trimmed, replace) holds the same, so they go when the step's batch does.
    block_masks: SharedBlockMasks = field(default_factory=_shared_block_masks, compare=False, repr=False)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def trained_mask(self) -> torch.Tensor:
        """[B, T] the tokens the losses train: ``response_mask`` without the rows ``loss_rows`` leaves out."""
        if self.loss_rows is None:
            return self.response_mask
        return self.response_mask * self.loss_rows[:, None].to(self.response_mask.dtype)

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

    def select(self, index: torch.Tensor | slice | list[int]) -> Experience:
        """Rows ``index`` of every batch tensor (a minibatch); padding columns are kept as they are.
        ``index`` is a host tensor, list or slice (the host-side lengths are selected with it)."""
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long)
        updates, moved = {}, {}  # the index moved once per device the batch's tensors are on
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == self.batch_size:
                if value.device not in moved:
                    moved[value.device] = to_device(index, value.device)
                updates[f.name] = value[moved[value.device]]
            elif isinstance(value, list):
                updates[f.name] = ([value[i] for i in index.tolist()] if isinstance(index, torch.Tensor)
                                   else value[index])
        return replace(self, **updates)

    def with_lengths(self) -> Experience:
        """This batch with ``prompt_lens`` / ``completion_lens`` filled in (counted from the masks, one
        host read, when the builder did not record them)."""
        if self.prompt_lens is not None and self.completion_lens is not None:
            return self
        P = self.prompt_width
        counts = torch.stack([self.attention_mask[:, :P].sum(-1), self.attention_mask[:, P:].sum(-1)]).tolist()
        return replace(self, prompt_lens=counts[0], completion_lens=counts[1])

    def policy_token_counts(self) -> list[int]:
        """Per row, the tokens a loss sees (host-side): an episode's generated tokens, else its completion's."""
        return self.policy_lens if self.policy_lens is not None else self.with_lengths().completion_lens

    def token_parts(self) -> list[tuple[int, int]]:
        """``(prompt, completion)`` real tokens of each row, as micro-batch grouping counts them."""
        exp = self.with_lengths()
        return list(zip(exp.prompt_lens, exp.completion_lens, strict=True))

    def trimmed(self) -> Experience:
        """The same rows without the padding columns no row needs: prompts left-padded to the longest
        prompt among them, completions right-padded to the longest completion (at least one column).

        Nothing a model computes changes (positions count real tokens; the dropped columns are
        masked everywhere); per-token ``[B, T]`` tensors keep their first columns. Outputs go back to
        the batch's width with :func:`pad_response`.
        """
        exp = self.with_lengths()
        P, T = self.prompt_width, self.response_width
        P2 = max(exp.prompt_lens) if exp.prompt_lens else P
        T2 = max(1, max(exp.completion_lens, default=0))
        if (P2, T2) == (P, T):
            return exp
        updates = {"prompt_width": P2}
        for f in fields(self):
            value = getattr(exp, f.name)
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                continue
            if value.shape[1] == P + T:
                updates[f.name] = value[:, P - P2:P + T2]
            elif value.shape[1] == T:
                updates[f.name] = value[:, :T2]
        return replace(exp, **updates)

    def prompt_keys(self) -> list[int]:
        """Per row, a key equal for rows with the same prompt (each row its own when not recorded)."""
        return self.prompt_groups if self.prompt_groups is not None else [-1 - b for b in range(self.batch_size)]

    def packed_layout(self, share_prompts: bool = False):
        """The :class:`fastrlhf.sequences.packing.PackedLayout` of these rows (all in one packed row); with
        ``share_prompts`` each prompt group's prompt once."""
        from fastrlhf.sequences.packing import PackedLayout

        exp = self.with_lengths()
        return PackedLayout.build(exp.prompt_lens, exp.completion_lens, self.response_width, self.prompt_width,
                                  self.input_ids.device, prompt_groups=self.prompt_keys() if share_prompts else None)


def pad_response(values: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, T']`` per-token values right-padded with zeros to ``[B, width]``."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1])) if values.shape[1] < width else values


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
    An episode (``Completion.mask``) is its whole token sequence after the prompt, with ``response_mask``
    1 on the policy's tokens only; one with a prompt of its own (``Completion.prompt_ids``) stays in its
    prompt's group but shares no prompt tokens with it.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but completions for {len(completions)}")
    pairs = enumerate(zip(prompts, completions, strict=True))
    rows = [(i, prompt if c.prompt_ids is None else c.prompt_ids, c) for i, (prompt, samples) in pairs
            for c in samples]
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
        response_mask[b, :n] = 1.0 if c.mask is None else torch.tensor(c.mask, dtype=torch.float32)
        group_ids[b] = group_offset + i
    # Left padding shifts every prompt; positions count real tokens only so that a padded
    # sequence sees exactly the positions it would see alone.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Experience(
        **to_device(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         response_mask=response_mask, group_ids=group_ids, engine_logprobs=engine_logprobs), device),
        prompt_width=P,
        prompt_lens=[len(prompt) for _, prompt, _ in rows],
        completion_lens=[len(c.token_ids) for _, _, c in rows],
        prompt_groups=[group_offset + i if c.prompt_ids is None else -1 - b for b, (i, _, c) in enumerate(rows)],
        policy_lens=[len(c.token_ids) if c.mask is None else sum(c.mask) for _, _, c in rows]
        if any(c.mask is not None for _, _, c in rows) else None,
    )


def split_batch(batch_size: int, num_parts: int, generator: torch.Generator | None = None,
                shuffle: bool = False) -> list[torch.Tensor]:
    """Row indices of ``num_parts`` equal minibatches (optionally shuffled); raises if B % parts != 0."""
    if num_parts < 1 or batch_size % num_parts:
        raise ValueError(f"cannot split {batch_size} sequences into {num_parts} equal parts")
    order = torch.randperm(batch_size, generator=generator) if shuffle else torch.arange(batch_size)
    return list(order.view(num_parts, -1))
