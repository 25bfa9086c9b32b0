"""DeepSpeed's ZeRO optimizer steps without their own host reads: the guard's one read decides.

Under ``torch.cuda.set_sync_debug_mode("error")`` (``tests/gpu/test_update_syncs.py``, one H100, DeepSpeed
0.19.8) the step of ``DeepSpeedZeroOptimizer`` stalls the stream beside the guard's one named read:

- ``mask_nan_or_inf_with_val_inplace`` (the gradient norm's last line, ZeRO 1-3) makes its fill value with
  ``torch.tensor(-1.0, device=...)``: a blocking host-to-device copy, once per parameter group;
- with gradient clipping, ``unscale_and_clip_grads`` branches on ``is_invalid_grad_norm(norm)``: ``bool()``
  of a device tensor, once per parameter group.

:func:`remove_zero_step_reads` replaces both with the same arithmetic kept on the device: the same values,
the invalid-norm case included (DeepSpeed clips with an infinite norm there, which zeroes the gradients).

One more read decides whether to step at all: ``is_invalid_grad_norm`` of the global norm, in the step of
ZeRO-3 (every dtype) and of ZeRO 1-2 in fp32. Where a guard decides (:func:`guard_checks_the_norm`) it is
not needed: ``GuardedAdamW`` adds the global norm's validity to the guard's decision, which drops the step
on every sub-group and rank, so inside such a step the check answers "valid" without reading. Everywhere
else (an engine without a guard) DeepSpeed's own check runs.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["ORIGINALS", "remove_zero_step_reads", "mask_nan_or_inf_with_val_inplace", "unscale_and_clip_grads",
           "is_invalid_grad_norm", "guard_checks_the_norm"]


def mask_nan_or_inf_with_val_inplace(input: torch.Tensor, device=None, val: float = -1.0) -> None:
    """DeepSpeed's, with the fill value a Python number (a kernel argument) instead of a copied tensor."""
    input.masked_fill_(~torch.isfinite(input), val)


def unscale_and_clip_grads(self, grad_groups_flat, total_norm) -> None:
    """``DeepSpeedZeroOptimizer.unscale_and_clip_grads`` with the invalid-norm branch a ``torch.where``."""
    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    combined_scale = self.loss_scale
    if self.clip_grad > 0.0:
        # DeepSpeed: a non-finite norm or its -1 sentinel clips as an infinite norm
        valid = torch.isfinite(total_norm) & (total_norm >= 0)
        clip_norm = torch.where(valid, total_norm, torch.full_like(total_norm, float("inf")))
        clip = torch.clamp(((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0)
        combined_scale = clip * self.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)


# DeepSpeed's own functions, kept when replaced (tests/engine/test_deepspeed_reads.py compares against them).
ORIGINALS: dict[str, object] = {}
# How many guarded ZeRO steps are running now (one at most: an engine steps on its caller's thread).
_guarded_steps = 0


def is_invalid_grad_norm(norm) -> bool:
    """DeepSpeed's, except inside a step wrapped by :func:`guard_checks_the_norm`: there the guard judges
    the norm, in its one read, so this answers "valid" without reading the device."""
    if _guarded_steps:
        return False
    return ORIGINALS["is_invalid_grad_norm"](norm)


def guard_checks_the_norm(zero_optimizer) -> None:
    """Marks ``zero_optimizer``'s steps as ones whose inner ``GuardedAdamW`` guard judges the global norm
    (an instance attribute: other engines in the process keep DeepSpeed's own check)."""
    step = zero_optimizer.step

    @functools.wraps(step)
    def guarded_step(*args, **kwargs):
        global _guarded_steps
        _guarded_steps += 1
        try:
            return step(*args, **kwargs)
        finally:
            _guarded_steps -= 1

    zero_optimizer.step = guarded_step


def remove_zero_step_reads() -> None:
    """Install the three in DeepSpeed's modules (idempotent; before ``deepspeed.initialize``)."""
    from deepspeed.runtime import utils
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    zero = stage_1_and_2.DeepSpeedZeroOptimizer
    ORIGINALS.setdefault("mask_nan_or_inf_with_val_inplace", utils.mask_nan_or_inf_with_val_inplace)
    ORIGINALS.setdefault("unscale_and_clip_grads", zero.unscale_and_clip_grads)
    ORIGINALS.setdefault("is_invalid_grad_norm", utils.is_invalid_grad_norm)
    for module in (utils, stage_1_and_2, stage3):
        if hasattr(module, "mask_nan_or_inf_with_val_inplace"):
            module.mask_nan_or_inf_with_val_inplace = mask_nan_or_inf_with_val_inplace
    # Where the two steps call it; utils' own callers (overflow checks of other optimizers) keep DeepSpeed's.
    for module in (stage_1_and_2, stage3):
        module.is_invalid_grad_norm = is_invalid_grad_norm
    zero.unscale_and_clip_grads = unscale_and_clip_grads
