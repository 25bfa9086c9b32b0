"""The per-token policy loss in Triton: PPO's clipped surrogate (clip-higher, dual clip), CISPO or SAPO, the KL
penalty (k1, abs, k2, k3, and their "+" kinds: the value with k2's gradient) and the entropy bonus, with each
token's gradient in its logprob and entropy and the loss and metric sums.
Two kernels share that math (``policy_loss_triton_jit._token_loss_math``, one ``@triton.jit`` helper):

* ``loss``: a block of tokens' logprobs and entropies in, their gradients and the block's sums out; one launch
  instead of about a hundred small torch kernels per chunk, which on a GPU cost more in launches than in
  arithmetic (:func:`triton_policy_loss_from_token_stats`).
* ``rows``: one program per row of logits does the whole chunk step: the row's softmax statistics (the
  online pass of ``logprob_entropy_triton.py``'s ``stats``), its token's loss and gradients, then its
  ``dlogits`` (the ``grad`` pass), in one launch per chunk instead of three plus a sum, and with the row's
  second read straight after its first, from the GPU's L2 cache when the rows read at once fit there (fewer of
  them where a few programs loop over the rows: ``programs``). A masked row reads nothing and writes zeros
  (:func:`triton_row_loss_and_grad`).

Their reference is :func:`fastrlhf.kernels.policy_loss.policy_loss_from_token_stats` (autograd through
``fastrlhf.algorithms``, where the formulas live) and, for ``rows``, the stats and gradient primitives of
``logprob_entropy.py``; the kernels do the same math, derivative by derivative. The derivatives follow autograd's
conventions where a choice exists: ``clamp`` passes the gradient inside its bounds (inclusive),
``maximum``/``minimum`` split it in halves at a tie, ``abs`` gives 0 at 0. Covers the ``vanilla``, ``cispo`` and
``sapo`` policy losses (:data:`POLICY_LOSS_CODES`); other registered losses take the reference
(:func:`token_loss_function`). Built lazily (importing this module
never imports triton; the kernels themselves are in ``policy_loss_triton_jit.py``); ``_triton_aot.py``
AOT-compiles every variant.
"""

from __future__ import annotations

import functools
import types

import torch

from fastrlhf.algorithms import KL_KINDS
from fastrlhf.algorithms.logprobs import K3_CLAMP, LOG_RATIO_CLAMP, STRAIGHT_THROUGH, resolve_kl_kind

from ._checks import check_token_inputs

__all__ = ["KL_KIND_CODES", "KL_STRAIGHT_THROUGH_CODES", "LOOPING_BLOCK_V", "POLICY_LOSS_CODES", "SUM_COLUMNS",
           "row_block_v", "token_loss_kernels", "triton_policy_loss_from_token_stats", "triton_row_loss_and_grad"]

# KL kind -> the kernels' KL_KIND constexpr.
KL_KIND_CODES = {kind: code for code, kind in enumerate(KL_KINDS)}
# A "+" kind (verl's k3+: the estimate's value with k2's gradient) -> its code, 4 + its estimator's (k2+ is k2).
KL_STRAIGHT_THROUGH_CODES = {kind + STRAIGHT_THROUGH: len(KL_KINDS) + code for kind, code in KL_KIND_CODES.items()
                             if kind != "k2"}
# The registered policy losses the kernels compute (fastrlhf.algorithms.losses) -> their LOSS_KIND constexpr.
POLICY_LOSS_CODES = {"vanilla": 0, "cispo": 1, "sapo": 2}
# What each block (``loss``) or row (``rows``) writes, in this order: its loss, then the metric sums of
# policy_loss.METRIC_SUM_KEYS.
SUM_COLUMNS = ("loss", "clipped", "approx_kl", "entropy", "kl", "count")
BLOCK = 1024
# The row kernel's block on a GPU when few programs loop over the rows (``programs``): 32 KB of bf16 logits per load
# round and 32 warps, so that a program per SM keeps enough bytes in flight without more rows in L2 at once.
LOOPING_BLOCK_V = 16384


@functools.cache
def token_loss_kernels():
    """The kernels, built on first use (importing ``policy_loss_triton_jit`` reads TRITON_INTERPRET then); a
    namespace with ``loss`` and ``rows``."""
    from . import policy_loss_triton_jit as jit

    return types.SimpleNamespace(loss=jit._token_loss_kernel, rows=jit._row_loss_kernel)


def _check_loss_options(policy_loss, dual_clip, kl_kind, what, policy_loss_args=None) -> dict:
    """The kernels' options checked as the reference checks them; returns the launch's loss arguments (the KL
    kind's and the loss's codes, SAPO's temperatures). The dual clip is vanilla's alone (the others ignore it)."""
    from fastrlhf.algorithms.losses import policy_loss_options

    if policy_loss not in POLICY_LOSS_CODES:
        raise ValueError(f"{what} fuses the {', '.join(POLICY_LOSS_CODES)} policy losses, got {policy_loss!r}")
    options = policy_loss_options(policy_loss)
    unknown = sorted(set(policy_loss_args or {}) - set(options))
    if unknown:
        raise ValueError(f"the {policy_loss} policy loss takes {sorted(options) or 'no options'}, got {unknown}")
    options.update(policy_loss_args or {})
    if policy_loss == "vanilla" and dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
    tau_pos, tau_neg = float(options.get("tau_pos", 1.0)), float(options.get("tau_neg", 1.0))
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {options['tau_pos']} and {options['tau_neg']}")
    kind, straight_through = resolve_kl_kind(kl_kind)  # raises on an unknown kind, as the reference does
    code = KL_STRAIGHT_THROUGH_CODES[kind + STRAIGHT_THROUGH] if straight_through else KL_KIND_CODES[kind]
    return dict(KL_KIND=code, LOSS_KIND=POLICY_LOSS_CODES[policy_loss],
                HAS_DUAL=policy_loss == "vanilla" and dual_clip is not None, tau_pos=tau_pos, tau_neg=tau_neg)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _loss_and_sums(sums: torch.Tensor):
    total = sums.sum(0)
    return total[0], {k: total[i] for i, k in enumerate(SUM_COLUMNS) if k != "loss"}


