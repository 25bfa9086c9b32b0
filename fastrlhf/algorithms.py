"""Reference RL math: the one home of every formula the trainer and the kernels use. Plain
PyTorch, importable with torch alone. Per-token tensors are ``[B, T]`` aligned on response tokens;
``mask`` is 1.0 where a token counts and 0.0 elsewhere. Names follow verl's ``core_algos``.

Masking is done with ``torch.where`` rather than multiplication so that whatever sits at a
masked position (-inf logprobs of padding, NaN values) can never leak into a result.

What differs between PPO and GRPO lives in two registries, verl-style:

* :data:`ADV_ESTIMATORS` (``@register_adv_est``): ``gae`` (PPO, with a critic) and ``grpo``;
  ``ADV_ESTIMATOR_OF[algorithm]`` says which one an algorithm uses.
* :data:`POLICY_LOSSES` (``@register_policy_loss``): ``vanilla`` (clipped surrogate, clip-higher,
  dual clip), ``cispo`` and ``gspo``; chosen by ``trainer.policy_loss``.

Adding a loss is one registered function. ``token_level=True`` says each token's loss depends on
that token alone; such a loss runs inside the token-chunked fused kernels
(``fastrlhf.kernels.fused_linear_policy_loss``), which evaluate it on chunks of flattened tokens.
A loss that needs a whole sequence (GSPO's sequence-level ratio) is registered with
``token_level=False`` and trained through the fused logprob kernel plus autograd instead; neither
path materialises the ``[tokens, vocab]`` logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fastrlhf import comm

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATOR_OF",
    "AGG_MODES",
    "POLICY_LOSSES",
    "actor_loss_per_token",
    "bradley_terry_loss",
    "nll_loss",
    "register_adv_est",
    "register_policy_loss",
    "truncated_is_weights",
    "whiten_across_ranks",
    "KL_KINDS",
    "aggregate_loss",
    "aggregation_weights",
    "check_same_shape",
    "clipped_surrogate",
    "compute_gae",
    "compute_grpo_advantages",
    "get_policy_loss",
    "entropy_from_logits",
    "kl_penalty",
    "last_token_index",
    "logprobs_from_logits",
    "loss_weights",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "whiten_with_stats",
    "policy_loss",
    "shape_rewards",
    "value_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3")
# verl's names for the same estimators, accepted so configs move between the projects.
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

# exp() of a log-ratio above this overflows fp32 long before it carries information.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


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


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    check_same_shape(x=x, mask=mask)
    kept = torch.where(_keep(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
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
    centered = torch.where(_keep(mask), x - masked_mean(x, mask), torch.zeros((), dtype=x.dtype, device=x.device))
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
    return torch.where(_keep(mask), whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))


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


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimator between the policy and the reference (Schulman's k1/k2/k3, and |k1|).

    With ``mask``, masked positions are 0 and pass no gradient whatever they hold: padding with a
    -inf reference logprob would otherwise send ``0 * inf = NaN`` back through k2 (masking the
    result afterwards is too late for the backward pass).
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    kind = _KL_ALIASES.get(kind, kind)
    diff = logprobs - ref_logprobs
    if mask is not None:
        check_same_shape(logprobs=logprobs, mask=mask)
        diff = torch.where(_keep(mask), diff, torch.zeros((), dtype=diff.dtype, device=diff.device))
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        d = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(d) - d - 1).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last mask==1 position (-1 for a row with none)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(_keep(mask), positions, torch.full_like(positions, -1)).amax(-1)


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> torch.Tensor:
    """Per-token reward ``-kl_coef * kl * mask`` with ``scores[b]`` added at row b's last token.

    A row with no mask==1 position receives no score (there is no token to credit).
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"shape mismatch: scores has shape {tuple(scores.shape)} but logprobs has shape "
                         f"{tuple(logprobs.shape)} (expected scores of shape [B])")
    kl = kl_penalty(logprobs, ref_logprobs, kind, mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(_keep(mask), -kl_coef * kl, zero)
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; returns ``(advantages, returns)``, advantages not whitened.

    The reverse recursion skips mask==0 positions: they neither receive an advantage (0 there)
    nor break the chain (the next value and running advantage carry across them), so a
    multi-turn response with masked tool output in the middle is one trajectory.
    """
    check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    keep = _keep(mask)
    B, T = values.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    running = torch.zeros(B, dtype=values.dtype, device=values.device)
    advantages = []
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * running
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        running = torch.where(keep[:, t], gae, running)
        advantages.append(torch.where(keep[:, t], gae, torch.zeros_like(gae)))
    adv = torch.stack(advantages[::-1], dim=1)
    return adv, adv + values


def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | Sequence[int],
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Group-relative advantages ``[B]``: score minus its group's mean, over (unbiased std + eps).

    ``scale_by_std=False`` is Dr.GRPO (no std division). A group of one gets 0.
    """
    group_ids = torch.as_tensor(group_ids, device=scores.device)
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"shape mismatch: scores has shape {tuple(scores.shape)} but group_ids has shape "
                         f"{tuple(group_ids.shape)} (expected both [B])")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, inverse, torch.ones_like(scores))
    total = zeros.index_add(0, inverse, scores)
    mean = total / count
    centered = scores - mean[inverse]
    adv = centered
    if scale_by_std:
        sq = zeros.index_add(0, inverse, centered.square())
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        adv = centered / (std[inverse] + eps)
    return torch.where(count[inverse] > 1, adv, torch.zeros_like(adv))


