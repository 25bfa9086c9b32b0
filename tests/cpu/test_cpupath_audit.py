"""Audit of the CPU-only machinery and the model-layer speedups.

- Every call site of the switch (``fastrlhf.engine.platform.cpu_tools``), run as a GPU run runs it (CUDA mocked
  available, the models' device ``cuda``), with any import of ``fastrlhf.cpu`` made to fail: none reaches it.
  test_cpu_isolation.py steps an RL step; this covers the set-up the trainer, the engine builder, the rollout
  builder and the CLI do before any step, and fails when a new call site appears that it does not exercise.
- Gradient checkpointing (all layers or the first ``checkpoint_layers``) with a LoRA adapter, and with the
  compiled layers: the adapter's gradients, the first layer's included, are the plain model's (a frozen
  embedding makes the first checkpointed layer's input not require grad: the classic silently-zero gradient).
"""

import ast
import os
import subprocess
import sys

import pytest
import torch
from helpers.paths import ROOT

from fastrlhf.config.schema import ModelConfig
from fastrlhf.modeling import compile as C
from fastrlhf.modeling.loading import load_causal_lm, load_value_model
from fastrlhf.modeling.tiny import make_tiny_llama

# Where the switch is asked, and what the script below runs of each (a new call site must be added there).
CALL_SITES = {"fastrlhf/cli.py", "fastrlhf/rollout/vllm_adapter.py", "fastrlhf/engine/deepspeed.py",
              "fastrlhf/rl/rollout_setup.py", "fastrlhf/rl/step.py", "fastrlhf/rl/trainer.py"}


def _callers_of_the_switch() -> set[str]:
    found = set()
    for folder in ("fastrlhf", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                if not name.endswith(".py") or rel == "fastrlhf/engine/platform.py":
                    continue
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) \
                            == "cpu_tools":
                        found.add(rel)
    return found


def test_every_caller_of_the_switch_is_exercised_as_a_gpu_run():
    assert _callers_of_the_switch() == CALL_SITES


GPU_SETUP = r'''
import sys, types, torch
sys.path.insert(0, "tests")
torch.cuda.is_available = lambda: True  # this machine, as a GPU run sees it
torch.cuda.mem_get_info = lambda *_: (80 << 30, 80 << 30)


class NoCpuPackage:  # a GPU run that reaches fastrlhf.cpu fails here, whatever catches what
    def find_spec(self, name, path=None, target=None):
        if name == "fastrlhf.cpu" or name.startswith("fastrlhf.cpu."):
            print("IMPORTED", name, flush=True)
            raise ImportError(f"a GPU run imported {name}")


sys.meta_path.insert(0, NoCpuPackage())


class Reached(Exception):
    """The set-up got past its call of the switch."""


def reached(*_, **__):
    raise Reached


import deepspeed
from fastrlhf import cli
from fastrlhf.config import DataConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig, TrainerConfig
from fastrlhf.config.precision import resolve_precision
from fastrlhf.engine.deepspeed import build_train_engine
from fastrlhf.config.schema import DeepSpeedConfig
from fastrlhf.modeling.tiny import make_tiny_llama
import fastrlhf.rollout
from fastrlhf.rollout import vllm_adapter
from fastrlhf.rl import rollout_setup, trainer
from fastrlhf.rl.step import RLStep

config = resolve_precision(TrainConfig(
    output_dir="unused", model=ModelConfig(path="unused", dtype="float32", attention="sdpa"),
    data=DataConfig(prompts="unused"), reward=RewardConfig(function="length"),
    trainer=TrainerConfig(max_steps=1, prompts_per_step=2, minibatch_size=4, kl_coef=0.05),
    rollout=RolloutConfig(n=2, max_new_tokens=4, max_logprob_mismatch=None, engine="vllm"), algorithm="grpo"),
    on_gpu=True)
done = []
cli._print_cpu_fast_paths("train", config)  # --dry-run
done.append("cli")
assert vllm_adapter._in_place_updaters() == (vllm_adapter.load_in_place_on_cuda,)
done.append("vllm_adapter")
deepspeed.initialize = reached
try:
    build_train_engine(make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=1), DeepSpeedConfig(zero_stage=2),
                       lr=1e-3)
except Reached:
    done.append("deepspeed")
trainer.preflight = reached
try:
    trainer.run(config)
except Reached:
    done.append("trainer")
fastrlhf.rollout.VLLMEngine = lambda *a, **k: types.SimpleNamespace(share_input_embedding=reached)
engine, shares = rollout_setup.build_rollout(config, make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=1),
                                             10, torch.device("cuda"), None, None)
assert shares is False
done.append("rollout_setup")
frozen = make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=1).eval()
step = types.SimpleNamespace(reference=frozen, _reference_pages=None, device=torch.device("cuda"))
assert RLStep.release_reference_pages(step) == 0
done.append("step")
loaded = sorted(m for m in sys.modules if m == "fastrlhf.cpu" or m.startswith("fastrlhf.cpu."))
print("DONE", sorted(done), "LOADED", loaded)
'''


