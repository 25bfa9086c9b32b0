"""Models from local folders (``from_pretrained``), optional LoRA, and export back to HF safetensors.

The exported folder is a plain Hugging Face model (LoRA merged, ZeRO-3 shards gathered) that
``from_pretrained`` and vLLM load directly.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
from torch import nn

from fastrlhf.engine.durable import fsync_path, fsync_tree

__all__ = [
    "torch_dtype",
    "zero3_loading",
    "load_causal_lm",
    "use_attention",
    "load_sequence_classifier",
    "CausalLMWithValueHead",
    "load_value_model",
    "apply_lora",
    "checkpoint_first_layers",
    "apply_liger_layers",
    "unwrap",
    "base_model",
    "vocab_size",
    "pad_token_id",
    "export_hf",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def torch_dtype(name: str) -> torch.dtype:
    """A config dtype name as a torch dtype; ``auto`` (a config not resolved by ``parse_config``) as
    ``fastrlhf.config.precision`` resolves it on this machine."""
    if name == "auto":
        from fastrlhf.config.precision import gpu_available

        name = "bfloat16" if gpu_available() else "float32"
    return _DTYPES[name]


ALL_LINEAR = "all-linear"


def apply_lora(model, model_cfg, task_type: str = "CAUSAL_LM"):
    """Wrap ``model`` in a PEFT LoRA adapter when ``model_cfg.lora_r > 0`` (only the adapter trains)."""
    if model_cfg.lora_r <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    targets = list(model_cfg.lora_targets)
    _check_targets(model, targets)
    # peft expands its all-linear shorthand (every Linear but the output layer or a classifier's score head) only
    # from a string; in a list it is a module name that matches nothing
    lora = LoraConfig(r=model_cfg.lora_r, lora_alpha=model_cfg.lora_alpha, lora_dropout=model_cfg.lora_dropout,
                      target_modules=targets[0] if targets == [ALL_LINEAR] else targets, task_type=task_type)
    return get_peft_model(model, lora)


def _check_targets(model, targets: list[str]) -> None:
    """What the config check cannot see before the model loads, as a ConfigError naming ``model.lora_targets``.
    A target matching no module as peft matches a list (the name, or its ending after a dot): peft ignores it where
    another matches, and else raises an error naming no setting (Phi-3 under the default q_proj, v_proj: it has one
    qkv_proj). An adapter on a head tied to the embedding where config.json does not say so (the model type's
    default ties): trained, the head runs without the delta; merged (export, weight sync), the shared weight has it."""
    from fastrlhf.config.errors import ConfigError

    where = f"{model.config.name_or_path} (a {model.config.model_type} model)"
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if t != ALL_LINEAR and not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, (nn.Linear, nn.Embedding))})
        raise ConfigError("model.lora_targets", f"{missing[0]!r} is no module of {where}; its Linear and Embedding "
                                                f"modules: {', '.join(leaves)}, or all-linear")
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    adapted = [name for name in targets if name in ("embed_tokens", "lm_head")]
    if adapted and head is not None and embedding is not None and head.weight is embedding.weight:
        raise ConfigError("model.lora_targets", f"{adapted[0]}: {where} ties lm_head to embed_tokens, so merging the "
                                                "adapter would write its delta into the shared weight and the "
                                                "exported model would not be the trained one; leave lm_head and "
                                                "embed_tokens out")


def _finish(model, model_cfg, task_type: str):
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if model_cfg.checkpoint_layers is not None:
            checkpoint_first_layers(model, model_cfg.checkpoint_layers)
    return apply_lora(model, model_cfg, task_type)


def checkpoint_first_layers(model, count: int) -> int:
    """Under gradient checkpointing, only the first ``count`` decoder layers recompute their forward in the
    backward; the later ones keep their activations. The later ones, because the backward is done with them (and
    frees what they kept) before it recomputes any layer: the peak is the kept layers or one recomputed layer, not
    both (``fastrlhf.memory.components.activations`` counts it so). Returns how many recompute: all of a model
    with fewer layers (a PPO critic smaller than the actor; the config check refuses more than the actor's)."""
    from fastrlhf.modeling.compile import decoder_layers

    layers = decoder_layers(model)
    for layer in layers[count:]:
        layer.gradient_checkpointing = False
    return min(count, len(layers))


@contextlib.contextmanager
def zero3_loading(ds_config: dict | None):
    """Inside, ``from_pretrained`` loads straight into ZeRO-3 partitions (no full replica per rank).

    Only for a ``ds_config`` at stage 3 (the dict given to the engine that will own the model);
    otherwise a no-op. Weights missing from the folder (a new score head) get HF's ZeRO-3 init.
    """
    if not ds_config or ds_config.get("zero_optimization", {}).get("stage") != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep_alive = HfDeepSpeedConfig(ds_config)  # transformers holds only a weak reference to it
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del keep_alive


def use_attention(model, packing: bool, share_prompts: bool = False, backend: str = "auto") -> str | None:
    """Set ``model`` up to run packed rows (``trainer.packing``) with ``backend`` (``model.attention`` as
    :mod:`fastrlhf.sequences.attention` resolved it; ``auto`` here: the table's choice for this machine and the
    model's dtype). It then runs ``fastrlhf_packed`` (:mod:`fastrlhf.sequences.packed_attention`), which takes a
    packed row to that backend and everything else (padded batches, generation) to sdpa. Returns the
    backend; None without packing (the model keeps its attention)."""
    if not packing:
        return None
    from fastrlhf.sequences import packed_attention
    from fastrlhf.sequences.attention import choose

    hf = base_model(model)
    if backend == "auto":
        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(hf.dtype, "float32")
        backend = choose("auto", torch.cuda.is_available(), dtype, share_prompts)
    hf.set_attn_implementation(packed_attention.register())
    packed_attention.set_backend(hf, backend)
    return backend


# Liger-Kernel's layer kernels that model.liger_kernels turns on; never its losses (cross_entropy,
# fused_linear_cross_entropy): the LM head and loss are fastrlhf's fused kernels, which take the hidden states.
LIGER_LAYERS = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def apply_liger_layers(model) -> None:
    """Liger-Kernel's RMSNorm, SwiGLU MLP and rotary embedding in ``model``'s layers (``model.liger_kernels``),
    through its ``apply_liger_kernel_to_<model_type>(model=...)``, before LoRA wraps the model. Liger patches the
    module's classes and functions for the whole process, as TRL's ``use_liger_kernel`` does. Raises
    :class:`ConfigError` naming ``model.liger_kernels`` where the package or the model type is missing."""
    import inspect

    from fastrlhf.config.model_checks import liger_apply_fn

    apply = liger_apply_fn(getattr(model.config, "model_type", None))
    takes = inspect.signature(apply).parameters
    apply(model=model, **{k: v for k, v in LIGER_LAYERS.items() if k in takes})


def _fuse_layers(model, model_cfg) -> None:
    """``model.liger_kernels`` or ``model.compile`` (one of them: the config check)."""
    if model_cfg.liger_kernels:
        apply_liger_layers(model)
    if model_cfg.compile:
        from fastrlhf.modeling.compile import compile_layers

        compile_layers(model)


def load_causal_lm(model_cfg, path: str | None = None, trainable: bool = True, zero3_config: dict | None = None,
                   dtype: str | None = None):
    """``AutoModelForCausalLM`` from ``path`` (default ``model_cfg.path``); LoRA applied only if trainable.

    ``zero3_config``: the stage-3 DeepSpeed config of the engine to come, to load partitioned.
    ``dtype``: instead of ``model_cfg.dtype`` (frozen copies load in the actor's compute dtype).
    """
    from transformers import AutoModelForCausalLM

    with zero3_loading(zero3_config):
        model = AutoModelForCausalLM.from_pretrained(path or model_cfg.path,
                                                     dtype=torch_dtype(dtype or model_cfg.dtype))
    _fuse_layers(model, model_cfg)
    if not trainable:
        return model.eval().requires_grad_(False)
    return _finish(model.train(), model_cfg, "CAUSAL_LM")


def load_sequence_classifier(model_cfg, num_labels: int, path: str | None = None, trainable: bool = True,
                             zero3_config: dict | None = None):
    """``AutoModelForSequenceClassification`` (a fresh score head over a causal LM folder is fine)."""
    from transformers import AutoModelForSequenceClassification

    with zero3_loading(zero3_config):
        model = AutoModelForSequenceClassification.from_pretrained(path or model_cfg.path, num_labels=num_labels,
                                                                   dtype=torch_dtype(model_cfg.dtype))
    if model.config.pad_token_id is None:
        # The classifier pools the last non-pad token; without a pad id it refuses batches larger than 1.
        model.config.pad_token_id = pad_token_id(model.config)
    _fuse_layers(model, model_cfg)
    if not trainable:
        return model.eval().requires_grad_(False)
    return _finish(model.train(), model_cfg, "SEQ_CLS")


class CausalLMWithValueHead(nn.Module):
    """A causal LM backbone with a scalar value per token (the PPO critic)."""

    def __init__(self, lm, value_head: nn.Linear | None = None):
        super().__init__()
        self.lm = lm
        hidden = base_model(lm).config.hidden_size
        self.v_head = value_head if value_head is not None else nn.Linear(hidden, 1)
        if value_head is None:
            # Small init: the first value estimates start near zero instead of swamping the returns.
            nn.init.normal_(self.v_head.weight, std=1.0 / (hidden + 1))
            nn.init.zeros_(self.v_head.bias)
        self.v_head.to(next(lm.parameters()).dtype)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **attention_kwargs):
        """``[B, L]`` fp32 values. ``attention_mask`` None with ``position_ids`` restarting at 0: packed
        sequences (no cache is built: with one, transformers would not see the packing);
        ``attention_kwargs`` reach the attention (shared-prompt segments)."""
        decoder = base_model(self.lm).get_decoder()
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=use_cache, **attention_kwargs)
        hidden = out.last_hidden_state
        return self.v_head(hidden).squeeze(-1).float()


