"""Micro-batches by a token budget, and packed sequences: the layout every training forward can take.

Two independent settings (``trainer.max_tokens_per_microbatch``, ``trainer.packing``) of one idea:
a micro-batch should cost what its real tokens cost.

* :func:`token_budget_groups` groups the items of a minibatch (sequences; pairs for a pairwise
  reward model) into micro-batches of at most ``max_tokens`` tokens each, counted as the forward
  pass will hold them: real tokens when packed, rows x padded width when padded. Items are taken
  longest first and each goes into the first micro-batch it fits (first-fit decreasing); an item
  longer than the budget gets a micro-batch of its own (and one warning per process). Only the
  grouping changes: which items make up a minibatch, and every loss and metric, do not (the loss
  weights are the minibatch's, see ``fastrlhf.algorithms.loss_weights``).
* Under ZeRO every forward is a collective (ZeRO-3 gathers parameters, ZeRO-2 reduces
  gradients), so every rank must run as many micro-batches: :func:`agree_group_counts` takes the
  largest count over the ranks (one collective for all the minibatches of a step) and
  :func:`split_to_count` splits a rank's largest micro-batches until it has that many.
* :class:`PackedLayout` puts the sequences of a micro-batch end to end in one row, positions
  restarting at 0 for each: ``input_ids`` / ``position_ids`` ``[1, N]``, with the row's block mask and
  bounds built on the host (:meth:`PackedLayout.model_kwargs`) for the ``fastrlhf_packed`` attention
  (``fastrlhf.sequences.packed_attention``), so no token attends across a boundary and no padding is computed.
  The layout also holds the indices that take the ``[M]`` completion tokens out of the packed row
  (the hidden states that predict them, their place in ``[B, T]`` tensors) and put results back.

Everything here is computed on the host from lengths the caller knows (the rollout's token
counts, the dataset's examples): no device value is read, so nothing waits on the device.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastrlhf.engine.device import to_device

__all__ = [
    "PackedLayout",
    "agree_group_counts",
    "fixed_count_groups",
    "group_cost",
    "micro_batch_plan",
    "split_to_count",
    "token_budget_groups",
]

_warned_over_budget = False


def fixed_count_groups(num_items: int, size: int) -> list[list[int]]:
    """Consecutive micro-batches of ``size`` items (the last one may be short)."""
    size = max(1, int(size))
    return [list(range(start, min(start + size, num_items))) for start in range(0, num_items, size)]


def group_cost(parts: Sequence[Sequence[int]], members: Sequence[int], packed: bool, rows_per_item: int = 1,
               keys: Sequence[int] | None = None) -> int:
    """Tokens a micro-batch of ``members`` holds: packed, the sum of their parts (with ``keys``, shared
    prompts: each key's prompt, ``parts[i][0]``, once); padded, its rows times the sum over parts of the
    widest member's part (a prompt left-padded to the longest prompt, a completion right-padded to the
    longest completion)."""
    if not members:
        return 0
    if packed and keys is not None:
        prompts = {keys[i]: parts[i][0] for i in members}
        return sum(prompts.values()) + sum(sum(parts[i][1:]) for i in members)
    if packed:
        return sum(sum(parts[i]) for i in members)
    widths = [max(parts[i][k] for i in members) for k in range(len(parts[members[0]]))]
    return rows_per_item * len(members) * sum(widths)


def token_budget_groups(parts: Sequence[Sequence[int]], max_tokens: int, packed: bool,
                        rows_per_item: int = 1, keys: Sequence[int] | None = None) -> list[list[int]]:
    """Items (their token counts ``parts[i]``, e.g. ``(prompt, completion)``) grouped into micro-batches
    of at most ``max_tokens`` tokens (:func:`group_cost`), first-fit decreasing. ``keys`` (packed only):
    items with the same key share their prompt, counted once per micro-batch.

    Returns lists of item indices; each list in increasing index order, the lists by their first
    item. An item over the budget on its own gets a micro-batch of its own, with one warning per process.
    """
    if packed and keys is not None:
        return _shared_prompt_groups(parts, max_tokens, keys)
    global _warned_over_budget
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(parts)), key=lambda i: (-sum(parts[i]), i))
    groups: list[list[int]] = []
    # Per group: packed, the token sum; padded, the widest part of each kind so far.
    state: list[list[int] | int] = []
    for i in order:
        size = sum(parts[i])
        alone = group_cost(parts, [i], packed, rows_per_item)
        if alone > max_tokens:
            if not _warned_over_budget:
                _warned_over_budget = True
                warnings.warn(f"a sequence of {size} tokens does not fit trainer.max_tokens_per_microbatch "
                              f"{max_tokens}; it gets a micro-batch of its own (reported once)", stacklevel=2)
            groups.append([i])
            state.append(max_tokens + 1 if packed else [max_tokens + 1] * len(parts[i]))
            continue
        for g, members in enumerate(groups):
            if packed:
                if state[g] + size <= max_tokens:
                    members.append(i)
                    state[g] += size
                    break
            else:
                widths = [max(a, b) for a, b in zip(state[g], parts[i], strict=True)]
                if rows_per_item * (len(members) + 1) * sum(widths) <= max_tokens:
                    members.append(i)
                    state[g] = widths
                    break
        else:
            groups.append([i])
            state.append(size if packed else list(parts[i]))
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def _shared_prompt_groups(parts, max_tokens: int, keys) -> list[list[int]]:
    """:func:`token_budget_groups` of packed items whose prompts are shared by key: first-fit decreasing
    where joining a micro-batch that already holds the item's prompt costs only its completion."""
    global _warned_over_budget
    order = sorted(range(len(parts)), key=lambda i: (-sum(parts[i]), i))
    groups: list[list[int]] = []
    state: list[tuple[int, set]] = []  # per group: tokens, prompt keys in it
    for i in order:
        size, prompt = sum(parts[i]), parts[i][0]
        for g, members in enumerate(groups):
            tokens, in_group = state[g]
            cost = size - prompt if keys[i] in in_group else size
            if tokens + cost <= max_tokens:
                members.append(i)
                state[g] = (tokens + cost, in_group | {keys[i]})
                break
        else:
            if size > max_tokens and not _warned_over_budget:
                _warned_over_budget = True
                warnings.warn(f"a sequence of {size} tokens does not fit trainer.max_tokens_per_microbatch "
                              f"{max_tokens}; it gets a micro-batch of its own (reported once)", stacklevel=3)
            groups.append([i])
            state.append((size if size <= max_tokens else max_tokens + 1, {keys[i]}))
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def split_to_count(groups: list[list[int]], parts: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """``groups`` split until there are ``count`` of them: the micro-batch with the most tokens
    (of those with two items or more) is cut in two halves of about equal tokens, again and again.
    Needs ``count`` <= the number of items."""
    groups = [list(g) for g in groups]
    if count > sum(len(g) for g in groups):
        raise ValueError(f"cannot make {count} micro-batches of {sum(len(g) for g in groups)} items")
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        largest = max(splittable, key=lambda g: sum(sum(parts[i]) for i in g))
        groups.remove(largest)
        first, second, a, b = [], [], 0, 0
        for i in sorted(largest, key=lambda i: -sum(parts[i])):
            if a <= b:
                first.append(i)
                a += sum(parts[i])
            else:
                second.append(i)
                b += sum(parts[i])
        groups += [sorted(first), sorted(second)]
    return sorted(groups, key=lambda g: g[0])


def agree_group_counts(plans: list[list[list[int]]], parts_of: list[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
    """Each plan (the micro-batches of one minibatch) split to the largest count any rank has for it:
    one collective for all of them (nothing on a single process)."""
    from fastrlhf.distributed import comm

    counts = comm.reduce_floats([float(len(p)) for p in plans], "max")
    return [split_to_count(plan, parts, int(c)) for plan, parts, c in zip(plans, parts_of, counts, strict=True)]


def micro_batch_plan(parts_of: Sequence[Sequence[Sequence[int]]], micro_batch: int, max_tokens: int | None,
                     packed: bool, rows_per_item: int = 1,
                     keys_of: Sequence[Sequence[int]] | None = None) -> list[list[list[int]]]:
    """The micro-batches of each minibatch (``parts_of[k]``: its items' token counts; ``keys_of[k]``
    their prompt keys when packed prompts are shared): by the token budget when there is one, as many
    on every rank (:func:`agree_group_counts`); else consecutive ``micro_batch`` items (the same count
    everywhere already, packed or not)."""
    if max_tokens is None:
        return [fixed_count_groups(len(parts), micro_batch) for parts in parts_of]
    keys_of = keys_of if keys_of is not None else [None] * len(parts_of)
    plans = [token_budget_groups(parts, max_tokens, packed, rows_per_item, keys)
             for parts, keys in zip(parts_of, keys_of, strict=True)]
    return agree_group_counts(plans, parts_of)


@dataclass
class PackedLayout:
    """B sequences (prompt of ``prompt_lens[b]`` tokens, then completion of ``completion_lens[b]``)
    end to end in one row of N tokens; tensors on ``device``.

    ``position_ids`` ``[1, N]`` restart at 0 for each sequence. The M completion tokens, in packed
    order: ``hidden_index`` ``[M]`` is the position in the row whose output predicts each of them
    (the token before it), ``token_index`` ``[M]`` its place in a ``[B, T]`` per-token tensor
    (flattened). ``last_index`` ``[B]`` is each sequence's last token. ``source_index`` ``[N]``:
    for a batch already padded as ``fastrlhf.rl.experience`` lays it out (prompts left-padded to
    ``prompt_width``, completions right-padded to T), where each packed token sits in the flattened
    ``[B, prompt_width + T]`` ids.
    """

    prompt_lens: list[int]
    completion_lens: list[int]
    response_width: int
    position_ids: torch.Tensor
    hidden_index: torch.Tensor
    token_index: torch.Tensor
    last_index: torch.Tensor
    source_index: torch.Tensor | None
    # Shared prompts only (build's prompt_groups): host (start, end, prefix_start, prefix_end) per
    # attention segment: tokens start:end attend to prefix_start:prefix_end, then causally to themselves.
    segments: list[tuple[int, int, int, int]] | None = None

    @classmethod
    def build(cls, prompt_lens: Sequence[int], completion_lens: Sequence[int], response_width: int | None = None,
              prompt_width: int | None = None, device: torch.device | str = "cpu",
              prompt_groups: Sequence[int] | None = None) -> PackedLayout:
        """``prompt_groups[b]``: sequences with the same value have the same prompt (a GRPO group), which
        is then packed once, followed by each of their completions (see :meth:`_build_shared`)."""
        prompt_lens, completion_lens = [int(x) for x in prompt_lens], [int(x) for x in completion_lens]
        if len(prompt_lens) != len(completion_lens) or not prompt_lens:
            raise ValueError(f"need one prompt and one completion length per sequence, got {len(prompt_lens)} and "
                             f"{len(completion_lens)}")
        if any(p < 1 for p, n in zip(prompt_lens, completion_lens, strict=True) if n > 0):
            raise ValueError("a packed completion needs a prompt of at least one token (the position that predicts "
                             "its first token)")
        T = max(completion_lens) if response_width is None else int(response_width)
        if prompt_groups is not None:
            return cls._build_shared(prompt_lens, completion_lens, T, prompt_width, device, list(prompt_groups))
        p = torch.tensor(prompt_lens, dtype=torch.long)
        n = torch.tensor(completion_lens, dtype=torch.long)
        lengths = p + n
        B, N, M = len(prompt_lens), int(lengths.sum()), int(n.sum())
        starts = lengths.cumsum(0) - lengths
        seq = torch.repeat_interleave(torch.arange(B), lengths)
        within = torch.arange(N) - starts[seq]
        resp_seq = torch.repeat_interleave(torch.arange(B), n)
        t = torch.arange(M) - (n.cumsum(0) - n)[resp_seq]
        source = None
        if prompt_width is not None:
            width = int(prompt_width) + T
            source = seq * width + (int(prompt_width) - p)[seq] + within
        # Built on the host from the host lengths, then moved in one place (fastrlhf.engine.device).
        return cls(
            prompt_lens=prompt_lens, completion_lens=completion_lens, response_width=T,
            **to_device(dict(position_ids=within.view(1, N), hidden_index=starts[resp_seq] + p[resp_seq] - 1 + t,
                             token_index=resp_seq * T + t, last_index=starts + lengths - 1, source_index=source),
                        device),
        )

    @classmethod
    def _build_shared(cls, prompt_lens, completion_lens, T, prompt_width, device, groups) -> PackedLayout:
        """Each group's prompt once, then its members' completions, each positioned as if it followed the
        prompt alone (positions p..p+n-1). Every completion attends to its prompt and causally to itself
        (``segments``), so each token sees exactly what it sees in its own sequence; the prompt's hidden
        states are computed once and their gradient is the sum over the group, as with separate copies."""
        if len(groups) != len(prompt_lens):
            raise ValueError(f"need one prompt group per sequence, got {len(groups)} for {len(prompt_lens)}")
        members: dict[int, list[int]] = {}
        for b, g in enumerate(groups):
            members.setdefault(g, []).append(b)
        width = None if prompt_width is None else int(prompt_width) + T
        # A loop over the pieces (each group's prompt, then its members' completions), never over tokens: each
        # piece's tokens follow on from its first position and source, and are laid out below in a few tensor ops.
        pieces, completions, segments = [], [], []  # pieces: (tokens, first position, first source)
        last = [0] * len(prompt_lens)
        at = 0
        for rows in members.values():
            p = prompt_lens[rows[0]]
            if any(prompt_lens[b] != p for b in rows):
                lengths = sorted({prompt_lens[b] for b in rows})
                raise ValueError(f"sequences of one prompt group have prompts of {lengths} "
                                 "tokens: a shared prompt must be the same prompt")
            start = at
            pieces.append((p, 0, 0 if width is None else rows[0] * width + int(prompt_width) - p))
            segments.append((start, start + p, start, start))
            at += p
            for b in rows:
                n = completion_lens[b]
                pieces.append((n, p, 0 if width is None else b * width + int(prompt_width)))
                last[b] = at + n - 1 if n else start + p - 1
                if n:
                    completions.append((at, n, b, start + p - 1))  # its first token is predicted by the prompt's last
                    segments.append((at, at + n, start, start + p))
                at += n

        def columns(records: list[tuple], fields: int) -> tuple[torch.Tensor, ...]:
            return torch.tensor(records, dtype=torch.long).reshape(-1, fields).unbind(1)

        tokens, first_position, first_source = columns(pieces, 3)
        piece = torch.repeat_interleave(torch.arange(len(pieces)), tokens)
        offset = torch.arange(at) - (tokens.cumsum(0) - tokens)[piece]
        c_at, c_len, c_row, c_before = columns(completions, 4)
        of = torch.repeat_interleave(torch.arange(len(completions)), c_len)  # each completion token's completion
        t = torch.arange(int(c_len.sum())) - (c_len.cumsum(0) - c_len)[of]
        hidden = torch.where(t == 0, c_before[of], c_at[of] + t - 1)
        # Built on the host from the host lengths, then moved in one place (fastrlhf.engine.device).
        return cls(prompt_lens=prompt_lens, completion_lens=completion_lens, response_width=T, segments=segments,
                   **to_device(dict(position_ids=(first_position[piece] + offset).view(1, -1), hidden_index=hidden,
                                    token_index=c_row[of] * T + t, last_index=torch.tensor(last, dtype=torch.long),
                                    source_index=None if width is None else first_source[piece] + offset), device))

    def model_kwargs(self, shared_masks=None) -> dict:
        """What a forward pass of this row takes besides ``input_ids``: ``position_ids``, the row's
        FlexAttention block mask (built when the flex backend first reads it) as its attention mask and its bounds
        (``fastrlhf_rows``), all from the host lengths (``fastrlhf.sequences.packed_attention``: the attention of
        a run with ``trainer.packing``). ``shared_masks``: a ``SharedBlockMasks`` the block mask is taken from (the
        batch's, shared by every model that runs this layout)."""
        from fastrlhf.sequences.packed_attention import LazyBlockMask, PackedRows

        device = self.position_ids.device
        lengths = [p + n for p, n in zip(self.prompt_lens, self.completion_lens, strict=True)]
        if self.segments is not None:
            segments = self.segments
            bounds = sorted({0, *(end for _, end, _, _ in segments)})
        else:  # one segment per sequence, causal within itself and no prefix
            bounds = sorted(set(itertools.accumulate(lengths, initial=0)))
            segments = [(s, e, s, s) for s, e in itertools.pairwise(bounds)]
        rows = PackedRows(bounds=bounds, segments=self.segments,
                          cu=to_device(torch.tensor(bounds, dtype=torch.int32), device))
        # Built only if the flex backend reads it (sdpa and flash-attn take the bounds).
        return dict(attention_mask=LazyBlockMask(segments, self.num_tokens, device, shared_masks),
                    position_ids=self.position_ids, fastrlhf_rows=rows)

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_lens)

    @property
    def num_tokens(self) -> int:
        return self.position_ids.shape[1]

    def pack_padded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[1, N]`` ids from the padded ``[B, prompt_width + T]`` ones (built with ``prompt_width``)."""
        if self.source_index is None:
            raise ValueError("this layout was built without prompt_width: it cannot read a padded batch")
        return input_ids.reshape(-1)[self.source_index].view(1, -1)

    def take(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[M]`` completion-token entries of a ``[B, T]`` tensor, in packed order."""
        return per_token.reshape(-1)[self.token_index]

    def put(self, flat: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[B, T]`` from ``[M]`` completion-token values (``fill`` elsewhere); differentiable."""
        out = flat.new_full((self.num_sequences * self.response_width,), fill)
        return out.index_put((self.token_index,), flat).view(self.num_sequences, self.response_width)
