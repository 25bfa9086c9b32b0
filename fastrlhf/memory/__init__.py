"""Memory arithmetic for ``fastrlhf plan`` (:mod:`fastrlhf.memory.plan`): model shapes read from ``config.json``.

Nothing here imports torch: a plan answers before any model, or torch itself, loads.
"""

from .architecture import SUPPORTED_MODEL_TYPES, ModelShape, read_shape

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelShape", "read_shape"]
