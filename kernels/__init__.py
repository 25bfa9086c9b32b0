"""fastrlhf.kernels: fused logprob / entropy / policy-loss kernels (Triton on CUDA, chunked torch on CPU).

This folder is installed as ``fastrlhf.kernels`` (see setup.py). Run from a checkout's root it is
also reachable as a top-level ``kernels`` package, where transformers probes for Hugging Face's
own ``kernels`` package; so this file stays free of side effects and imports nothing until an
attribute is asked for (PEP 562), and carries no ``__version__`` for that probe to mistake.
"""

import importlib

_EXPORTS = {
    "logprob_entropy": ".logprob_entropy",
    "fused_policy_loss": ".policy_loss",
    "fused_linear_logprob_entropy": ".fused_linear",
    "fused_linear_policy_loss": ".fused_linear",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
