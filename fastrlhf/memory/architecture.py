"""A decoder-only model's shape from its ``config.json``, and what follows from it: parameter counts,
LoRA adapter sizes, KV-cache bytes per token, and activation bytes per token (what a backward keeps, and
what a no-grad forward holds at once). No weights are read, no model is built.

Counted architectures (``model_type``): Llama, Mistral, Qwen2, Qwen3 (the HF classes
``*ForCausalLM`` and ``*ForSequenceClassification``). Per decoder layer:

- attention: q ``[h -> heads*d]``, k and v ``[h -> kv_heads*d]`` (GQA), o ``[heads*d -> h]``; biases on
  q/k/v for Qwen2, on q/k/v/o where ``attention_bias`` is set (Llama, Qwen3); Qwen3's per-head
  q/k RMSNorms (``d`` each);
- MLP (SwiGLU): gate and up ``[h -> I]``, down ``[I -> h]`` (biases where ``mlp_bias``, Llama);
- two RMSNorms (``h`` each).

Plus the embedding ``[V, h]``, the final norm, and an lm_head ``[V, h]`` unless
``tie_word_embeddings`` (a classifier has a ``[h -> num_labels]`` score head instead).
``tests/memory/test_plan.py`` checks the counts against ``sum(p.numel())`` of the real transformers models.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from fastrlhf.config.errors import ConfigError

__all__ = ["SUPPORTED_MODEL_TYPES", "LINEAR_MODULES", "ModelShape", "read_shape", "lora_target_problem"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The per-layer Linear modules of these architectures, by the names LoRA targets use.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    num_labels: int = 2

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """Each per-layer Linear: ``name -> (in_features, out_features, has_bias)``."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim, self.qkv_bias),
            "k_proj": (h, self.kv_dim, self.qkv_bias),
            "v_proj": (h, self.kv_dim, self.qkv_bias),
            "o_proj": (self.q_dim, h, self.o_bias),
            "gate_proj": (h, i, self.mlp_bias),
            "up_proj": (h, i, self.mlp_bias),
            "down_proj": (i, h, self.mlp_bias),
        }

    def layer_params(self) -> int:
        linear = sum(fan_in * fan_out + (fan_out if bias else 0) for fan_in, fan_out, bias in self.linears().values())
        return linear + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def backbone_params(self) -> int:
        """Embedding, decoder layers and the final norm (``model.*`` of the HF class)."""
        return self.embedding_params + self.layers * self.layer_params() + self.hidden

    def causal_lm_params(self) -> int:
        return self.backbone_params() + self.lm_head_params

    def classifier_params(self) -> int:
        """``*ForSequenceClassification``: the backbone and a bias-free ``[h -> num_labels]`` score head."""
        return self.backbone_params() + self.hidden * self.num_labels

    def largest_module_params(self) -> int:
        """The most parameters one module holds at once (what ZeRO-3 gathers in one piece)."""
        return max(self.embedding_params, self.lm_head_params, self.layer_params())

    def largest_param_params(self) -> int:
        """The largest single weight (a sync bucket holds at least one whole weight, however small the bucket)."""
        return max(self.embedding_params, self.lm_head_params,
                   *(fan_in * fan_out for fan_in, fan_out, _ in self.linears().values()))

    def lora_params(self, r: int, targets) -> int:
        """Trainable parameters of a PEFT LoRA adapter of rank ``r`` on ``targets`` (module names, or
        ``all-linear``): ``r x (in + out)`` per adapted Linear (``r x (V + h)`` for the embedding)."""
        problem = lora_target_problem(self.model_type, targets)
        if problem:
            raise ValueError(problem)
        names = list(LINEAR_MODULES) if list(targets) == ["all-linear"] else list(targets)
        shapes = {name: (fan_in, fan_out) for name, (fan_in, fan_out, _) in self.linears().items()}
        return sum(self.layers * r * sum(shapes[name]) if name in shapes else r * (self.vocab + self.hidden)
                   for name in names)

    def forward_bytes_per_token(self, dtype_bytes: int) -> int:
        """The most one no-grad forward of the decoder (``use_cache=False``) holds at once, per token, in
        activations of ``a`` bytes: nothing is kept for a backward, so it is one layer's working set.

        Alive through every layer: the embedding's output (the model's ``inputs_embeds``), the layer's
        input, and RoPE's cos and sin (``2h + 2d``). On top, the larger of the layer's two peaks:
        - the MLP's: the residual after attention, its RMSNorm's output, and SiLU(gate), up and their
          product at once (``2h + 3I``);
        - attention's: the normed input, q, k and v, RoPE's new q and k, k and v repeated to every
          head, the output and its contiguous copy (at most ``h + 5 heads d + 2 kv_heads d``).

        Measured with torch.profiler's allocation events on HF's Qwen2, Llama and Qwen3 layers (SDPA, fp32
        and bf16, padded or not): equal to within 1% where the MLP peaks (Qwen2.5-0.5B to 7B, Llama-3-8B,
        Qwen3-1.7B and 4B); where attention peaks (Qwen3-0.6B, whose q is twice h) 0-20% over the tensors
        its layer holds (``tests/memory/test_plan_scoring.py``).
        """
        a, h, d = dtype_bytes, self.hidden, self.head_dim
        mlp = 2 * h + 3 * self.intermediate
        attention = h + 5 * self.q_dim + 2 * self.kv_dim
        return a * (2 * h + 2 * d + max(mlp, attention))

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """The KV heads each rank of a vLLM tensor-parallel group of ``tp`` holds: the heads split over the ranks,
        replicated where there are fewer than ranks, so at least one (vLLM's ``ModelConfig.get_num_kv_heads``):
        Qwen2.5-1.5B's 2 at ``tp`` 4 leave each rank 1, half of them, not a quarter."""
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """K and V of every layer for one token, on one rank of a vLLM tensor-parallel group of ``tp``."""
        return self.layers * 2 * self.kv_heads_per_rank(tp) * self.head_dim * dtype_bytes

    def tp_rank_params(self, tp: int) -> int:
        """The causal LM's parameters on one rank of a vLLM tensor-parallel group of ``tp``: a ``1 / tp`` share of
        each weight, except k and v, whose heads are replicated where there are fewer than ranks
        (:meth:`kv_heads_per_rank`; the norms, also whole on each rank, are left at a share: a few MiB)."""
        kv = self.layers * 2 * self.kv_dim * (self.hidden + (1 if self.qkv_bias else 0))
        return (self.causal_lm_params() - kv) // tp + kv * self.kv_heads_per_rank(tp) // self.kv_heads

    def layer_activation_bytes_per_token(self, dtype_bytes: int) -> int:
        """What autograd keeps for backward, per token, in one decoder layer of the HF implementation.

        Counted the way Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
        Transformer Models", section 4.1) count a GPT layer (``34 h`` bytes per token in 16-bit, plus
        ``5 a s`` for the attention scores), here for HF's Llama/Qwen2 layer with SDPA, whose fused
        attention keeps no scores, in activation dtype of ``a`` bytes:

        - each RMSNorm: its fp32 input (4h; the input itself in fp32), its normalized values cast back
          (a h, which the product with its weight keeps for the weight's gradient) and that product, its
          output (a h, the projections' input): ``2 x (4 + 2a) h``;
        - attention: q after RoPE, k and v (expanded to all heads: with a padding mask HF's SDPA
          path repeats the kv heads), the attention output and its contiguous copy for o_proj:
          ``5 a heads d``;
        - SwiGLU MLP: gate, SiLU(gate), up and their product for down_proj: ``4 a I``.

        In bf16 that is ``16h + 10 heads d + 8I`` bytes: 72.7h for Qwen2.5-1.5B (I = 5.8h),
        where a GPT layer with a 4h MLP has 34h. Read from the autograd graph of HF's Llama layer on a CPU
        (``benchmarks/results/history/2026-11-28-checkpoint-layers-cpu.md``): the norms as counted here; the
        CPU's flash kernel keeps its output in the layout o_proj reads, so no copy there (a heads d fewer).
        """
        a = dtype_bytes
        return 2 * (4 + 2 * a) * self.hidden + 5 * a * self.q_dim + 4 * a * self.intermediate


