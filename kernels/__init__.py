"""fastrlhf.kernels: fused logprob / entropy / policy-loss kernels (Triton on CUDA, chunked torch on CPU).

This folder is installed as ``fastrlhf.kernels`` (see setup.py). Run from a checkout's root it is
also reachable as a top-level ``kernels`` package, where transformers probes for Hugging Face's
own ``kernels`` package; it carries no ``__version__`` for that probe to mistake, and importing it
costs torch alone: triton is imported only when a Triton backend runs.

The public functions are bound here after their modules are imported, because importing a
submodule sets the package attribute of the same name (``logprob_entropy``) to the module.
"""

from .fused_linear import fused_linear_logprob_entropy, fused_linear_policy_loss
from .logprob_entropy import logprob_entropy
from .policy_loss import fused_policy_loss

__all__ = ["fused_linear_logprob_entropy", "fused_linear_policy_loss", "fused_policy_loss", "logprob_entropy"]