VALUE_HEAD_FILE = "value_head.safetensors"


def load_value_model(model_cfg, path: str | None = None, trainable: bool = True,
                     zero3_config: dict | None = None) -> CausalLMWithValueHead:
    """Critic from ``path``: a saved value head (``value_head.safetensors``) is reused; a reward model's scalar
    score head (a ``*ForSequenceClassification`` folder with one label, as ``fastrlhf rm --kind pairwise``
    exports; or an OpenRLHF reward model's ``value_head_prefix`` linear) becomes the value head, as TRL and
    OpenRLHF start PPO's critic from the reward model; else a fresh
    head. The backbone is the folder's in every case, loaded partitioned with ``zero3_config`` (as
    :func:`load_causal_lm`; the small head is partitioned when its engine starts)."""
    path = path or model_cfg.path
    lm = load_causal_lm(model_cfg, path, trainable=trainable, zero3_config=zero3_config)
    head = None
    head_file = os.path.join(path, VALUE_HEAD_FILE)
    if os.path.exists(head_file):
        from safetensors.torch import load_file

        state = load_file(head_file)
        head = nn.Linear(state["weight"].shape[1], 1)
        head.load_state_dict(state)
    else:
        head = _reward_score_head(path)
    model = CausalLMWithValueHead(lm, head)
    model.v_head.requires_grad_(trainable)
    _freeze_untied_lm_head(lm)
    return model