def lora_target_problem(model_type: str, targets) -> str | None:
    """Why ``targets`` (``model.lora_targets``) are not all modules of a ``model_type`` model (one of
    :data:`SUPPORTED_MODEL_TYPES`), or None: the memory plan's rule, and the config check's before any model loads."""
    if list(targets) == ["all-linear"]:
        return None
    for name in targets:
        if name not in LINEAR_MODULES and name not in ("lm_head", "embed_tokens"):
            return (f"{name!r} is no module of a {model_type} model; expected some of {', '.join(LINEAR_MODULES)}, "
                    "embed_tokens or lm_head")
    return None


def _read_json(folder: str, key: str) -> dict:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError:
        raise ConfigError(key, f"{folder} has no readable config.json") from None
    except ValueError as exc:
        raise ConfigError(key, f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(key, f"{path} is not a JSON object")
    return data


def read_shape(folder: str, key: str = "model.path") -> ModelShape:
    """The :class:`ModelShape` of the model folder ``folder`` (its ``config.json`` only).

    Raises a one-line :class:`ConfigError` naming ``key`` for a folder without a readable config.json,
    an architecture not in :data:`SUPPORTED_MODEL_TYPES`, or a config.json missing a dimension.
    """
    c = _read_json(folder, key)
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(key, f"cannot count the parameters of model_type {model_type!r} ({folder}/config.json); "
                               f"the memory plan knows {', '.join(SUPPORTED_MODEL_TYPES)}")

    def need(name: str) -> int:
        value = c.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(key, f"{folder}/config.json: {name} must be a positive integer, got {value!r}")
        return value

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = c.get("head_dim") or hidden // heads
    attention_bias = bool(c.get("attention_bias", False))
    id2label = c.get("id2label")
    return ModelShape(
        model_type=model_type,
        vocab=need("vocab_size"),
        hidden=hidden,
        layers=need("num_hidden_layers"),
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=int(head_dim),
        intermediate=need("intermediate_size"),
        tied=bool(c.get("tie_word_embeddings", False)),  # False is the default of all four config classes
        qkv_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3") and attention_bias),
        o_bias=model_type in ("llama", "qwen3") and attention_bias,
        mlp_bias=model_type == "llama" and bool(c.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        num_labels=len(id2label) if isinstance(id2label, dict) and id2label else int(c.get("num_labels", 2)),
    )
