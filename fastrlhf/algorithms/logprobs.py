"""Logprobs, entropy and the KL estimators of a policy to its reference, from logits (the reference the
fused kernels are tested against).
"""

from __future__ import annotations

import torch

from fastrlhf.algorithms.masked import check_same_shape, zero_masked

__all__ = [
    "K3_CLAMP", "LOG_RATIO_CLAMP", "KL_KINDS", "entropy_from_logits", "kl_penalty", "logprobs_from_logits",
    "resolve_kl_kind",
]


KL_KINDS = ("k1", "abs", "k2", "k3")


# verl's names for the same estimators, accepted so configs move between the projects.
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
# verl's straight-through suffix (verl.trainer.ppo.core_algos.kl_penalty): "k3+" is k3's value with k2's gradient.
# k1 and k3 are unbiased estimates of KL(policy || ref) but their gradients are not its gradient; k2's is.
STRAIGHT_THROUGH = "+"


# exp() of a log-ratio above this overflows fp32 long before it carries information.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 for the softmax math; fp64 stays fp64 (gradchecks need it)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at ``labels``, in fp32 (fp64 stays fp64).

    logits ``[..., V]``, labels ``[...]``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"shape mismatch: logits has shape {tuple(logits.shape)} (expected labels shape + [V]) "
            f"but labels has shape {tuple(labels.shape)}"
        )
    _check_temperature(temperature)
    logp = torch.log_softmax(_upcast(logits) / temperature, dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) in fp32; stays finite when some logits are -inf."""
    _check_temperature(temperature)
    z = _upcast(logits) / temperature
    p = torch.softmax(z, dim=-1)
    # H = lse(z) - sum p*z. A -inf logit has p == 0: zero its z so 0 * -inf never makes a NaN
    # (in the value or in the gradient).
    z_finite = z.masked_fill(torch.isneginf(z), 0.0)
    return torch.logsumexp(z, dim=-1) - (p * z_finite).sum(-1)


def resolve_kl_kind(kind: str) -> tuple[str, bool]:
    """``(estimator, straight_through)`` of a KL kind: the estimator of :data:`KL_KINDS` (verl's names
    accepted), and whether a trailing "+" asks for its value with k2's gradient (never for k2 itself)."""
    plus = isinstance(kind, str) and kind.endswith(STRAIGHT_THROUGH)
    base = kind.removesuffix(STRAIGHT_THROUGH) if plus else kind
    base = _KL_ALIASES.get(base, base)
    if base not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)} (verl's "
                         f"{', '.join(_KL_ALIASES)} accepted), each optionally followed by {STRAIGHT_THROUGH!r} "
                         "(its value with k2's gradient)")
    return base, plus and base != "k2"


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimator between the policy and the reference (Schulman's k1/k2/k3, and |k1|), in at least
    fp32 (fp64 stays fp64). A ``kind`` ending in "+" (verl's k1+, k3+, low_var_kl+) is the estimator's value with
    k2's gradient (:func:`resolve_kl_kind`); where no gradient is taken it is the estimator itself.

    With ``mask``, masked positions are 0 and pass no gradient whatever they hold: padding with a
    -inf reference logprob would otherwise send ``0 * inf = NaN`` back through k2 (masking the
    result afterwards is too late for the backward pass).
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    kind, straight_through = resolve_kl_kind(kind)
    diff = _upcast(logprobs) - _upcast(ref_logprobs)  # bf16 steps by 1/128 near 1: k3's exp(d) would be noise
    if mask is not None:
        check_same_shape(logprobs=logprobs, mask=mask)
        diff = zero_masked(diff, mask)
    value = _estimate(diff, kind)
    if not (straight_through and diff.requires_grad):  # no gradient asked for: the estimate alone, exactly
        return value
    # verl's est.detach() + k2 - k2.detach(): the estimate's value (k2 - k2.detach() is exactly 0 for a finite
    # log-ratio), and k2's gradient d/dlogp = logp - ref, clamped by neither of k3's clamps
    k2 = 0.5 * diff.square()
    return value.detach() + (k2 - k2.detach())


def _estimate(diff: torch.Tensor, kind: str) -> torch.Tensor:
    """The estimator ``kind`` (of :data:`KL_KINDS`) of the log-ratios ``diff = logp - ref``."""
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    d = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # exp(d) - 1 - d by expm1: exp(d) - 1 cancels to noise near d = 0 (a policy near its reference), where
    # k3 is about d^2 / 2 and came out negative for |d| ~ 1e-4 in fp32, for |d| ~ 1e-2 in bf16.
    return (torch.expm1(d) - d).clamp(-K3_CLAMP, K3_CLAMP)
