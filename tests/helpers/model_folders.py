"""Model folders that pass the config checks without a model: a ``config.json`` and a safetensors file holding
no tensors (a header, ``{}``), for tests of configs whose models never load. Real (tiny) models:
``fastrlhf.modeling.tiny``."""

import json

# A safetensors file with no tensors: the 8-byte little-endian length of its JSON header, then the header.
EMPTY_SAFETENSORS = len(b"{}").to_bytes(8, "little") + b"{}"


def fake_model_folder(path, config: dict | None = None) -> str:
    """``path`` (a ``pathlib.Path``) as a model folder: ``config.json`` (default: a Llama's model_type only) and
    an empty ``model.safetensors``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    return str(path)


def fake_classifier_folder(path, model_type: str = "llama", num_labels: int = 1) -> str:
    """A ``*ForSequenceClassification`` reward model's folder of ``num_labels`` labels, as ``fastrlhf rm`` exports."""
    cls = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification"}[model_type]
    return fake_model_folder(path, {"model_type": model_type, "architectures": [cls],
                                    "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)}})


def fake_train_raw(tmp_path, n: int = 4, **trainer) -> dict:
    """The raw mapping of a GRPO run whose model folder is checked, never loaded (:func:`fake_model_folder`), with one
    prompt of token ids: ``rollout.n`` ``n``, 4 prompts per step in minibatches of 4, ``trainer``'s keys over those."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    return {
        "algorithm": "grpo",
        "output_dir": str(tmp_path / "out"),
        "model": {"path": fake_model_folder(tmp_path / "model")},
        "reward": {"function": "length"},
        "data": {"prompts": str(prompts)},
        "rollout": {"n": n},
        "trainer": {"max_steps": 1, "prompts_per_step": 4, "minibatch_size": 4, **trainer},
    }


def fake_train_yaml(tmp_path, **rollout) -> str:
    """A GRPO run's config file under ``tmp_path`` whose model folder is checked, never loaded
    (:func:`fake_model_folder`), with one prompt of token ids; ``rollout``: that section's keys (default ``n: 4``)."""
    import yaml

    fake_model_folder(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [3, 4]}\n')
    raw = {
        "algorithm": "grpo",
        "output_dir": str(tmp_path / "out"),
        "model": {"path": str(tmp_path / "model")},
        "reward": {"function": "length"},
        "data": {"prompts": str(tmp_path / "prompts.jsonl")},
        "rollout": {"n": 4, **rollout},
        "trainer": {"max_steps": 2, "prompts_per_step": 4, "minibatch_size": 8},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)
