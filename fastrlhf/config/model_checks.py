"""The rules that read the model folders a config names: each folder's ``config.json`` and its weight files'
sizes and headers (never a tensor), and the settings that must agree with them, all before any model loads.

:func:`check_model_folder` reads a folder and returns its config.json; the other functions take those dicts,
so that ``fastrlhf plan`` (which needs a folder's config.json only, see ``fastrlhf.memory.plan_command``) can
stand in ``{}`` for every folder and skip them. A field a config.json lacks is never guessed: its rule is skipped.
"""

from __future__ import annotations

import json
import math
import os
import re

from .errors import ConfigError, is_default

__all__ = ["WEIGHT_FILES", "check_model_folder", "check_lora", "check_positions", "check_vocab_covers",
           "check_reward_model", "check_stop_token_ids", "check_logit_terms", "liger_apply_fn"]

# In the order transformers prefers them: the first one present is the one it loads.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# fastrlhf.modeling.loading.VALUE_HEAD_FILE (not imported: that module imports torch)
VALUE_HEAD_FILE = "value_head.safetensors"

# owner/name, as the model hub names a model (Qwen/Qwen2.5-0.5B-Instruct)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Model types whose attention adds learned sinks to the softmax (transformers passes them as ``s_aux``).
_SINK_MODEL_TYPES = ("gpt_oss",)
# The model types the memory plan counts need no lookup in transformers' registry (which takes a second to import).
_COMMON_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_model_folder(path: str | None, key: str, base: str) -> dict:
    """A ``save_pretrained`` folder: config.json naming a model_type transformers knows, a pad_token_id inside
    the vocabulary, and weights that can load (the shards an index names, safetensors headers); its config.json.
    A missing path shaped like a hub id whose first part is no folder here is refused with the download command."""
    if path is None:
        return {}
    if not path.strip():  # "" would resolve to the current directory and be reported as a model-less folder
        raise ConfigError(key, f"expected the path of a model folder, got {path!r}")
    folder = path if os.path.isabs(path) else os.path.join(base, path)
    if not os.path.exists(folder) and _HUB_ID.fullmatch(path) and not os.path.isdir(os.path.dirname(folder)):
        local = f"models/{path.split('/')[1]}"
        raise ConfigError(key, f"{path} is not a local folder, and fastrlhf reads models from local folders only "
                               f"(no model hub): download it first with `hf download {path} --local-dir {local}` "
                               f"(huggingface-cli download on huggingface_hub < 1.0), then set {key}: {local}; "
                               # a local folder not made yet (runs/tiny-chat), or a run started elsewhere
                               f"no folder {os.path.abspath(folder)} exists either")
    if not os.path.exists(folder):
        raise ConfigError(key, f"path does not exist: {path}")
    if not os.path.isdir(folder):
        raise ConfigError(key, f"{path} is a file; expected a model folder (save_pretrained output)")
    try:
        with open(os.path.join(folder, "config.json")) as f:
            hf_config = json.load(f)
        model_type = hf_config.get("model_type")
    except (OSError, ValueError, AttributeError):
        raise ConfigError(key, f"{path} is not a model folder: no readable config.json") from None
    if not model_type:
        raise ConfigError(key, f"{path} is not a model folder: its config.json names no model_type")
    if not isinstance(model_type, str):
        raise ConfigError(key, f"{os.path.join(path, 'config.json')}: model_type must be a string, got {model_type!r}")
    _check_model_type(model_type, path, key)
    weights = next((name for name in WEIGHT_FILES if os.path.exists(os.path.join(folder, name))), None)
    if weights is None:
        raise ConfigError(key, f"{path} has a config.json but no weights ({' or '.join(WEIGHT_FILES[::2])})")
    _check_weights(folder, path, weights, key)
    vocab, pad = _field(hf_config, "vocab_size"), _field(hf_config, "pad_token_id")
    if _is_int(vocab) and _is_int(pad) and not 0 <= pad < vocab:
        # Every command pads with it: the embedding lookup of the first padded batch would fail.
        raise ConfigError(key, f"{os.path.join(path, 'config.json')}: pad_token_id {pad} is outside the "
                               f"vocabulary [0, {vocab})")
    return hf_config


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _field(hf_config: dict, name: str):
    """A config.json field, or its ``text_config``'s (a multimodal model's language model)."""
    if name in hf_config:
        return hf_config[name]
    text = hf_config.get("text_config")
    return text.get(name) if isinstance(text, dict) else None


def _check_model_type(model_type: str, path: str, key: str) -> None:
    if model_type in _COMMON_MODEL_TYPES:
        return
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return  # nothing here to ask; loading will say
    root = list(spec.submodule_search_locations)[0]
    if os.path.isdir(os.path.join(root, "models", model_type.replace("-", "_"))):
        return
    try:  # recent transformers: a generated table, read without importing torch
        from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES
    except ImportError:
        try:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        except ImportError:
            return
    if model_type not in CONFIG_MAPPING_NAMES:
        from importlib.metadata import version

        raise ConfigError(key, f"{os.path.join(path, 'config.json')} names model_type {model_type!r}, which "
                               f"transformers {version('transformers')} does not know")