def test_the_gpu_set_up_reaches_no_cpu_machinery():
    proc = subprocess.run([sys.executable, "-c", GPU_SETUP], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and "IMPORTED" not in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    want = sorted(os.path.splitext(os.path.basename(p))[0] for p in CALL_SITES)
    assert f"DONE {want} LOADED []" in proc.stdout, proc.stdout[-2000:]


LAYERS = 3
LORA = dict(dtype="float32", lora_r=4, lora_targets=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


@pytest.fixture
def folder(tmp_path):
    make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=2, num_layers=LAYERS).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.fixture
def dynamo(monkeypatch):
    monkeypatch.setattr(C, "BACKEND", "aot_eager")  # Dynamo's and AOTAutograd's graphs, no code generation
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trainable_grads(model, loss_of) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_of(model).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _same_adapter(plain, other) -> None:
    """Both models with the plain one's adapter, its B factors nonzero (PEFT starts them at 0, where A's gradient
    is zero whatever the backward does)."""
    g = torch.Generator().manual_seed(1)
    for name, p in plain.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    other.load_state_dict(plain.state_dict())


IDS = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def _lm_loss(model):
    return model(input_ids=IDS, labels=IDS).loss


def _value_loss(model):
    return model(IDS, attention_mask=torch.ones_like(IDS)).square().mean()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("checkpoint_layers", [None, 1])
@pytest.mark.parametrize("value", [False, True], ids=["actor", "critic"])
def test_lora_gradients_under_checkpointing_are_the_plain_models(folder, dynamo, compiled, checkpoint_layers, value):
    load = (lambda cfg: load_value_model(cfg, folder)) if value else load_causal_lm
    loss_of = _value_loss if value else _lm_loss
    plain = load(ModelConfig(path=folder, **LORA))
    other = load(ModelConfig(path=folder, **LORA, gradient_checkpointing=True, checkpoint_layers=checkpoint_layers,
                             compile=compiled))
    assert C.compiled_layers(other) == (LAYERS if compiled else 0)
    recomputed = LAYERS if checkpoint_layers is None else checkpoint_layers  # kept through peft's wrapping
    flags = [layer.gradient_checkpointing for layer in C.decoder_layers(other)]
    assert flags == [i < recomputed for i in range(LAYERS)]
    _same_adapter(plain, other)
    want, got = _trainable_grads(plain, loss_of), _trainable_grads(other, loss_of)
    assert sorted(got) == sorted(want) and any(".layers.0." in n for n in want)
    for name, grad in want.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        if ".layers.0." in name:  # the first layer's input (a frozen embedding's output) does not require grad
            assert grad.abs().sum() > 0, name


def test_without_either_guard_the_first_layers_adapter_gets_no_gradient(folder):
    """What the test above guards against. Two things keep a LoRA model's first checkpointed layer training: the
    non-reentrant checkpoint (fastrlhf's choice) and peft's hook that makes the frozen embedding's output require
    grad (``enable_input_require_grads``). With neither, and the later layers not checkpointed
    (``checkpoint_layers``: a loss that still requires grad, no error), the first layer's adapter silently gets no
    gradient."""
    import functools

    from torch.utils.checkpoint import checkpoint

    model = load_causal_lm(ModelConfig(path=folder, **LORA, gradient_checkpointing=True, checkpoint_layers=1))
    decoder = model.base_model.model.model
    assert decoder.layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    with torch.no_grad():
        assert not decoder.embed_tokens.weight.requires_grad
    assert decoder.embed_tokens(IDS).requires_grad  # peft's hook
    plain = load_causal_lm(ModelConfig(path=folder, **LORA))
    _same_adapter(plain, model)
    decoder.embed_tokens._forward_hooks.clear()
    for layer in decoder.layers:
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=True)
    grads = _trainable_grads(model, _lm_loss)
    first = [g for n, g in grads.items() if ".layers.0." in n]
    assert first and all(g is None or g.abs().sum() == 0 for g in first)
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if f".layers.{LAYERS - 1}." in n)


