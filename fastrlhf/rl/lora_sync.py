"""Weight sync for a LoRA (PEFT) actor: the rollout engine gets plain HF weights with the adapter merged.

The bucketed stream of ``fastrlhf.rollout.weight_sync.iter_bucketed_weights`` (ZeRO-3 gathers
included) is rewritten on the fly: ``x.base_layer.weight`` is held until ``x.lora_A.<a>.weight`` and
``x.lora_B.<a>.weight`` arrive (they follow it in parameter order) and leaves as
``x.weight = W + scaling * B @ A``; the ``base_model.model.`` prefix is dropped. An adapted embedding
(``embed_tokens`` in ``model.lora_targets``) has ``x.lora_embedding_A.<a>`` ``[r, V]`` and
``x.lora_embedding_B.<a>`` ``[H, r]`` instead, and merges as PEFT's ``Embedding`` does: ``W + scaling * (B @ A).T``.
Only one layer's tensors are held at a time, so memory stays at about one bucket.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

__all__ = ["is_peft_model", "merged_lora_weights", "sync_lora_weights"]

_PREFIX = "base_model.model."
# Where a PEFT name splits into (layer, rest), and which part of the merge the tensor is: an embedding's factors
# are lora_embedding_A/B, a Linear's lora_A/B.
_MARKERS = ((".base_layer.", "base_layer"), (".lora_A.", "lora_A"), (".lora_B.", "lora_B"),
            (".lora_embedding_A.", "lora_A"), (".lora_embedding_B.", "lora_B"))


def is_peft_model(module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def _lora_scalings(peft_model) -> dict[str, tuple[str, float, bool]]:
    """``{layer name without prefix: (adapter, scaling, whether an embedding)}`` for every LoRA layer's active
    adapter."""
    out = {}
    for name, module in peft_model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and hasattr(module, "lora_A"):
            adapters = [a for a in getattr(module, "active_adapters", ["default"]) if a in scaling]
            if len(adapters) != 1:
                raise ValueError(f"LoRA sync supports one active adapter per layer, {name} has {adapters}")
            embedding = adapters[0] in getattr(module, "lora_embedding_A", {})
            out[name[len(_PREFIX):] if name.startswith(_PREFIX) else name] = (adapters[0], float(scaling[adapters[0]]),
                                                                              embedding)
    return out


def merged_lora_weights(peft_model, stream: Iterable[tuple[str, torch.Tensor]],
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Rewrite a (PEFT name, tensor) stream into merged HF (name, tensor) pairs."""
    scalings = _lora_scalings(peft_model)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        name = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
        layer, kind = None, None
        for marker, part in _MARKERS:
            if marker in name:
                layer, rest = name.split(marker, 1)
                kind = part
                break
        if layer is None or layer not in scalings:
            yield name, tensor.to(dtype) if dtype is not None else tensor
            continue
        adapter, scaling, embedding = scalings[layer]
        # a Linear's factor is "<a>.weight", an embedding's (a ParameterDict entry) "<a>" alone
        if kind != "base_layer" and rest != adapter and not rest.startswith(f"{adapter}."):
            continue  # an inactive adapter's tensors
        if kind == "base_layer" and rest != "weight":  # the base layer's bias passes through
            yield f"{layer}.{rest}", tensor.to(dtype) if dtype is not None else tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[kind] = tensor
        if len(parts) == 3:
            del pending[layer]
            w = parts["base_layer"]
            delta = parts["lora_B"].float() @ parts["lora_A"].float()
            if embedding:  # [H, r] @ [r, V]: the transpose of the embedding's [V, H]
                delta = delta.T
            yield f"{layer}.weight", (w.float() + scaling * delta).to(dtype or w.dtype)
    if pending:
        raise RuntimeError(f"LoRA sync: incomplete layers in the weight stream: {sorted(pending)[:3]}")


def sync_lora_weights(source, engine, bucket_bytes: int):
    """Like ``weight_sync.sync_weights`` for a PEFT actor (module or DeepSpeed engine); returns SyncStats."""
    from fastrlhf.rollout.weight_sync import SyncStats, iter_bucketed_weights, unwrap_model

    stats = SyncStats()
    dtype = getattr(engine, "weight_dtype", None)
    t0 = time.perf_counter()
    stream = iter_bucketed_weights(source, bucket_bytes, None, stats)
    engine.update_weights(_sent(merged_lora_weights(unwrap_model(source), stream, dtype), stats))
    stats.seconds = time.perf_counter() - t0
    return stats


def _sent(merged: Iterator[tuple[str, torch.Tensor]], stats) -> Iterator[tuple[str, torch.Tensor]]:
    """``merged`` as it is; ``stats`` ends with the bytes and tensors the engine got (merged, in its dtype), not the
    gathered stream's (adapter factors included, in the trainer's dtype), which the gather counted on the way."""
    sent = [0, 0]
    for name, tensor in merged:
        sent[0] += tensor.numel() * tensor.element_size()
        sent[1] += 1
        yield name, tensor
    stats.bytes, stats.num_tensors = sent