def _check_weights(folder: str, path: str, weights: str, key: str) -> None:
    """The weight file transformers would load, without reading a tensor: an index's shards are all there, a
    safetensors file has its header, a .bin file is not empty."""
    if weights.endswith(".index.json"):
        try:
            with open(os.path.join(folder, weights)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(key, f"{os.path.join(path, weights)} is not a weight index (JSON with a "
                                   "weight_map)") from None
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise ConfigError(key, f"{os.path.join(path, weights)} names {len(missing)} weight file"
                                   f"{'s' if len(missing) > 1 else ''} that {'are' if len(missing) > 1 else 'is'} "
                                   f"missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an "
                                   "incomplete download?")
    else:
        shards = [weights]
    for shard in shards:
        problem = _weight_file_problem(os.path.join(folder, shard))
        if problem:
            raise ConfigError(key, f"{os.path.join(path, shard)} {problem}")


def _weight_file_problem(file: str) -> str | None:
    size = os.path.getsize(file)
    if size == 0:
        return "is empty (0 bytes): an incomplete download?"
    if not file.endswith(".safetensors"):
        return None
    # safetensors: an 8-byte little-endian header length, then that many bytes of JSON
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            return f"is not a safetensors file (no header in its {size} bytes): an incomplete download?"
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not JSON): an incomplete download?"
    return None


def check_lora(m, hf_config: dict, key: str, command: str) -> None:
    """``model.lora_targets`` against the model of ``model.path`` (``hf_config``), as peft will apply them;
    ``command``: train, sft or rm (a reward model has a score head, no lm_head)."""
    if m.lora_r <= 0:
        _refuse_lora_settings(m, key)
        return
    from fastrlhf.memory.architecture import LINEAR_MODULES, SUPPORTED_MODEL_TYPES, lora_target_problem

    targets_key = f"{key}.lora_targets"
    for name in m.lora_targets:
        if not name.strip():
            raise ConfigError(targets_key, f"{name!r} is no module name; expected some of {', '.join(LINEAR_MODULES)}, "
                                           "embed_tokens or lm_head")
        if name == "all-linear" and len(m.lora_targets) > 1:
            # the loader hands peft the shorthand alone; in a list peft reads it as a module name
            raise ConfigError(targets_key, "all-linear stands alone (every Linear of the decoder layers); list the "
                                           f"modules instead: [{', '.join(LINEAR_MODULES)}, ...]")
    model_type = hf_config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        problem = lora_target_problem(model_type, m.lora_targets)
        if problem:
            raise ConfigError(targets_key, problem)
    heads = [name for name in m.lora_targets if name in ("lm_head", "embed_tokens")]
    if command == "rm" and "lm_head" in heads:
        raise ConfigError(targets_key, "lm_head: a reward model has a score head, no lm_head (the score head trains "
                                       "whole with LoRA); leave it out")
    if command != "rm" and heads and _field(hf_config, "tie_word_embeddings") is True:
        raise ConfigError(targets_key, f"{heads[0]}: {m.path} ties lm_head to embed_tokens (tie_word_embeddings: "
                                       "true), so merging the adapter at export would write its delta into the shared "
                                       "weight and the exported model would not be the trained one; leave lm_head and "
                                       "embed_tokens out")


def _refuse_lora_settings(m, key: str) -> None:
    """LoRA settings with ``lora_r`` 0 (no adapter): the run would silently train every weight instead."""
    for name in ("lora_targets", "lora_alpha", "lora_dropout"):
        if not is_default(m, name):
            raise ConfigError(f"{key}.{name}", f"sets up a LoRA adapter, which {key}.lora_r 0 turns off (every weight "
                                               f"trains): set {key}.lora_r > 0, or remove {key}.{name}")


def check_positions(hf_config: dict, total: int, key: str, what: str, folder_key: str) -> None:
    """``total`` tokens (``what``, the setting ``key`` sizes) within the positions of ``folder_key``'s model."""
    limit = _field(hf_config, "max_position_embeddings")
    if _is_int(limit) and total > limit:
        raise ConfigError(key, f"{what}{total} exceeds {folder_key}'s max_position_embeddings {limit}")


def check_vocab_covers(hf_config: dict, key: str, actor: dict, reads: str) -> None:
    """A model that reads the actor's token ids has an embedding for each of them."""
    theirs, ours = _field(hf_config, "vocab_size"), _field(actor, "vocab_size")
    if _is_int(theirs) and _is_int(ours) and theirs < ours:
        raise ConfigError(key, f"its vocab_size {theirs} is smaller than model.path's {ours}: {reads} the actor's "
                               "token ids, some of which it has no embedding for")