def aggregation_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights ``w`` with ``aggregate_loss(x, mask, mode) == sum(w * x)`` over kept tokens.

    Every mode is linear in the per-token loss; writing it as weights lets a chunked kernel
    know each token's gradient as soon as that token's loss is known.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    keep = _keep(mask).to(mask.dtype if mask.is_floating_point() else torch.float32)
    if mode == "token-mean":
        return keep / keep.sum().clamp(min=1)
    if mask.dim() != 2:
        raise ValueError(f"aggregation mode {mode!r} needs [B, T] tensors, got shape {tuple(mask.shape)}")
    tokens_per_seq = keep.sum(-1, keepdim=True)
    # Fully masked rows are left out of the mean over sequences.
    n_seqs = (tokens_per_seq > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return keep / tokens_per_seq.clamp(min=1) / n_seqs
    weights = keep / n_seqs
    if mode == "seq-mean-token-sum-norm":
        weights = weights / mask.shape[-1]
    return weights


def loss_weights(mask: torch.Tensor, mode: str, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token weights a loss is aggregated with: ``aggregation_weights(mask, mode)``, or
    ``weights`` when the caller already has them (detached, of mask's shape).

    Precomputed weights are how a minibatch split into micro-batches keeps exactly its loss: the
    weights come from :func:`aggregation_weights` of the WHOLE minibatch's ``[B, T]`` mask, each
    micro-batch (padded rows, or packed tokens flattened to ``[n]``) carries its tokens' share,
    and the micro-batches' ``sum(w * loss)`` add up to the minibatch's aggregate, in every mode and
    whatever the grouping. Every function with a ``weights=`` argument (:func:`aggregate_loss`,
    :func:`policy_loss`, :func:`value_loss`, the fused kernels) resolves it here.
    """
    if weights is None:
        return aggregation_weights(mask, mode)
    check_same_shape(mask=mask, weights=weights)
    return weights.detach()


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar: ``token-mean`` over all kept tokens, or a mean over
    sequences (fully masked rows left out) of each row's token mean / token sum / token sum over T.
    ``weights``: precomputed per-token weights instead (see :func:`loss_weights`).
    """
    check_same_shape(loss_mat=loss_mat, mask=mask)
    weights = loss_weights(mask, mode, weights).to(loss_mat.dtype)
    return masked_sum(loss_mat * weights, mask)


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``max(-A*r, -A*clamp(r, 1-clip_low, 1+clip_high))`` and where the clipped
    term is the larger; with ``dual_clip`` c, tokens with A<0 are also capped at ``-A*c``.
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, -advantages * dual_clip), loss_mat)
    return loss_mat, clipped > unclipped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (with clip-higher and optional dual clip); returns ``(loss, metrics)``.
    ``weights``: precomputed aggregation weights instead of ``agg`` (:func:`loss_weights`).

    ``old_logprobs=None`` is the on-policy update (the first and only optimizer step on a rollout
    batch): old = ``logprobs.detach()``, so the ratio is exactly 1 and its gradient is ``grad logprobs``.
    """
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    loss_mat, is_clipped = clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip)
    metrics = {
        "clipfrac": masked_mean(is_clipped.to(loss_mat.dtype), mask).detach(),
        "approx_kl": masked_mean(old_logprobs - logprobs, mask).detach(),
    }
    return aggregate_loss(loss_mat, mask, agg, weights), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * agg(max((v-R)^2, (old + clamp(v-old, -clip, clip) - R)^2))``; None: unclipped.
    ``weights``: precomputed aggregation weights instead of ``agg`` (:func:`loss_weights`)."""
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    clip = math.inf if clip is None else clip
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_sq = (values - returns).square()
    clipped_sq = (clipped_values - returns).square()
    loss_mat = torch.maximum(unclipped_sq, clipped_sq)
    # Clipped: the clamp is active and its term is the larger. Where it is not active, old + (v - old)
    # rounds to v give or take an ulp, and that rounding must not count.
    is_clipped = (clipped_sq > unclipped_sq) & ((values - old_values).abs() > clip)
    metrics = {"vf_clipfrac": masked_mean(is_clipped.to(loss_mat.dtype), mask).detach()}
    return 0.5 * aggregate_loss(loss_mat, mask, agg, weights), metrics


def truncated_is_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old - engine), cap)`` ``[B, T]``, 0 where masked.

    The engine sampled from its own distribution (another precision, kernels, or stale weights);
    the update treats the samples as the trainer's old policy's. Weighting each token's policy
    term by this ratio, truncated at ``cap``, corrects the mismatch with bounded variance.
    """
    check_same_shape(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, mask=mask)
    log_w = (old_logprobs - engine_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(_keep(mask), torch.exp(log_w).clamp(max=cap), 0.0)


# --------------------------------------------------------------------------------------------
# Policy losses, by name
# --------------------------------------------------------------------------------------------

PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # see vanilla_policy_loss


@dataclass(frozen=True)
class PolicyLoss:
    fn: PolicyLossFn
    token_level: bool  # True: fusable into the token-chunked kernels (a token's loss needs that token only)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, token_level: bool = True):
    """Decorator: make ``fn`` available as ``trainer.policy_loss: <name>``."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"a policy loss named {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyLoss(fn, token_level)
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


@register_policy_loss("vanilla")
def vanilla_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """PPO's clipped surrogate (clip-higher, optional dual clip), per token.

    logprobs, old_logprobs, advantages, mask: ``[B, T]`` or flat ``[n]``; returns
    ``(loss_mat, is_clipped)`` of the same shape (see :func:`clipped_surrogate`).
    """
    return clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip)


