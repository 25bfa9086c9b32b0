"""Attention for packed rows without a GPU: each packed sequence attends to itself alone, with no ``[N, N]`` mask.

A packed row (``fastrlhf.packing.PackedLayout``: sequences end to end, positions restarting at 0) has
no attention mask; transformers reads the restarts as boundaries. With flash-attention (a GPU) that
is the variable-length kernel. With sdpa it is a dense block-diagonal ``[N, N]`` mask, so the work and
the saved activations grow with the square of the row (a 2,224-token row of workload C cost 1.24x
the padded batch it replaced) and most of it is masked out.

``fastrlhf_packed_sdpa`` is sdpa with one change: a row whose positions restart runs one causal
sdpa call per sequence, so the cost is the sum of the squares of the sequence lengths. Everything
else (padded batches with their mask, generation with a cache) goes to transformers' own sdpa. It is
registered as a transformers attention implementation; :func:`fastrlhf.modeling.use_packed_attention`
selects it when ``trainer.packing`` is on and there is no GPU (it reads the
sequence boundaries on the host, which on a GPU would wait on the device at every layer).
"""

from __future__ import annotations

import itertools

import torch

NAME = "fastrlhf_packed_sdpa"


def sequence_bounds(position_ids: torch.Tensor) -> list[int]:
    """Start offsets of the sequences of one packed row plus its length: a sequence starts wherever a
    position is not the previous one plus 1 (transformers' rule, ``find_packed_sequence_indices``)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
    return [0, *starts.tolist(), pos.numel()]


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          sliding_window=None, position_ids=None, fastrlhf_segments=None, **kwargs):
    """transformers attention interface: ``query`` ``[B, Hq, N, D]``, ``key``/``value`` ``[B, Hkv, N, D]``
    -> (``[B, N, Hq, D]``, None). ``fastrlhf_segments``: a row with shared prompts
    (``fastrlhf.packing.PackedLayout.segments``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa(q, k, v, mask):
        return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)[0]

    if fastrlhf_segments is not None:
        return _shared_prompt_attention(sdpa, query, key, value, fastrlhf_segments, sliding_window), None

    packed = (attention_mask is None and position_ids is not None and query.shape[2] == key.shape[2] > 1)
    if not packed:
        return sdpa(query, key, value, attention_mask), None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None and query.shape[0] == 1:  # the layout's own boundaries (fastrlhf.packing), host-known
        bounds = [cu.tolist()]
    else:
        pos = position_ids.expand(query.shape[0], -1) if position_ids.shape[0] != query.shape[0] else position_ids
        bounds = [sequence_bounds(row) for row in pos]
    longest = max(e - s for b in bounds for s, e in itertools.pairwise(b))
    if sliding_window is not None and longest > sliding_window:  # the window lives in the mask we do not build
        raise ValueError(f"{NAME}: a sequence of {longest} tokens is longer than the model's sliding window "
                         f"({sliding_window}); set trainer.packing: false for this model")
    if all(len(b) == 2 for b in bounds):  # no restarts: plain causal rows
        return sdpa(query, key, value, None), None
    # sdpa with no mask is causal within each slice: exactly the block-diagonal causal mask.
    rows = [torch.cat([sdpa(query[i:i + 1, :, s:e], key[i:i + 1, :, s:e], value[i:i + 1, :, s:e], None)
                       for s, e in itertools.pairwise(b)], dim=1) for i, b in enumerate(bounds)]
    return (rows[0] if len(rows) == 1 else torch.cat(rows)), None


def _shared_prompt_attention(sdpa, query, key, value, segments, sliding_window):
    """One packed row (B = 1) of segments ``(start, end, prefix_start, prefix_end)``: the tokens
    ``start:end`` attend to the whole prefix and causally to themselves, as the same tokens right after
    the prefix would in a sequence of their own."""
    if query.shape[0] != 1:
        raise ValueError(f"{NAME}: shared-prompt segments describe one packed row, got a batch of {query.shape[0]}")
    longest = max(end - start + prefix_end - prefix_start for start, end, prefix_start, prefix_end in segments)
    if sliding_window is not None and longest > sliding_window:
        raise ValueError(f"{NAME}: a sequence of {longest} tokens is longer than the model's sliding window "
                         f"({sliding_window}); set trainer.packing: false for this model")
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


def check_model(model) -> None:
    """Raise unless ``model`` (a transformers model or decoder) runs this attention: a row with shared
    prompts given to any other would run without its segments, attending across sequences."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != NAME:
        raise ValueError(f"shared-prompt packing (trainer.share_prompts) needs the {NAME} attention (CPU, sdpa "
                         f"models); this model runs {impl!r}")


def _mask(*, attention_mask=None, **kwargs):
    """The mask transformers builds for this implementation: sdpa's for a padded batch; none for a
    row without a padding mask (causality and packed boundaries are the attention function's job)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register ``fastrlhf_packed_sdpa`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_sdpa_attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME
