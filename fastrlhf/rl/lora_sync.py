"""Weight sync for a LoRA (PEFT) actor: the rollout engine gets plain HF weights with the adapter merged.

The bucketed stream of ``fastrlhf.rollout.weight_sync.iter_bucketed_weights`` (ZeRO-3 gathers
included) is rewritten on the fly: ``x.base_layer.weight`` is held until ``x.lora_A.<a>.weight`` and
``x.lora_B.<a>.weight`` arrive (they follow it in parameter order) and leaves as
``x.weight = W + scaling * B @ A``; the ``base_model.model.`` prefix is dropped. An adapted embedding
(``embed_tokens`` in ``model.lora_targets``) has ``x.lora_embedding_A.<a>`` ``[r, V]`` and
``x.lora_embedding_B.<a>`` ``[H, r]`` instead, and merges as PEFT's ``Embedding`` does: ``W + scaling * (B @ A).T``.
Only one layer's tensors are held at a time, so memory stays at about one bucket. A module peft trains whole
(``modules_to_save``: a reward model's ``score`` head) leaves as its trained copy under its own name.

The export (``fastrlhf.modeling.loading.export_hf``) merges a gathered state dict the same way
(:func:`merged_state_dict`) and writes the adapter itself beside it as peft saves one (:func:`save_adapter`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["is_peft_model", "merged_lora_weights", "merged_state_dict", "save_adapter", "sync_lora_weights"]

_PREFIX = "base_model.model."
# Where a PEFT name splits into (layer, rest), and which part of the merge the tensor is: an embedding's factors
# are lora_embedding_A/B, a Linear's lora_A/B.
_MARKERS = ((".base_layer.", "base_layer"), (".lora_A.", "lora_A"), (".lora_B.", "lora_B"),
            (".lora_embedding_A.", "lora_A"), (".lora_embedding_B.", "lora_B"))


def is_peft_model(module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def _strip(name: str) -> str:
    return name[len(_PREFIX):] if name.startswith(_PREFIX) else name


def _lora_scalings(peft_model) -> dict[str, tuple[str, float, bool]]:
    """``{layer name without prefix: (adapter, scaling, whether the delta is transposed)}`` for every LoRA layer's
    active adapter. Transposed: an embedding's (``[V, H]`` weight, ``[H, r] @ [r, V]`` factors) and a layer stored
    ``[in, out]`` (``fan_in_fan_out``: GPT-2's Conv1D), as PEFT merges them."""
    out = {}
    for name, module in peft_model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and hasattr(module, "lora_A"):
            adapters = [a for a in getattr(module, "active_adapters", ["default"]) if a in scaling]
            if len(adapters) != 1:
                raise ValueError(f"LoRA sync supports one active adapter per layer, {name} has {adapters}")
            embedding = adapters[0] in getattr(module, "lora_embedding_A", {})
            transposed = embedding or bool(getattr(module, "fan_in_fan_out", False))
            out[_strip(name)] = (adapters[0], float(scaling[adapters[0]]), transposed)
    return out


def _whole_copies(peft_model) -> dict[str, str]:
    """``{module name without prefix: active adapter}`` for every module peft trains whole (``modules_to_save``),
    which holds the frozen ``original_module`` and a trained copy per adapter in ``modules_to_save.<adapter>``."""
    out = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "original_module") and isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict):
            adapters = [a for a in (getattr(module, "active_adapters", None) or ["default"])
                        if a in module.modules_to_save]
            if len(adapters) != 1:
                raise ValueError(f"LoRA sync supports one active adapter per module, {name} has {adapters}")
            out[_strip(name)] = adapters[0]
    return out


def _whole_copy_name(name: str, copies: dict[str, str]) -> str | None:
    """The HF name of a tensor of a module trained whole: its active copy's under the module's name, "" for the
    frozen original and other adapters' copies (dropped); None for any other tensor."""
    for module, adapter in copies.items():
        if name.startswith(f"{module}.modules_to_save.{adapter}."):
            return f"{module}.{name[len(f'{module}.modules_to_save.{adapter}.'):]}"
        if name.startswith((f"{module}.original_module.", f"{module}.modules_to_save.")):
            return ""
    return None


def merged_lora_weights(peft_model, stream: Iterable[tuple[str, torch.Tensor]],
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Rewrite a (PEFT name, tensor) stream into merged HF (name, tensor) pairs."""
    scalings, copies = _lora_scalings(peft_model), _whole_copies(peft_model)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        name = _strip(name)
        whole = _whole_copy_name(name, copies) if copies else None
        if whole is not None:
            if whole:
                yield whole, tensor.to(dtype) if dtype is not None else tensor
            continue
        layer, kind = None, None
        for marker, part in _MARKERS:
            if marker in name:
                layer, rest = name.split(marker, 1)
                kind = part
                break
        if layer is None or layer not in scalings:
            yield name, tensor.to(dtype) if dtype is not None else tensor
            continue
        adapter, scaling, transposed = scalings[layer]
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
            if transposed:
                delta = delta.T
            yield f"{layer}.weight", (w.float() + scaling * delta).to(dtype or w.dtype)
    if pending:
        raise RuntimeError(f"LoRA sync: incomplete layers in the weight stream: {sorted(pending)[:3]}")


def merged_state_dict(peft_model, state: dict, dtype: torch.dtype) -> dict:
    """``state`` (``peft_model``'s full state dict) as its base model's: each adapter merged into its layer as the
    weight sync merges it (in fp32, rounded once), every floating tensor in ``dtype`` (the export's, as trained).
    Unmerged tensors are ``state``'s own (no copy in their dtype), so the base model saves it with no second model.
    Takes ``state``'s entries out as it goes: under ZeRO-3 they are the only (host) copies, each base weight freed
    once merged, so the host holds about one model, not the gathered one and the merged one."""
    stream = ((name, state.pop(name)) for name in list(state))
    return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
            for name, tensor in merged_lora_weights(peft_model, stream)}


def save_adapter(peft_model, state: dict, out_dir: str) -> None:
    """The adapter alone in ``out_dir``, written by peft (``adapter_config.json``, ``adapter_model.safetensors``):
    ``PeftModel.from_pretrained(base, out_dir)`` stacks it on the base model. Its tensors come from ``state`` (the
    export's gathered state dict), never from ``peft_model``'s parameters, which ZeRO-3 partitions. The embedding is
    not saved whole: the vocabulary is the base model's."""
    peft_model.save_pretrained(out_dir, state_dict=state, safe_serialization=True, save_embedding_layers=False)


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