@register_policy_loss("cispo")
def cispo_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """CISPO (MiniMax-M1): ``-sg(clamp(r, 1-clip_low, 1+clip_high)) * A * logprob`` per token.

    The importance weight is clipped and detached instead of the update, so every token keeps a
    gradient (PPO's clipping zeroes it for clipped tokens). Shapes as :func:`vanilla_policy_loss`;
    ``is_clipped`` marks tokens whose weight was clipped; ``dual_clip`` is not used.
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -advantages * weight * logprobs, weight != ratio


@register_policy_loss("gspo", token_level=False)
def gspo_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=3e-4, clip_high=4e-4, dual_clip=None):
    """GSPO-token: the clipped surrogate on each sequence's length-normalised ratio.

    ``s_b = exp(mean_t(logprobs - old_logprobs))`` over row b's kept tokens; token t uses
    ``sg(s_b) * exp(logprob_t - sg(logprob_t))`` (value ``s_b``, gradient ``s_b * grad logprob_t``).
    ``[B, T]`` only (the ratio needs whole rows: not token-level, so not fused). Pair it with
    ``trainer.agg: seq-mean-token-mean`` and small clips (GSPO's paper: 3e-4 / 4e-4).
    """
    if logprobs.dim() != 2:
        raise ValueError(f"gspo needs [B, T] logprobs (whole sequences), got shape {tuple(logprobs.shape)}")
    seq_log_ratio = masked_mean(logprobs - old_logprobs, mask, dim=-1).detach()
    log_ratio = (logprobs - logprobs.detach() + seq_log_ratio[:, None]).clamp(max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def actor_loss_per_token(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    *,
    policy_loss: str = "vanilla",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The actor's per-token loss: ``policy term + kl_coef * KL(policy || ref) - entropy_coef * entropy``.

    All tensors ``[B, T]`` (or flat ``[n]`` for token-level losses). Returns ``(loss_mat,
    is_clipped, kl)``, ``kl`` None without ``ref_logprobs``; aggregate ``loss_mat`` with
    :func:`aggregate_loss` (or its :func:`aggregation_weights`, as the fused kernels do).
    """
    loss_mat, is_clipped = get_policy_loss(policy_loss).fn(logprobs, old_logprobs, advantages, mask,
                                                           clip_low=clip_low, clip_high=clip_high,
                                                           dual_clip=dual_clip)
    kl = kl_penalty(logprobs, ref_logprobs, kl_kind, mask) if ref_logprobs is not None else None
    if kl_coef != 0.0:
        if kl is None:
            raise ValueError(f"kl_coef is {kl_coef} but ref_logprobs is None; pass ref_logprobs or set kl_coef=0")
        loss_mat = loss_mat + kl_coef * kl
    if entropy_coef != 0.0:
        loss_mat = loss_mat - entropy_coef * entropy
    return loss_mat, is_clipped, kl


# --------------------------------------------------------------------------------------------
# Advantage estimators, by name
# --------------------------------------------------------------------------------------------

# fn(exp, trainer_config) -> (advantages [B, T], returns [B, T] or None); ``exp`` is the step's batch
# (``fastrlhf.rl.experience.Experience``), read for the fields each estimator names.
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
# The estimator each algorithm uses (PPO's needs the critic's values).
ADV_ESTIMATOR_OF = {"ppo": "gae", "grpo": "grpo"}


def register_adv_est(name: str):
    """Decorator: register an advantage estimator under ``name``."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"an advantage estimator named {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


@register_adv_est("grpo")
def grpo_token_advantages(exp, cfg) -> tuple[torch.Tensor, None]:
    """GRPO: each completion's group-relative score on every one of its tokens; no critic, no returns.

    Reads ``exp.scores [B]``, ``exp.group_ids [B]``, ``exp.response_mask [B, T]`` and
    ``cfg.scale_by_std`` (false: Dr.GRPO). Groups never straddle ranks (each rank samples all n
    completions of its prompts), so this needs no communication.
    """
    per_sequence = compute_grpo_advantages(exp.scores, exp.group_ids, scale_by_std=cfg.scale_by_std)
    return (per_sequence[:, None] * exp.response_mask).detach(), None


@register_adv_est("gae")
def gae_advantages(exp, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: token rewards (score at the last token, ``-kl_coef * KL(old || ref)`` on every token when
    ``cfg.kl_in_reward``), then GAE over the critic's values; advantages whitened over the whole
    batch, every rank's tokens together, when ``cfg.whiten_advantages`` (returns are not).

    Reads ``exp.scores [B]``, ``exp.values``, ``exp.old_logprobs``, ``exp.ref_logprobs`` and
    ``exp.response_mask`` (``[B, T]``); ``cfg.gamma``, ``cfg.lam``, ``cfg.kl_coef``, ``cfg.kl_kind``.
    Returns ``(advantages, returns)`` ``[B, T]``.
    """
    mask = exp.response_mask
    if cfg.kl_in_reward and cfg.kl_coef != 0.0:
        token_rewards = shape_rewards(exp.scores, exp.old_logprobs, exp.ref_logprobs, mask, cfg.kl_coef, cfg.kl_kind)
    else:
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        token_rewards = shape_rewards(exp.scores, zeros, zeros, mask, 0.0, "k1")
    advantages, returns = compute_gae(token_rewards, exp.values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = whiten_across_ranks(advantages, mask)
    return advantages.detach(), returns.detach()


def whiten_across_ranks(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`masked_whiten` with the mean and variance of the global batch, not of this rank's share.

    Per-rank statistics would make the update depend on how the batch was split. Two reductions
    of two numbers each (sum and count, then the sum of squared deviations from the global mean:
    the same two-pass variance as :func:`masked_var`), on the advantages' device; no host sync.
    Fewer than two kept tokens in the whole batch: returned unchanged (no variance to divide by).
    """
    x = advantages.detach().double()
    totals = comm.all_reduce_(torch.stack([masked_sum(x, mask), (mask > 0).sum().double()]))
    count = totals[1]
    mean = totals[0] / count.clamp(min=1)
    squares = comm.all_reduce_(masked_sum((x - mean).square(), mask).reshape(1))[0]
    var = squares / (count - 1).clamp(min=1)
    whitened = whiten_with_stats(advantages, mask, mean.to(advantages.dtype), var.to(advantages.dtype))
    return torch.where(count >= 2, whitened, advantages)


# --------------------------------------------------------------------------------------------
# Supervised stages
# --------------------------------------------------------------------------------------------


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SFT: mean negative log-likelihood of the kept tokens (``[B, T]`` logprobs and mask); 0 if none."""
    return -masked_mean(logprobs, mask)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Pairwise reward-model loss ``mean(-logsigmoid(r_chosen - r_rejected))`` over ``[B]`` rewards."""
    check_same_shape(chosen=chosen, rejected=rejected)
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()
