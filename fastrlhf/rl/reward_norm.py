"""``reward.normalize``: training scores normalised by the running moments of every score seen so far.

The moments are those of TRL's ``RunningMoments`` (``trl/trainer/utils.py``, ``RunningMoments.update`` with
``get_global_statistics``; from MOSS-RLHF's ``utils.py``), as TRL's PPOTrainer applied them with
``use_score_scaling`` and ``use_score_norm`` (``PPOTrainer.compute_rewards``' caller, ``step``): each batch first
updates the moments (its mean and population variance over every rank, merged with the running ones by Chan's
parallel formula, the count starting at 1e-24), then the batch is normalised by them, itself included:
``(score - mean) / (std + eps)``, ``std`` the Bessel-corrected running deviation, ``eps`` the score dtype's machine
epsilon; the clip (``reward.clip_range``) comes after. OpenRLHF's ``--reward.normalize_enable`` subtracts a mean and
divides by a deviation too, but fixed ones (``openrlhf/models/model.py``, the reward model's ``forward``: the
``mean``/``std`` its reward-model training measured over its eval set, ``openrlhf/trainer/rm_trainer.py``); a
running estimate serves any scorer (rule rewards, environments) and follows the policy's drift.

``reward.normalize: stored`` is OpenRLHF's instead (:func:`stored_moments`): the reward model's scores alone, in
training and validation alike, as ``(score - mean) / std`` by the ``mean`` and ``std`` of its config.json.

Here the moments live on the scores' device in fp64 (no host read; two all-reduces per scored batch), and skip
non-finite scores: a NaN score still reaches the step's guard (normalised, it stays NaN) but cannot poison every
later step's moments. They are checkpointed (``state_dict``), so a ``--resume`` goes on with the same ones.
"""

from __future__ import annotations

import torch

from fastrlhf.distributed import comm

__all__ = ["RunningMoments", "stored_moments"]


class RunningMoments:
    """Running mean, population variance and count (0-dim fp64 tensors on ``device``), every rank's scores.

    Every rank holds one and updates it with the same reduced moments, so all agree; :meth:`normalize` is a
    collective (call it on every rank, as many times)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.mean = torch.zeros((), dtype=torch.float64, device=self.device)
        self.var = torch.ones((), dtype=torch.float64, device=self.device)
        self.count = torch.full((), 1e-24, dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def update(self, scores: torch.Tensor) -> None:
        """Merge the finite ``scores`` of every rank into the moments (none anywhere: unchanged)."""
        x = scores.detach().to(self.device, torch.float64).reshape(-1)
        finite = torch.isfinite(x)
        x = torch.where(finite, x, torch.zeros_like(x))
        totals = comm.all_reduce_(torch.stack([x.sum(), finite.sum().double()]))
        n = totals[1]
        batch_mean = totals[0] / n.clamp(min=1)
        squares = torch.where(finite, (x - batch_mean).square(), torch.zeros_like(x)).sum().reshape(1)
        batch_var = comm.all_reduce_(squares)[0] / n.clamp(min=1)
        delta = batch_mean - self.mean
        total = self.count + n
        merged = (self.var * self.count + delta.square() * self.count * n / total + batch_var * n) / total
        seen = n > 0
        self.mean = torch.where(seen, self.mean + delta * n / total, self.mean)
        self.var = torch.where(seen, merged, self.var)
        self.count = torch.where(seen, total, self.count)

    @property
    def std(self) -> torch.Tensor:
        """The Bessel-corrected running deviation (below two scores seen: the population one)."""
        return (self.var * self.count / (self.count - 1).clamp(min=1)).sqrt()

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` after updating the moments with them, ``(scores - mean) / (std + eps)`` in their dtype."""
        self.update(scores)
        eps = torch.finfo(scores.dtype).eps
        mean, std = (m.to(scores.device) for m in (self.mean, self.std))
        return ((scores.double() - mean) / (std + eps)).to(scores.dtype)

    def state_dict(self) -> dict:
        return {name: getattr(self, name).detach().cpu() for name in ("mean", "var", "count")}

    def load_state_dict(self, state: dict) -> None:
        for name in ("mean", "var", "count"):
            setattr(self, name, torch.as_tensor(state[name], dtype=torch.float64).to(self.device))


def stored_moments(reward_model) -> tuple[float, float]:
    """``(mean, std)`` of a loaded reward model's config (its config.json's ``mean`` and ``std``: OpenRLHF's
    ``RewardModel`` reads them into its ``mean``/``std`` buffers, ``openrlhf/models/model.py``; its ``train_rm``
    measures them over its eval set, ``rm_trainer.py``; ``fastrlhf rm`` over its training data). A ValueError where
    the config has none (the config check refuses such a folder first)."""
    m = getattr(reward_model, "module", reward_model)
    config = getattr(m, "config", None) or getattr(getattr(m, "lm", None), "config", None)
    mean, std = getattr(config, "mean", None), getattr(config, "std", None)
    if not isinstance(mean, (int, float)) or not isinstance(std, (int, float)) or not std > 0:
        raise ValueError(f"reward.normalize: stored needs the reward model's config.json to hold a mean and a positive "
                         f"std, got mean {mean!r}, std {std!r}")
    return float(mean), float(std)