ZERO3_COMPILE = r"""
import sys, tempfile
from fastrlhf import distributed as D
from fastrlhf.config import DeepSpeedConfig, ModelConfig
from fastrlhf.engine.deepspeed import deepspeed_config
from fastrlhf.modeling import load_causal_lm
from fastrlhf.modeling.tiny import make_tiny_llama

folder = tempfile.mkdtemp()
make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=2, num_layers=2).save_pretrained(folder)
D.init_distributed(timeout_s=60)
stage3 = deepspeed_config(DeepSpeedConfig(zero_stage=3), micro_batch_size=1)
try:
    model = load_causal_lm(ModelConfig(path=folder, dtype="float32", compile=True), zero3_config=stage3)
except ValueError as e:
    print("REFUSED", e)
else:
    print("COMPILED", hasattr(model.lm_head.weight, "ds_id"))
"""


def test_compile_refuses_a_model_loaded_in_zero3_partitions(tmp_path):
    """The config check refuses model.compile at ZeRO-3; a model built in code (load_causal_lm with a stage-3
    ``zero3_config``) reached the compile all the same, partitioned weights and all."""
    launcher = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")  # alone: a free port of its own
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "FASTRLHF_DIST_TIMEOUT": "60"}
    proc = subprocess.run([sys.executable, "-c", ZERO3_COMPILE], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED model.compile: the model's weights are ZeRO-3 partitions" in proc.stdout, proc.stdout[-2000:]


def test_the_heap_trim_hook_leaves_the_gradients_as_they_are(folder, monkeypatch):
    """``hostmem.trim_heap_after_backward`` hooks the embeddings' output gradient: the gradients with it are the
    plain model's, bitwise, for a LoRA model under checkpointing too (peft's hook makes that output require grad,
    so the trim runs there as well, once per backward)."""
    from fastrlhf.cpu import hostmem

    trims = []
    monkeypatch.setattr(hostmem, "trim_heap", lambda: trims.append(1) or True)
    plain = load_causal_lm(ModelConfig(path=folder, **LORA, gradient_checkpointing=True))
    hooked = load_causal_lm(ModelConfig(path=folder, **LORA, gradient_checkpointing=True))
    _same_adapter(plain, hooked)
    if not hostmem.trim_heap_after_backward(hooked):
        pytest.skip("no glibc: no hook")
    want = _trainable_grads(plain, _lm_loss)
    for backward in (1, 2):
        got = _trainable_grads(hooked, _lm_loss)
        assert len(trims) == backward
        for name, grad in want.items():
            assert torch.equal(got[name], grad), name
