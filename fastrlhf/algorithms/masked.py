"""Masked reductions over ``[B, T]`` per-token tensors: ``mask`` is 1.0 where a token counts, 0.0 elsewhere.

Masking uses ``torch.where`` rather than multiplication, so whatever sits at a masked position (-inf
logprobs of padding, NaN values) can never leak into a result.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_same_shape", "masked_mean", "masked_sum", "masked_var", "masked_whiten", "whiten_with_stats", "zero_masked"
]


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise a ValueError naming both shapes if any two tensors differ; nothing broadcasts."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"shape mismatch: {first_name} has shape {tuple(first.shape)} "
                f"but {name} has shape {tuple(t.shape)}"
            )


def _keep(mask: torch.Tensor) -> torch.Tensor:
    return mask > 0


def zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with 0 at masked positions, whatever they held (NaN, inf): nothing there reaches a result or, through
    ``torch.where``, a gradient."""
    return torch.where(_keep(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    check_same_shape(x=x, mask=mask)
    kept = zero_masked(x, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def _count(mask: torch.Tensor, dim: int | None, dtype: torch.dtype) -> torch.Tensor:
    keep = _keep(mask).to(dtype)
    return keep.sum() if dim is None else keep.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over mask==1; an empty selection gives 0 (not NaN) so a padded batch never poisons a loss."""
    return masked_sum(x, mask, dim) / _count(mask, dim, x.dtype).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    check_same_shape(x=x, mask=mask)
    n = int(_keep(mask).sum())
    if n == 0 or (unbiased and n == 1):
        raise ValueError(f"masked_var needs at least {2 if unbiased else 1} unmasked elements, got {n}")
    centered = zero_masked(x - masked_mean(x, mask), mask)
    var = masked_mean(centered.square(), mask)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + eps)`` over mask==1; masked positions come out as 0."""
    return whiten_with_stats(x, mask, masked_mean(x, mask), masked_var(x, mask), shift_mean, eps)


def whiten_with_stats(x: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                      shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """:func:`masked_whiten` with a given mean and (unbiased) variance, e.g. those of a batch that
    several ranks hold between them."""
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_masked(whitened, mask)