def triton_policy_loss_from_token_stats(logprobs, entropy, old_logprobs, advantages, weights, ref_logprobs=None, *,
                                        clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.0, kl_kind="k3",
                                        entropy_coef=0.0, policy_loss="vanilla", policy_loss_args=None):
    """:func:`fastrlhf.kernels.policy_loss.policy_loss_from_token_stats` (same arguments, checks and results) in
    one kernel launch and one sum; the policy losses of :data:`POLICY_LOSS_CODES`."""
    loss_kw = _check_loss_options(policy_loss, dual_clip, kl_kind, "the Triton token loss", policy_loss_args)
    check_token_inputs(logprobs, entropy, old_logprobs, advantages, weights, ref_logprobs, kl_coef)
    n, device = logprobs.numel(), logprobs.device
    grad_lp = torch.empty(n, dtype=torch.float32, device=device)
    grad_ent = torch.empty(n, dtype=torch.float32, device=device)
    blocks = -(-n // BLOCK)
    sums = torch.zeros(max(blocks, 1), len(SUM_COLUMNS), dtype=torch.float32, device=device)
    if n:
        lp = _f32(logprobs)
        token_loss_kernels().loss[(blocks,)](
            lp, _f32(entropy), lp if old_logprobs is None else _f32(old_logprobs), _f32(advantages), _f32(weights),
            lp if ref_logprobs is None else _f32(ref_logprobs), grad_lp, grad_ent, sums,
            n, float(clip_low), float(clip_high), float(dual_clip or 0.0), float(kl_coef), float(entropy_coef),
            HAS_OLD=old_logprobs is not None, HAS_REF=ref_logprobs is not None, **loss_kw,
            LOG_RATIO_MAX=LOG_RATIO_CLAMP, K3_MAX=K3_CLAMP, BLOCK=BLOCK,
        )
    loss, metric_sums = _loss_and_sums(sums)
    return loss, grad_lp, grad_ent, metric_sums


def row_block_v(vocab_size: int, programs: int | None, on_gpu: bool) -> int:
    """The row kernel's BLOCK_V: :data:`LOOPING_BLOCK_V` (no wider than the vocabulary's next power of two) where a
    few programs loop over the rows on a GPU, else the softmax kernels' (``logprob_entropy_triton.default_block_v``)."""
    from .logprob_entropy_triton import _next_power_of_2, default_block_v

    if programs is not None and on_gpu:
        return min(LOOPING_BLOCK_V, _next_power_of_2(vocab_size))
    return default_block_v(vocab_size, on_gpu=on_gpu)


def triton_row_loss_and_grad(logits, labels, old_logprobs, advantages, weights, ref_logprobs, temperature, *,
                             out=None, clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.0, kl_kind="k3",
                             entropy_coef=0.0, policy_loss="vanilla", policy_loss_args=None, block_v=None,
                             programs=None):
    """A chunk's policy loss straight from its ``[n, V]`` logits, in one launch: ``(loss, metric_sums)`` as
    :func:`fastrlhf.kernels.policy_loss.policy_loss_from_token_stats` returns them of the logits' logprobs and
    entropies, and, where ``out`` is given (``[n, V]``, the logits themselves for in place), ``dlogits`` written
    there as ``logprob_entropy_grad`` writes them from that loss's per-token gradients (the entropy's only where
    ``entropy_coef`` is not 0). Labels are not checked here (the caller checks them once); the policy losses of
    :data:`POLICY_LOSS_CODES`. ``programs``: launch that many programs, each taking every ``programs``-th row,
    with blocks of :data:`LOOPING_BLOCK_V` on a GPU (None: one per row); the results do not depend on it."""
    from .logprob_entropy_triton import _num_warps

    loss_kw = _check_loss_options(policy_loss, dual_clip, kl_kind, "the Triton row loss", policy_loss_args)
    n, v = logits.shape
    if ref_logprobs is None and kl_coef != 0.0:
        raise ValueError(f"kl_coef is {kl_coef} but ref_logprobs is None; pass ref_logprobs or set kl_coef=0")
    # Every row writes its six sums (a masked row zeros), so no zeros pass; with no row, one row of zeros.
    sums = (torch.empty if n else torch.zeros)(max(n, 1), len(SUM_COLUMNS), dtype=torch.float32, device=logits.device)
    if n:
        if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
            raise ValueError(f"programs must be a positive int or None (one per row), got {programs!r}")
        block = block_v or row_block_v(v, programs, on_gpu=logits.is_cuda)
        grid = n if programs is None else min(n, programs)
        w = _f32(weights)
        token_loss_kernels().rows[(grid,)](
            # labels.contiguous(): the kernels read every per-row input at unit stride
            logits, logits.stride(0), labels.contiguous(), w if old_logprobs is None else _f32(old_logprobs),
            _f32(advantages), w,
            w if ref_logprobs is None else _f32(ref_logprobs), logits if out is None else out,
            logits.stride(0) if out is None else out.stride(0), sums, n, grid,
            v, 1.0 / temperature, float(clip_low), float(clip_high), float(dual_clip or 0.0), float(kl_coef),
            float(entropy_coef), HAS_OLD=old_logprobs is not None, HAS_REF=ref_logprobs is not None, **loss_kw,
            NEED_GRAD=out is not None, LOG_RATIO_MAX=LOG_RATIO_CLAMP, K3_MAX=K3_CLAMP, BLOCK_V=block,
            num_warps=_num_warps(block),
        )
    return _loss_and_sums(sums)
