"""``model.compile``: torch.compile of each decoder layer (regional compilation), as TorchTitan compiles its blocks.

Why the layers and not the model: every layer runs the same code, so one compiled graph (per grad mode and input
kind) serves all of them, the compile takes seconds instead of minutes, and the module tree, the parameter names
(weight sync, checkpoints, ZeRO) and the LM head (fastrlhf's fused kernel, outside the layers) stay as they are.
Inductor fuses what eager PyTorch runs as separate kernels: RMSNorm, rotary, SwiGLU, the residual adds and
their backward, fewer launches and fewer passes over the activations.

What stays eager, and why:
- the attention of packed rows (``fastrlhf.sequences.packed_attention``): it takes host data (sequence bounds,
  segments) that the compiler would specialise on, one recompile per micro-batch. Compiling around it costs one
  graph break per layer; FlexAttention inside it is still compiled on its own.
- generation with a KV cache (:func:`eager_layers`, HF ``generate``): the cache's per-layer index would make every
  layer a recompile.

Shapes are compiled dynamic (``dynamic=True``). Where a layer's code still fixes a size on the first call, the
second size compiles the dynamic graph that every later one reuses: an RL step's variants (training, the
checkpointed recompute, no-grad passes, the frozen reference) are all compiled within its first two steps, far
under torch's recompile limit (tests/modeling/test_compile_layers.py).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["BACKEND", "compile_layers", "compiled_layers", "decoder_layers", "compile_counts", "eager_layers",
           "past_recompile_limit"]

# torch.compile's backend; tests on a CPU swap in "aot_eager" (the same graphs and autograd, without code
# generation) where Inductor's C++ compile would only cost time.
BACKEND = "inductor"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model (any head, PEFT-wrapped or not): the modules that gradient
    checkpointing wraps (``GradientCheckpointingLayer``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer of ``model`` in place (``nn.Module.compile``); returns how many. Raises
    ValueError for a model without any (nothing would be compiled) or with ZeRO-3 partitioned weights."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"model.compile: {type(model).__name__} has no transformers decoder layers to compile")
    # The config check refuses compile at ZeRO-3; this catches a model loaded partitioned in code (load_causal_lm's
    # zero3_config): each layer gathers its weights in hooks the compiled graph would trace, or break on.
    if any(hasattr(p, "ds_id") for layer in layers for p in layer.parameters()):
        raise ValueError("model.compile: the model's weights are ZeRO-3 partitions; compile needs deepspeed."
                         "zero_stage 0, 1 or 2")
    for layer in layers:
        layer.compile(backend=BACKEND, dynamic=True)
    return len(layers)


def compiled_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s modules run compiled."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


@contextlib.contextmanager
def eager_layers(model: torch.nn.Module):
    """Run compiled layers eagerly inside the block (HF ``generate``: see the module docstring); nothing otherwise."""
    if not compiled_layers(model):
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def _dynamo_counters():
    """Dynamo's counters, or None where Dynamo never loaded (nothing was compiled: nothing to import for it)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import counters

    return counters


def past_recompile_limit() -> dict[str, int]:
    """Dynamo's reasons for running a frame eagerly past torch's recompile limit in this process so far (the first
    line of each) and how often each came: empty where nothing recompiled without end, or Dynamo never loaded."""
    counters = _dynamo_counters()
    found: dict[str, int] = {}
    for reason, n in (counters["unimplemented"].items() if counters is not None else ()):
        if "recompile limit" in reason.lower():
            first = reason.splitlines()[0]
            found[first] = found.get(first, 0) + n
    return found


def compile_counts() -> dict[str, int]:
    """torch.compile's work in this process so far: Dynamo frames compiled, graphs, and frames run eagerly past the
    recompile limit (zeros where Dynamo never loaded); ``trainer.profile_step`` reports them per step."""
    counters = _dynamo_counters()
    if counters is None:
        return dict(frames=0, graphs=0, past_recompile_limit=0)
    return dict(frames=int(counters["frames"]["total"]), graphs=int(counters["stats"]["unique_graphs"]),
                past_recompile_limit=sum(past_recompile_limit().values()))
