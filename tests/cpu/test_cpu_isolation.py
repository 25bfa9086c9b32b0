"""CPU-only machinery (fastrlhf/cpu) stays out of a GPU run: one switch reaches it, and a GPU run's
objects, built and stepped with the device mocked as CUDA, load none of it."""

import ast
import os
import subprocess
import sys

from helpers.paths import ROOT

SWITCH = os.path.join("fastrlhf", "engine", "platform.py")


def imports_of(path: str) -> set[str]:
    """Every module a file imports, at module level or inside a function."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_only_the_switch_imports_the_cpu_package():
    offenders = []
    for folder in ("fastrlhf", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)
                if not name.endswith(".py") or rel.startswith(os.path.join("fastrlhf", "cpu")) or rel == SWITCH:
                    continue
                if any(m == "fastrlhf.cpu" or m.startswith("fastrlhf.cpu.") for m in imports_of(path)):
                    offenders.append(rel)
    assert offenders == [], f"import fastrlhf.cpu only through fastrlhf.engine.platform.cpu_tools: {offenders}"


GPU_RUN = r'''
import sys, torch
sys.path.insert(0, "tests")
torch.cuda.is_available = lambda: True          # this machine, as a GPU run sees it
import pkgutil, importlib, fastrlhf
def import_all(package):  # every module of a GPU run (pkgutil.walk_packages would import fastrlhf.cpu itself)
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if info.name.startswith(("fastrlhf.cpu", "fastrlhf.demo")) or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        if info.ispkg:
            import_all(module)
import_all(fastrlhf)
from helpers.other_device import OtherDevice
from fastrlhf.config import DataConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig, TrainerConfig
from fastrlhf.config.precision import resolve_precision
from fastrlhf.engine.guards import StepGuard
from fastrlhf.engine.platform import cpu_tools
from fastrlhf.modeling.tiny import make_tiny_llama
from fastrlhf.rl.rewards import RewardScorer
from fastrlhf.rl.step import RLStep
from fastrlhf.rollout import vllm_adapter
from fastrlhf.rollout.hf_engine import HFEngine

config = resolve_precision(TrainConfig(
    output_dir="unused", model=ModelConfig(path="unused", dtype="float32", attention="sdpa"),
    data=DataConfig(prompts="unused"), reward=RewardConfig(function="length"),
    trainer=TrainerConfig(max_steps=1, prompts_per_step=2, minibatch_size=4, kl_coef=0.05),
    rollout=RolloutConfig(n=2, max_new_tokens=4, max_logprob_mismatch=None), algorithm="grpo"), on_gpu=True)
assert cpu_tools() is None and vllm_adapter._in_place_updaters() == (vllm_adapter.load_in_place_on_cuda,)
with OtherDevice() as dev:                      # the models on a second device: every branch a GPU takes
    actor = dev.move(make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=1).train())
    reference = dev.move(make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=1).eval())
    step = RLStep(config, actor, HFEngine(actor), RewardScorer("length"), reference=reference,
                  actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3), pad_token_id=0,
                  rollout_shares_actor=True, device=dev.device, guard=StepGuard())
    metrics = step([[5, 6, 7], [8, 9]], None, step=1)
    assert step.release_reference_pages() == 0
assert metrics["optimizer_steps"] == 1, metrics
loaded = sorted(m for m in sys.modules if m == "fastrlhf.cpu" or m.startswith("fastrlhf.cpu."))
print("LOADED", loaded)
'''


def test_a_gpu_run_loads_nothing_of_the_cpu_package():
    proc = subprocess.run([sys.executable, "-c", GPU_RUN], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED []" in proc.stdout, proc.stdout[-2000:]


def test_a_cpu_run_gets_the_cpu_package():
    from fastrlhf.engine.platform import cpu_tools

    cpu = cpu_tools("cpu")
    assert cpu is not None and {"hostmem", "file_pages", "zero_master", "vllm_inplace_sync"} <= set(dir(cpu))
    assert cpu_tools("meta") is None  # any other device is not a CPU run
