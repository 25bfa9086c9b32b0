"""The attention mask a padded micro-batch's forward is given: built on the device from what the host knows.

Given a 2D padding mask, or none, transformers works out the attention masks itself and reads the device to do so
(a stall per forward on a GPU): ``_ignore_causal_mask_sdpa`` asks whether any token is padding, and without a mask
``find_packed_sequence_indices`` looks for packed sequences in the positions it makes up. So a forward on sdpa
gets its mask built (:func:`forward_mask`):

- rows with padding: the causal ``[B, 1, L, L]`` mask with the padding keys masked (:func:`padded_causal_mask`);
- rows without padding: on a decoder that takes its masks prepared per layer type (Qwen2's, for ``generate``),
  None for each type, which sdpa runs as causal with its fastest kernels; elsewhere the same causal mask.

A model with sliding-window layers (Mistral's, Gemma 3's, Qwen2 with ``use_sliding_window``) keeps its window
when a row is longer than it: the windowed mask for every layer where all of them slide, one mask per layer type
where the decoder takes them prepared, else the 2D mask, from which transformers builds both (reading the device).
Other attentions (eager and flex are causal only through their mask) get the 2D mask, or none, as before.
"""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["SDPA_ATTENTIONS", "forward_mask", "padded_causal_mask", "sliding_window"]

# Attention implementations whose padded batches run torch's sdpa with the mask they are given.
SDPA_ATTENTIONS = ("sdpa", "fastrlhf_packed")


def padded_causal_mask(attention_mask: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[B, 1, L, L]`` bool (True: attend) of right- or left-padded rows: causal, padding keys masked; with
    ``window``, a query sees only the ``window`` latest keys, itself included (transformers'
    ``sliding_window_overlay``). A padding query attends to itself, so that no row is empty (its output is
    never read)."""
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    if window is not None:
        causal = causal.triu(1 - window)
    eye = torch.eye(length, dtype=torch.bool, device=attention_mask.device)
    return (causal & attention_mask.bool()[:, None, None, :]) | eye


def sliding_window(config) -> tuple[int | None, bool]:
    """``(window, every_layer)`` of a transformers config: the sliding window its sliding layers apply (None:
    none do) and whether every layer slides (Mistral's kind, with no per-layer types)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return None, False
    if layer_types is None:
        return window, True
    return (window, all(t == "sliding_attention" for t in layer_types)) if "sliding_attention" in layer_types \
        else (None, False)


def forward_mask(decoder: torch.nn.Module, attention: str | None, attention_mask: torch.Tensor, padded: bool):
    """The ``attention_mask`` argument of a forward on rows laid out as ``attention_mask`` (``[B, L]``, 1 on real
    tokens; ``padded``: whether any is 0) by a model whose transformers decoder is ``decoder`` and whose
    attention implementation is ``attention``."""
    if attention not in SDPA_ATTENTIONS:
        return attention_mask if padded else None
    layer_types = set(getattr(decoder.config, "layer_types", None) or ["full_attention"])
    if layer_types - {"full_attention", "sliding_attention"}:  # chunked attention and the like: transformers' masks
        return attention_mask if padded else None
    window, every_layer = sliding_window(decoder.config)
    windowed = window is not None and attention_mask.shape[1] > window
    prepared = _takes_prepared_masks(type(decoder))
    if windowed and every_layer:
        return padded_causal_mask(attention_mask, window)
    if windowed:
        if not prepared:
            return attention_mask
        return {t: padded_causal_mask(attention_mask, window if t == "sliding_attention" else None)
                for t in layer_types}
    if not padded and prepared and attention == "sdpa":
        return dict.fromkeys(layer_types)
    return padded_causal_mask(attention_mask)


@functools.cache
def _takes_prepared_masks(decoder_class: type) -> bool:
    """Whether a transformers decoder's forward takes a ``{layer type: mask}`` dict as its ``attention_mask``
    (58 architectures in transformers 5.19, Qwen2, Qwen3 and Gemma 3 among them; not Llama or Mistral):
    transformers declares it nowhere but in the forward's code."""
    try:
        return "causal_mask_mapping := attention_mask, dict" in inspect.getsource(decoder_class.forward)
    except (OSError, TypeError):
        return False
