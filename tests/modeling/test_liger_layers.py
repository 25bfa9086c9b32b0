"""``model.liger_kernels``: Liger-Kernel's RMSNorm, SwiGLU and rotary kernels in the loaded models' layers, never
its losses. On the CPU the package stands in (its kernels are GPU Triton): every loader that builds a model the run
computes with hands it over once, before LoRA wraps it, with the layer flags on and the loss flags off; a model
type Liger lacks and a missing package are one-line config errors; and the config refuses it on a CPU.
tests/gpu/test_liger_layers_on_cuda.py runs the real kernels on CUDA against the plain layers."""

import sys
import types
from dataclasses import replace

import pytest

from fastrlhf.config import ConfigError, ModelConfig
from fastrlhf.config.loading import _check_liger_kernels
from fastrlhf.modeling import load_causal_lm, load_sequence_classifier, load_value_model
from fastrlhf.modeling.loading import LIGER_LAYERS
from fastrlhf.modeling.tiny import save_tiny_qwen2


@pytest.fixture
def liger(monkeypatch):
    """A stand-in ``liger_kernel.transformers.monkey_patch`` whose qwen2 entry records what it is given; its
    signature is Liger 0.8.5's ``apply_liger_kernel_to_qwen2``."""
    calls = []

    def apply_liger_kernel_to_qwen2(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                    swiglu=True, model=None):
        calls.append(dict(rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                          rms_norm=rms_norm, swiglu=swiglu, model=model))

    names = ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.monkey_patch")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": apply_liger_kernel_to_qwen2,
                                                           "llama": apply_liger_kernel_to_qwen2}
    return calls


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    save_tiny_qwen2(folder, vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=48)
    return str(folder)


def model_cfg(folder, **kw):
    return ModelConfig(path=folder, dtype="float32", liger_kernels=True, **kw)


def test_every_model_a_run_computes_with_gets_the_layer_kernels_and_never_the_loss(liger, qwen2_folder):
    actor = load_causal_lm(model_cfg(qwen2_folder))
    reference = load_causal_lm(model_cfg(qwen2_folder), trainable=False)
    critic = load_value_model(model_cfg(qwen2_folder))
    classifier = load_sequence_classifier(model_cfg(qwen2_folder), num_labels=1)
    assert [c["model"] for c in liger] == [actor, reference, critic.lm, classifier]
    for call in liger:
        assert call["rope"] and call["rms_norm"] and call["swiglu"]
        assert not call["cross_entropy"] and not call["fused_linear_cross_entropy"]  # the head is ours
    assert not LIGER_LAYERS["fused_linear_cross_entropy"] and not LIGER_LAYERS["cross_entropy"]


def test_liger_sees_the_model_before_lora_wraps_it(liger, qwen2_folder):
    model = load_causal_lm(model_cfg(qwen2_folder, lora_r=4))
    (call,) = liger
    assert type(call["model"]).__name__ == "Qwen2ForCausalLM" and type(model).__name__.startswith("Peft")


def test_off_by_default_nothing_is_patched(liger, qwen2_folder):
    load_causal_lm(replace(model_cfg(qwen2_folder), liger_kernels=False))
    assert liger == []


def test_a_model_type_liger_lacks_is_a_config_error(liger, qwen2_folder, monkeypatch):
    monkeypatch.setattr(sys.modules["liger_kernel.transformers.monkey_patch"], "MODEL_TYPE_TO_APPLY_LIGER_FN",
                        {"llama": lambda model=None: None})
    with pytest.raises(ConfigError, match=r"model.liger_kernels: Liger-Kernel has no kernels for model_type 'qwen2'; "
                                          r"it has llama"):
        load_causal_lm(model_cfg(qwen2_folder))


def test_without_the_package_the_loader_says_so(monkeypatch, qwen2_folder):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    with pytest.raises(ConfigError, match="model.liger_kernels: needs the liger-kernel package"):
        load_causal_lm(model_cfg(qwen2_folder))


def test_the_config_refuses_it_on_a_cpu_and_without_the_package(monkeypatch):
    cfg = ModelConfig(path="unused", liger_kernels=True)
    with pytest.raises(ConfigError, match="model.liger_kernels: needs a CUDA device"):
        _check_liger_kernels(cfg, on_gpu=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="model.liger_kernels: needs the liger-kernel package: pip install"):
        _check_liger_kernels(cfg, on_gpu=True)
    _check_liger_kernels(replace(cfg, liger_kernels=False), on_gpu=False)  # off: nothing to check