def check_reward_model(r, hf_config: dict, base: str) -> None:
    """``reward.model_kind`` and ``reward.label_index`` against the folder of ``reward.model_path``: a classifier
    with that label, or for ``value_head`` a value head to read (a fresh head would score at random)."""
    if not hf_config:
        return
    architectures = hf_config.get("architectures") or []
    classifier = isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures)
    id2label = hf_config.get("id2label")
    labels = len(id2label) if isinstance(id2label, dict) and id2label else hf_config.get("num_labels", 2)
    if r.model_kind == "value_head":
        if r.label_index != 0:
            raise ConfigError("reward.label_index", f"picks a classifier's label; model_kind value_head reads one "
                                                    f"value, got {r.label_index}")
        folder = r.model_path if os.path.isabs(r.model_path) else os.path.join(base, r.model_path)
        if not os.path.exists(os.path.join(folder, VALUE_HEAD_FILE)) and not (classifier and labels == 1) and not (
                isinstance(hf_config.get("value_head_prefix"), str)):
            raise ConfigError("reward.model_path", f"{r.model_path} has no value head for model_kind value_head: "
                                                   f"neither {VALUE_HEAD_FILE} (as a PPO run's final/critic has, "
                                                   "with critic.export) nor a one-label *ForSequenceClassification "
                                                   "score head")
        _check_stored_moments(r, hf_config)
        return
    if not classifier:
        openrlhf = "; it is an OpenRLHF reward model: set model_kind value_head" if isinstance(
            hf_config.get("value_head_prefix"), str) else " (train one with fastrlhf rm)"
        raise ConfigError("reward.model_path", f"{r.model_path}'s config.json names no *ForSequenceClassification "
                                               f"architecture (architectures: {architectures or None}); model_kind "
                                               f"classifier would score with a fresh, random head{openrlhf}")
    if _is_int(labels) and not r.label_index < labels:
        raise ConfigError("reward.label_index", f"must be below the {labels} labels of {r.model_path}, got "
                                                f"{r.label_index}")
    _check_stored_moments(r, hf_config)


def _check_stored_moments(r, hf_config: dict) -> None:
    """``reward.normalize: stored`` divides by the ``mean`` and ``std`` in the reward model's config.json (OpenRLHF's
    ``train_rm`` and ``fastrlhf rm`` write them): a folder without them has nothing to normalise by."""
    mean, std = hf_config.get("mean"), hf_config.get("std")
    if r.normalize == "stored" and not (_is_number(mean) and _is_number(std) and std > 0):
        raise ConfigError("reward.normalize", f"stored reads the mean and std of {r.model_path}'s config.json, which "
                                              f"has {'no' if mean is None or std is None else 'no usable'} mean/std "
                                              f"(mean {mean!r}, std {std!r}; OpenRLHF's train_rm writes them when it "
                                              "evaluates, fastrlhf rm at its export); set true or false")


def check_stop_token_ids(ids: list[int], hf_config: dict) -> None:
    vocab = _field(hf_config, "vocab_size")
    for i, token in enumerate(ids):
        if token < 0 or (_is_int(vocab) and token >= vocab):
            bound = f"[0, {vocab}) (model.path's vocabulary)" if _is_int(vocab) else ">= 0"
            raise ConfigError(f"rollout.stop_token_ids[{i}]", f"must be in {bound}, got {token}")


def check_logit_terms(hf_config: dict, packing: bool, attention: str, key: str = "model.path") -> None:
    """A model whose logits carry more than fastrlhf computes. Its head: Gemma-2's ``final_logit_softcapping``,
    which the logprob path (the fused kernels read the hidden states and the head's weight) does not apply. Its
    attention, in packed rows (``fastrlhf.sequences.packed_attention``): gpt-oss's sinks run in no packed kernel,
    Gemma-2's ``attn_logit_softcapping`` not in sdpa (``auto``: checked again once resolved, see
    ``fastrlhf.config.loading.parse_config``). ``key``: the folder's config key."""
    final = _field(hf_config, "final_logit_softcapping")
    if final is not None:
        raise ConfigError(key, f"the model caps its logits (final_logit_softcapping {final}, Gemma-2), which "
                               "fastrlhf's logprobs do not apply yet: the trainer would score another distribution")
    if not packing:
        return
    model_type = _field(hf_config, "model_type")
    if model_type in _SINK_MODEL_TYPES:
        raise ConfigError("trainer.packing", f"{model_type} models ({key}) add attention sinks to the softmax, which "
                                             "no packed attention applies: set trainer.packing: false")
    softcap = _field(hf_config, "attn_logit_softcapping")
    if softcap is not None and attention == "sdpa":
        raise ConfigError("model.attention", f"sdpa drops the attn_logit_softcapping ({softcap}) of {key} in packed "
                                             "rows: set model.attention: flex (a GPU) or trainer.packing: false")


def liger_apply_fn(model_type: str | None, where: str = ""):
    """Liger-Kernel's ``apply_liger_kernel_to_<model_type>``; a :class:`ConfigError` naming ``model.liger_kernels``
    where the package or its kernels for ``model_type`` are missing (``where``: the folder's key, said with it)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise ConfigError("model.liger_kernels", f"needs the liger-kernel package ({exc})") from None
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ConfigError("model.liger_kernels", f"Liger-Kernel has no kernels for model_type {model_type!r}"
                                                 f"{f' ({where})' if where else ''}; it has "
                                                 f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}")
    return apply