def _freeze_untied_lm_head(lm) -> None:
    """The critic reads the decoder's hidden states, never the LM head's logits: an untied head (with any adapter
    on it) gets no gradient, and trained it would only hold a ``[V, h]`` gradient and optimizer states (as OpenRLHF's
    and TRL's critics, which have no LM head). A tied one is the input embedding, which trains."""
    hf = base_model(lm)
    head = hf.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not hf.get_input_embeddings().weight:
        head.requires_grad_(False)


def _reward_score_head(path: str) -> nn.Linear | None:
    """The ``score`` layer of a one-label sequence classifier saved in ``path``, or an OpenRLHF reward model's head
    (``<value_head_prefix>`` of its config.json: its ``train_rm`` saves that linear, bias-free, among the base
    model's weights), as a value head (bias 0 where it has none), read from its safetensors alone (the backbone is
    loaded once, as a causal LM); None for any other folder, a classifier of several labels included (its backbone
    still starts the critic)."""
    import json

    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    prefix = getattr(config, "value_head_prefix", None)
    if not isinstance(prefix, str) and (config.num_labels != 1 or not any(
            a.endswith("ForSequenceClassification") for a in config.architectures or ())):
        return None
    prefix = prefix if isinstance(prefix, str) else "score"
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = json.load(f)["weight_map"]
    else:
        shards = {}
    tensors = {}
    for name in ("weight", "bias"):
        file = os.path.join(path, shards.get(f"{prefix}.{name}", "model.safetensors"))
        if os.path.exists(file):
            with safe_open(file, framework="pt") as f:
                if f"{prefix}.{name}" in f.keys():
                    tensors[name] = f.get_tensor(f"{prefix}.{name}")
    if "weight" not in tensors:
        if prefix != getattr(config, "value_head_prefix", None):
            return None
        raise ValueError(f"{path}: config.json names value_head_prefix {prefix!r}, but its safetensors hold no "
                         f"{prefix}.weight")
    weight = tensors["weight"].float()
    head = nn.Linear(weight.shape[1], 1)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(tensors["bias"].float() if "bias" in tensors else torch.zeros(1))
    return head


