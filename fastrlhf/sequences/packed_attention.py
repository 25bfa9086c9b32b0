"""The attention of packed rows, one transformers attention implementation for every backend.

A packed row (``fastrlhf.sequences.packing.PackedLayout``: sequences end to end, positions restarting at 0, or
with shared prompts each group's prompt once) comes with :class:`PackedRows` (its bounds, known on
the host) and a FlexAttention block mask built on the host from them (:func:`block_mask`), once per layout for
all the models that run it (:class:`SharedBlockMasks`). Passed as
the attention mask, the block mask also keeps transformers from searching the position ids for the
packing (a device read per forward on a GPU) and from building a dense ``[N, N]`` mask.
``fastrlhf_packed`` then runs the row with the run's backend (``model.attention``, chosen by
:mod:`fastrlhf.sequences.attention`):

- ``flex``: FlexAttention with that block mask (compiled on CUDA): masked blocks are skipped;
- ``flash_attention_2``: flash-attn's variable-length kernel with the layout's ``cu_seqlens``;
- ``sdpa``: one causal sdpa call per sequence (per segment with shared prompts): the cost is the sum of
  the squares of the sequence lengths, not the square of the row (a dense mask made a 2,224-token row
  of workload C cost 1.24x the padded batch it replaced).

Everything else (a padded batch with its mask, generation with a cache) runs sdpa, as before.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

NAME = "fastrlhf_packed"
# FlexAttention's default tile: the block mask's granularity.
BLOCK_SIZE = 128


@dataclass
class PackedRows:
    """What the attention of one packed row needs besides q, k, v (a forward kwarg, host data but ``cu``).

    ``bounds``: start offsets of the sequences plus the row's length; ``segments``: with shared prompts,
    ``(start, end, prefix_start, prefix_end)`` per attention segment (tokens ``start:end`` see the prefix,
    then causally themselves); ``cu``: ``bounds`` as a device int32 tensor (flash-attn's ``cu_seqlens``).
    """

    bounds: list[int]
    segments: list[tuple[int, int, int, int]] | None
    cu: torch.Tensor

    @property
    def longest(self) -> int:
        if self.segments is not None:
            return max(end - start + pe - ps for start, end, ps, pe in self.segments)
        return max(e - s for s, e in itertools.pairwise(self.bounds))


def set_backend(model: torch.nn.Module, backend: str) -> None:
    """Run ``model``'s packed rows with ``backend`` (on its attention layers: a module attribute, so it is
    never written into the model's config.json)."""
    for m in model.modules():
        if hasattr(m, "layer_idx"):
            m.fastrlhf_attention = backend


def sequence_bounds(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row of ``position_ids`` ``[B, N]``: the start offsets of its sequences plus its length. A sequence starts
    wherever a position is not the previous one plus 1 (transformers' rule, ``find_packed_sequence_indices``).
    One device read for all the rows (a read per row stalled a GPU B times per layer): the starts are found on the
    host, as a nonzero on the device reads its count and then the indices."""
    bounds = [[0] for _ in range(position_ids.shape[0])]
    for row, column in torch.nonzero((position_ids[:, 1:] != position_ids[:, :-1] + 1).cpu()).tolist():
        bounds[row].append(column + 1)
    return [b + [position_ids.shape[1]] for b in bounds]


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window=None, position_ids=None, fastrlhf_rows: PackedRows | None = None, softcap=None,
                     s_aux=None, **kwargs):
    """transformers attention interface: ``query`` ``[B, Hq, N, D]``, ``key``/``value`` ``[B, Hkv, N, D]``
    -> (``[B, N, Hq, D]``, None). ``softcap`` (Gemma-2's ``attn_logit_softcapping``) runs in flex and flash-attn;
    ``s_aux`` (gpt-oss's attention sinks) nowhere here: both are refused where they would be dropped."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa(q, k, v, mask):
        return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)[0]

    backend = getattr(module, "fastrlhf_attention", "sdpa")
    _check_logit_terms(backend if fastrlhf_rows is not None else "sdpa", softcap, s_aux,
                       fastrlhf_rows is not None and fastrlhf_rows.segments is not None)
    if fastrlhf_rows is None:
        return _unlabelled(sdpa, query, key, value, attention_mask, position_ids, sliding_window, kwargs), None
    if sliding_window is not None and fastrlhf_rows.longest > sliding_window:  # a window no backend here applies
        raise ValueError(f"{NAME}: a sequence of {fastrlhf_rows.longest} tokens is longer than the model's sliding "
                         f"window ({sliding_window}); set trainer.packing: false for this model")
    if query.shape[0] != 1:
        raise ValueError(f"{NAME}: a packed row is a batch of one, got {query.shape[0]}")
    if backend == "flex":
        return _flex(query, key, value, attention_mask, scaling, softcap), None
    if backend == "flash_attention_2" and fastrlhf_rows.segments is None:
        return _flash_varlen(query, key, value, fastrlhf_rows, scaling, dropout if module.training else 0.0,
                             softcap), None
    if fastrlhf_rows.segments is not None:
        return _shared_prompt_attention(sdpa, query, key, value, fastrlhf_rows.segments), None
    return _per_sequence(sdpa, query, key, value, fastrlhf_rows.bounds), None


def _per_sequence(sdpa, query, key, value, bounds: list[int]) -> torch.Tensor:
    """sdpa with no mask is causal within each slice: exactly the block-diagonal causal mask."""
    if len(bounds) == 2:
        return sdpa(query, key, value, None)
    return torch.cat([sdpa(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None)
                      for s, e in itertools.pairwise(bounds)], dim=1)


def _unlabelled(sdpa, query, key, value, attention_mask, position_ids, sliding_window, kwargs) -> torch.Tensor:
    """A call without :class:`PackedRows`: a padded batch or generation (sdpa with its mask), or rows given by their
    position ids alone (bounds read from them once per forward, :func:`_bounds_once`). HF generate's prefill of
    unpadded prompts is one of these (transformers drops an all-ones mask): its rows hold one sequence each."""
    packed = attention_mask is None and position_ids is not None and query.shape[2] == key.shape[2] > 1
    if not packed:
        return sdpa(query, key, value, attention_mask)
    bounds = _bounds_once(kwargs.get("cu_seq_lens_q"), position_ids, query.shape[0])
    longest = max(e - s for b in bounds for s, e in itertools.pairwise(b))
    if sliding_window is not None and longest > sliding_window:
        raise ValueError(f"{NAME}: a sequence of {longest} tokens is longer than the model's sliding window "
                         f"({sliding_window}); set trainer.packing: false for this model")
    if all(len(b) == 2 for b in bounds):  # no row packs several sequences (HF generate's unpadded prefill)
        return sdpa(query, key, value, None)
    rows = [_per_sequence(sdpa, query[i:i + 1], key[i:i + 1], value[i:i + 1], b) for i, b in enumerate(bounds)]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


# The last bounds read, with a weak reference to the tensor read: every layer of a forward gets the same one.
_last_bounds: tuple | None = None


def _bounds_once(cu, position_ids: torch.Tensor, rows: int) -> list[list[int]]:
    """Per row the bounds of its sequences, from ``cu`` (transformers' ``cu_seq_lens_q``, one row) or else the
    position ids: read from the device once per forward, not in each layer (a GPU stall per layer per forward)."""
    global _last_bounds
    source = cu if cu is not None and rows == 1 else position_ids
    version = None if source.is_inference() else source._version  # an inference tensor keeps no version
    last = _last_bounds
    if last is not None and last[0]() is source and last[1:3] == (version, rows):
        return last[3]
    if source is cu:
        bounds = [cu.tolist()]
    else:
        bounds = sequence_bounds(position_ids.expand(rows, -1) if position_ids.shape[0] != rows else position_ids)
    _last_bounds = (weakref.ref(source), version, rows, bounds)
    return bounds


def _check_logit_terms(backend: str, softcap, sinks, shared: bool) -> None:
    """Refuse a model's attention-logit terms where the kernel that runs would drop them: sdpa applies neither a
    softcap nor sinks (transformers' own sdpa drops them too), flex and flash-attn apply the softcap only."""
    if sinks is not None:
        raise ValueError(f"{NAME}: this model has attention sinks (gpt-oss `sinks`), which no packed attention here "
                         "applies; set trainer.packing: false for this model")
    if softcap is not None and (backend == "sdpa" or (backend == "flash_attention_2" and shared)):
        raise ValueError(f"{NAME}: this model caps its attention logits (attn_logit_softcapping: {softcap}), which "
                         f"the {backend} path drops; set model.attention: flex (a GPU) or trainer.packing: false")


_compiled_flex = None
_softcaps: dict = {}


def _softcap_mod(softcap: float):
    """Gemma-2's ``softcap * tanh(score / softcap)``, one function per value (a new one would recompile flex)."""
    if softcap not in _softcaps:
        _softcaps[softcap] = lambda score, b, h, q, kv: softcap * torch.tanh(score / softcap)
    return _softcaps[softcap]


def _flex(query, key, value, mask, scaling, softcap=None) -> torch.Tensor:
    """FlexAttention with the row's block mask: compiled on CUDA (eager FlexAttention is a dense reference)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if not isinstance(mask, BlockMask):
        raise ValueError(f"{NAME}: the flex backend needs the packed row's block mask, got {type(mask).__name__}")
    if isinstance(mask, LazyBlockMask):
        mask = mask.built()
    fn = flex_attention
    if query.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        fn = _compiled_flex
    out = fn(query, key, value, block_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
             score_mod=None if softcap is None else _softcap_mod(float(softcap)))
    return out.transpose(1, 2).contiguous()


def _flash_varlen(query, key, value, rows: PackedRows, scaling, dropout: float, softcap=None) -> torch.Tensor:
    """flash-attn's variable-length kernel over the row's sequences (it takes GQA as it is); ``softcap`` needs
    flash-attn 2.6 or later, so it is passed only when the model has one."""
    from flash_attn import flash_attn_varlen_func

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, D]
    longest = rows.longest
    extra = {} if softcap is None else dict(softcap=float(softcap))
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=rows.cu, cu_seqlens_k=rows.cu, max_seqlen_q=longest,
                                 max_seqlen_k=longest, dropout_p=dropout, softmax_scale=scaling, causal=True, **extra)
    return out[None]


def _shared_prompt_attention(sdpa, query, key, value, segments):
    """One packed row (B = 1) of segments ``(start, end, prefix_start, prefix_end)``: the tokens
    ``start:end`` attend to the whole prefix and causally to themselves, as the same tokens right after
    the prefix would in a sequence of their own."""
    outs = []
    for start, end, prefix_start, prefix_end in segments:
        q = query[:, :, start:end]
        if prefix_end == prefix_start:
            outs.append(sdpa(q, key[:, :, start:end], value[:, :, start:end], None))
            continue
        k = torch.cat([key[:, :, prefix_start:prefix_end], key[:, :, start:end]], dim=2)
        v = torch.cat([value[:, :, prefix_start:prefix_end], value[:, :, start:end]], dim=2)
        # Query i (0-based in the segment) sees the prefix and segment keys 0..i: causal, lower-right aligned.
        prefix = prefix_end - prefix_start
        mask = torch.ones(end - start, prefix + end - start, dtype=torch.bool, device=q.device).tril(prefix)
        outs.append(sdpa(q, k, v, mask[None, None]))
    return torch.cat(outs, dim=1)


def block_mask(token_segments: list[tuple[int, int, int, int]], length: int, device,
               block: int = BLOCK_SIZE):
    """The FlexAttention ``BlockMask`` of a packed row, built on the host from its segments and moved once.

    ``token_segments``: ``(start, end, prefix_start, prefix_end)`` covering the row: tokens ``start:end``
    attend causally within ``start:end`` and to every token of ``prefix_start:prefix_end`` (empty for a
    plain packed sequence). A ``block x block`` tile is listed as full when every pair in it may attend
    (no mask evaluated there), as partial when some may (the mask function decides), else skipped.
    """
    from torch.nn.attention.flex_attention import BlockMask

    own_lo, pre_lo, pre_hi = torch.empty(length, dtype=torch.long), torch.zeros(length, dtype=torch.long), \
        torch.zeros(length, dtype=torch.long)
    for start, end, prefix_start, prefix_end in token_segments:
        own_lo[start:end], pre_lo[start:end], pre_hi[start:end] = start, prefix_start, prefix_end
    blocks = -(-length // block)
    r0 = torch.arange(blocks) * block
    r1 = torch.clamp(r0 + block, max=length) - 1
    q0, q1, c0, c1 = r0[:, None], r1[:, None], r0[None, :], r1[None, :]
    # Causal within the own segment: own_lo is non-decreasing along the row.
    first = torch.maximum(q0, c0)
    any_own = (first <= q1) & (own_lo[first.clamp(max=length - 1)] <= c1)
    full_own = (c1 <= q0) & (own_lo[r1][:, None] <= c0)
    full, listed = full_own, any_own
    # Shared prompts: per segment, the key tiles its prefix touches, and per tile pair how many queries have a prefix
    # covering the key tile (full where that is every query of the tile). Per segment, not per token x tile, which
    # grew as N^2 / block (a 123k-token row: 1.1 s and ~2 GB of host temporaries per micro-batch).
    prefixed = [(s, e, lo, hi) for s, e, lo, hi in token_segments if hi > lo and e > s]
    if prefixed:
        touched = torch.zeros(blocks, blocks, dtype=torch.bool)
        covered = torch.zeros(blocks, blocks, dtype=torch.long)
        for start, end, lo, hi in prefixed:
            q_first, q_last = start // block, (end - 1) // block
            tiles = slice(q_first, q_last + 1)
            queries = torch.clamp(r1[tiles], max=end - 1) - torch.clamp(r0[tiles], min=start) + 1
            touched[tiles] |= (lo <= r1) & (hi > r0)
            covered[tiles] += queries[:, None] * ((lo <= r0) & (hi > r1))
        listed = listed | touched
        full = full | (covered == (r1 - r0 + 1)[:, None])
    partial = listed & ~full

    def indices(kind: torch.Tensor):
        counts = kind.sum(-1).to(torch.int32)
        order = torch.argsort((~kind).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # listed blocks first
        return counts[None, None], order[None, None]

    from fastrlhf.engine.device import to_device

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    # Per-token data padded to whole tiles, so that the mask function indexes it at any position of a tile
    # and captures tensors only: a compiled kernel is then reused for every row, whatever its length.
    pad = blocks * block - length
    seg = to_device(torch.nn.functional.pad(own_lo, (0, pad), value=-1), device)
    lo, hi = (to_device(torch.nn.functional.pad(t, (0, pad)), device) for t in (pre_lo, pre_hi))

    def mask_mod(b, h, q, kv):
        return ((seg[q] == seg[kv]) & (kv <= q)) | ((kv >= lo[q]) & (kv < hi[q]))

    kv_num, kv_idx, full_num, full_idx = to_device((kv_num, kv_idx, full_num, full_idx), device)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(length, length))


# The most bytes of block masks a batch keeps for its models to share (SharedBlockMasks); past it, built per use.
SHARED_MASK_BYTES = 256 << 20


def _mask_bytes(mask: BlockMask) -> int:
    """Device bytes a built block mask holds: its block indices and the per-token data its mask function reads."""
    cells = [c.cell_contents for c in getattr(mask.mask_mod, "__closure__", None) or ()]
    return sum(t.numel() * t.element_size() for t in [*mask.as_tuple(), *cells] if isinstance(t, torch.Tensor))


class SharedBlockMasks:
    """The block masks of one batch's packed rows by layout, each built once: the actor's old logprobs, the
    reference, the critic and the update's passes run the same micro-batch, and each built the same mask (host
    time, copies and kernels). A mask is a function of its segments, row length, device and tile alone (a softcap
    is flex's ``score_mod``; a sliding window shorter than a sequence is refused), so that is its key, known on the
    host. Held as long as the batch (``fastrlhf.rl.experience.Experience.block_masks``), up to ``budget`` bytes."""

    def __init__(self, budget: int | None = None):
        self.budget, self.held, self._masks = SHARED_MASK_BYTES if budget is None else budget, 0, {}

    def __len__(self) -> int:
        return len(self._masks)

    def get(self, segments: list[tuple[int, int, int, int]], length: int, device, block: int = BLOCK_SIZE):
        key = (tuple(segments), int(length), torch.device(device), int(block))
        mask = self._masks.get(key)
        if mask is None:
            mask = block_mask(segments, length, device, block)
            size = _mask_bytes(mask)
            if self.held + size <= self.budget:
                self._masks[key], self.held = mask, self.held + size
        return mask


class LazyBlockMask(BlockMask):
    """A packed row's block mask, built (:func:`block_mask`) when first read: only the flex backend reads it, and
    building it costs host time that grows with the row (95 ms at 181k tokens), per micro-batch. Until then it is
    to transformers an already prepared 4-D mask (``shape``), so it builds none and reads no position ids. With
    ``shared``, the batch's masks: one built for the same layout by another model's pass is taken from there."""

    def __init__(self, segments: list[tuple[int, int, int, int]], length: int, device,
                 shared: SharedBlockMasks | None = None):
        self._args, self._shared, self._mask = (segments, length, device), shared, None

    @property
    def shape(self) -> tuple[int, ...]:
        return (1, 1, self._args[1], self._args[1])

    def built(self):
        if self._mask is None:
            self._mask = block_mask(*self._args) if self._shared is None else self._shared.get(*self._args)
        return self._mask

    def __getattr__(self, name):  # only for what __init__ did not set: the built mask's fields
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.built(), name)


def check_model(model) -> None:
    """Raise unless ``model`` (a transformers model or decoder) runs this attention: any other would
    misread a packed row (its block mask, its segments) and attend across sequences."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != NAME:
        raise ValueError(f"a packed row (trainer.packing) needs the {NAME} attention "
                         f"(fastrlhf.modeling.use_attention); this model runs {impl!r}")


def _mask(*, attention_mask=None, **kwargs):
    """The mask transformers builds for this implementation: sdpa's for a padded batch; none for a
    row without a padding mask (causality and packed boundaries are the attention function's job)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register ``fastrlhf_packed`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # Never traced by torch.compile (model.compile: fastrlhf.modeling.compile): its host data would make every
    # micro-batch a recompile. FlexAttention, compiled on its own, still is.
    AttentionInterface.register(NAME, torch.compiler.disable(packed_attention))
    AttentionMaskInterface.register(NAME, _mask)
    return NAME
