"""The adaptive KL coefficient (``trainer.kl_target``): Ziegler et al. (2019), as verl's ``kl_ctrl.type: adaptive``
and OpenRLHF's ``--kl_target`` run it.

A fixed ``kl_coef`` that holds the policy near the reference early in a run may be too weak or too strong later,
when the reward pulls harder or softer. The controller moves the coefficient toward the one that keeps the
measured KL at ``target``: after each step,

    error = clip(kl / target - 1, -0.2, 0.2)
    kl_coef <- kl_coef * (1 + error * samples / horizon)

``kl`` is the step's measured KL (the logged ``kl`` metric: the ``trainer.kl_kind`` estimate of KL(policy || ref),
the mean over the batch's response tokens, every rank's together), ``samples`` the completions the step trained on
(every rank's). The clip bounds the change of one step to ``0.2 * samples / horizon`` of the coefficient, so
``horizon`` (in samples) sets how fast it moves: with 256 completions per step and the default 10,000, at most
0.5% per step. It starts at ``trainer.kl_coef`` and stays positive: the config refuses a horizon of
``0.2 * samples`` or less.
"""

from __future__ import annotations

import math

__all__ = ["KL_ERROR_CLIP", "AdaptiveKLController", "adaptive_kl_coef"]

KL_ERROR_CLIP = 0.2  # the largest |error| one step acts on (the config's bound on kl_horizon follows from it)


def adaptive_kl_coef(coef: float, kl: float, target: float, samples: int, horizon: int) -> float:
    """The coefficient after a step that measured ``kl`` over ``samples`` completions (the formula above)."""
    error = min(max(kl / target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
    return coef * (1.0 + error * samples / horizon)


class AdaptiveKLController:
    """The coefficient and its updates; ``state_dict``/``load_state_dict`` for checkpoints (a resumed run goes on
    with the coefficient it had). Every rank holds one and feeds it the same reduced ``kl``, so all agree."""

    def __init__(self, init_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = float(init_coef), float(target), int(horizon)

    def update(self, kl: float | None, samples: int) -> None:
        """After a step: a step that measured no finite KL (skipped, or its update stopped) leaves it as it is."""
        if kl is not None and math.isfinite(kl):
            self.value = adaptive_kl_coef(self.value, kl, self.target, samples, self.horizon)

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