def unwrap(model_or_engine):
    """The nn.Module inside a DeepSpeed engine (or the module itself)."""
    return getattr(model_or_engine, "module", model_or_engine)


def base_model(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def pad_token_id(config) -> int:
    """The id to pad with for a model ``config``: its pad id, else its eos id, else its bos id, else 0. Each may be a
    list (Llama-3's several eos ids): its first id."""
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def vocab_size(path: str) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return getattr(config, "vocab_size", None)


def _gathered_state_dict(model, zero_stage: int, bucket_bytes: int | None = None) -> dict | None:
    """Full state dict on rank 0 (None elsewhere); collective under ZeRO-3.

    Below ZeRO-3 every rank holds the whole model: its own tensors, no copy. ZeRO-3 parameters are
    gathered a bucket at a time (the weight sync's gather), so no rank ever holds the whole model on
    its device; rank 0 keeps a CPU copy of each bucket.
    """
    from fastrlhf import distributed as D

    if zero_stage != 3:
        return {k: v.detach() for k, v in model.state_dict().items()} if D.is_main() else None
    from fastrlhf.rollout.weight_sync import DEFAULT_BUCKET_BYTES, iter_bucketed_weights

    gathered = {}
    for name, tensor in iter_bucketed_weights(model, bucket_bytes or DEFAULT_BUCKET_BYTES):  # collective
        if D.is_main():
            gathered[name] = tensor.cpu()
    if not D.is_main():
        return None
    # state_dict also holds buffers and each tied weight under every name it has; the gather
    # yields each parameter once, under the name named_parameters() gives it.
    first_name = {}
    for name, param in model.named_parameters():
        first_name.setdefault(id(param), name)
    return {key: gathered[first_name[id(value)]] if id(value) in first_name else value.detach().clone().cpu()
            for key, value in model.state_dict(keep_vars=True).items()}


ADAPTER_FOLDER = "adapter"


def _save_hf_model(model, state: dict, out_dir: str) -> None:
    """Write ``model``'s Hugging Face folder with the weights in ``state`` (a full state dict); no second model in
    memory, whatever ``model``'s own parameters are sharded into.

    A LoRA model saves through its base model the adapter merged in as the weight sync merges it (in the dtype
    trained in; the base model's generation_config, Qwen2-Instruct's eos ids), and the adapter alone in
    ``adapter/`` as peft saves it (vLLM and ``from_pretrained`` read a model's weights from its folder's top level).
    """
    if hasattr(model, "get_base_model"):
        from fastrlhf.rl.lora_sync import merged_state_dict, save_adapter

        base = base_model(model)
        save_adapter(model, state, os.path.join(out_dir, ADAPTER_FOLDER))  # first: the merge takes state's entries
        base.save_pretrained(out_dir, state_dict=merged_state_dict(model, state, base.dtype), safe_serialization=True)
        return
    model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)


def export_hf(model_or_engine, out_dir: str, zero_stage: int = 0, tokenizer_from: str | None = None,
              bucket_bytes: int | None = None) -> str:
    """Save a Hugging Face folder (safetensors) that transformers and vLLM load; collective, atomic.

    Under ZeRO-3 the parameters are gathered ``bucket_bytes`` at a time (default: the weight sync's).

    A :class:`CausalLMWithValueHead` exports the LM plus ``value_head.safetensors``. With LoRA the LM is merged and
    its adapter is also in ``adapter/`` (a critic's with the value head).
    """
    from fastrlhf import distributed as D
    from fastrlhf.distributed import comm

    model = unwrap(model_or_engine)
    state = _gathered_state_dict(model, zero_stage, bucket_bytes)
    if D.is_main():
        tmp = f"{out_dir.rstrip(os.sep)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        lm = model.lm if isinstance(model, CausalLMWithValueHead) else model
        with _inference_config(base_model(lm)):
            if lm is not model:
                from safetensors.torch import save_file

                lm_state = {k[len("lm."):]: v for k, v in state.items() if k.startswith("lm.")}
                head_state = {k[len("v_head."):]: v.contiguous() for k, v in state.items() if k.startswith("v_head.")}
                _save_hf_model(lm, lm_state, tmp)
                for folder in (tmp, os.path.join(tmp, ADAPTER_FOLDER)):  # the adapter's folder: a whole critic too
                    if os.path.isdir(folder):
                        save_file(head_state, os.path.join(folder, VALUE_HEAD_FILE))
            else:
                _save_hf_model(model, state, tmp)
        if tokenizer_from:
            for name in _TOKENIZER_FILES:
                src = os.path.join(tokenizer_from, name)
                if os.path.exists(src):
                    shutil.copy2(src, os.path.join(tmp, name))
        _replace_folder(tmp, out_dir)
    comm.barrier()
    return out_dir


@contextlib.contextmanager
def _inference_config(hf):
    """Inside, ``hf.config`` says ``use_cache: true`` again where gradient checkpointing turned the KV cache off for
    training (:func:`_finish`): saved so, the exported model's forward would build no cache (``past_key_values``
    None) wherever a caller does not pass ``use_cache``."""
    if not getattr(hf, "is_gradient_checkpointing", False):
        yield
        return
    use_cache, hf.config.use_cache = hf.config.use_cache, True
    try:
        yield
    finally:
        hf.config.use_cache = use_cache


def _replace_folder(new: str, out_dir: str) -> None:
    """``new`` renamed to ``out_dir``, replacing the folder there: the old one is renamed aside first and
    deleted only once the new one is in place, so a kill at any moment leaves a whole ``out_dir`` or a whole
    ``<out_dir>.old`` (removing the old one first could leave only the temporary folder)."""
    old = f"{out_dir.rstrip(os.sep)}.old"
    fsync_tree(new)  # on disk before the renames: a power cut must not leave its files empty, the old one gone
    if os.path.lexists(out_dir):
        shutil.rmtree(old, ignore_errors=True)  # a kill's leftover, older than out_dir
        os.rename(out_dir, old)
    try:
        os.rename(new, out_dir)
    except OSError:
        if os.path.lexists(old) and not os.path.lexists(out_dir):
            os.rename(old, out_dir)
        raise
    fsync_path(os.path.dirname(os.path.abspath(out_dir)), directory=True)  # the renames themselves
    shutil.rmtree(old, ignore_errors=True)
