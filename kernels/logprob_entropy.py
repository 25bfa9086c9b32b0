"""Per-token log-probability and entropy of softmax(logits / T), without an extra [N, V] tensor.

Three layers, as in Liger-Kernel's ops, in three modules:

* ``logprob_entropy_triton.py``: the Triton kernels (built lazily by :func:`triton_kernels`, so
  importing this module never imports triton): ``stats`` makes one pass over each row's vocabulary
  keeping an online max, sum of exponentials and entropy accumulator, and writes three fp32 numbers
  per row; ``grad`` recomputes the softmax block by block and writes ``dlogits`` directly.
* ``logprob_entropy_torch.py``: the torch path (the CPU implementation, also used per chunk by
  ``fused_linear.py`` and ``policy_loss.py``) doing the same work on whole row chunks with two fp32
  chunk buffers: shift by the row max, ATen's fused softmax, in-place products and row sums, a
  handful of passes per chunk and no [N, V] temporary; a -inf logit (p = 0) contributes 0, not
  0 * -inf = NaN. Stats can leave p and p * z for a gradient of the same rows computed right after.
  Row chunks follow the device's budget (``_backend.chunk_budget_bytes``), and off the CPU nothing
  reads a tensor value into Python, so a chunk loop never waits for the device (see ``_backend.py``).
* This module: the dispatch between them (input checks in ``_checks.py``), and
  :class:`LogprobEntropyFunction` / :func:`logprob_entropy`, the differentiable public op.

The internal functions :func:`logprob_entropy_stats` and :func:`logprob_entropy_grad` are shared
with ``fused_linear.py`` and ``policy_loss.py``; their ``backend`` argument is already resolved.
The reference math is ``fastrlhf.algorithms.logprobs_from_logits`` / ``entropy_from_logits``.
"""

from __future__ import annotations

import torch

from fastrlhf.algorithms import _check_temperature

from ._backend import resolve_backend
from ._checks import _check_chunk_buffers, _check_labels_in_range, _check_logits_labels, _check_row_vector

# _chunk_rows and _row_chunks are not used here: policy_loss.py imports them from this module.
from .logprob_entropy_torch import _chunk_rows, _row_chunks, _torch_grad, _torch_stats  # noqa: F401
from .logprob_entropy_triton import _triton_grad, _triton_stats, default_block_v, triton_kernels

__all__ = [
    "LogprobEntropyFunction",
    "blockwise_grad",
    "blockwise_stats",
    "default_block_v",
    "logprob_entropy",
    "logprob_entropy_grad",
    "logprob_entropy_stats",
    "row_blocks",
    "triton_kernels",
]

# ----------------------------------------------------------------------------------------------
# Internal contract (shared with fused_linear.py and policy_loss.py)
# ----------------------------------------------------------------------------------------------


def logprob_entropy_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    backend: str = "torch",
    block_v: int | None = None,
    *,
    shift_out: torch.Tensor | None = None,
    probs_out: torch.Tensor | None = None,
    pz_out: torch.Tensor | None = None,
    check_labels: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy, lse)`` of softmax(logits / T) per row, three fp32 ``[N]`` tensors; no autograd.

    ``lse`` is logsumexp(logits / T). ``block_v`` overrides the Triton block width (tests).

    ``shift_out`` (fp32 ``[N]``): receives a per-row shift (the torch path: the row max of
    logits / T; Triton: 0), and the returned lse is then relative to it, which keeps log p =
    (logits / T - shift) - lse exact on near-deterministic rows; pass the same ``shift`` to
    :func:`logprob_entropy_grad`. ``probs_out`` and ``pz_out`` (torch backend, together; fp32
    ``[N, V]``): receive the probabilities p and the products p * (logits / T - row max), for a
    :func:`logprob_entropy_grad` of the same rows right after (``probs=`` / ``pz=``) that then
    recomputes nothing. ``pz_out`` may be ``logits`` itself when they are fp32 and T == 1 (they
    are overwritten); without these two the torch path uses two chunk buffers of its own.

    ``check_labels=False``: the caller already ran the label range check over all its labels
    (once per call, not once per chunk: off the CPU each check is a few kernel launches).
    """
    _check_temperature(temperature)
    _check_logits_labels(logits, labels)
    if check_labels:
        _check_labels_in_range(labels, logits.shape[1])
    _check_row_vector("shift_out", shift_out, logits.shape[0], out=True)
    _check_chunk_buffers(("probs_out", "pz_out"), probs_out, pz_out, logits, backend)
    labels = labels.long()
    with torch.no_grad():
        if backend == "triton":
            if shift_out is not None:
                shift_out.zero_()
            return _triton_stats(logits, labels, temperature, block_v)
        if backend == "torch":
            return _torch_stats(logits, labels, temperature, shift_out, probs_out, pz_out)
    raise ValueError(f"backend must be 'triton' or 'torch' (already resolved), got {backend!r}")


def logprob_entropy_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float = 1.0,
    backend: str = "torch",
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    *,
    shift: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    pz: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dlogits`` for upstream gradients of the per-row logprob and entropy (None means zero).

    ``dlogits_j = (1/T) * [g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)]``. ``out`` may
    be ``logits`` itself (each row block is read before it is overwritten) or any ``[N, V]``
    tensor; by default a new tensor of logits' dtype. Finite where logits are -inf (p = 0 there).

    ``shift``: the ``shift_out`` of :func:`logprob_entropy_stats` when ``lse`` is the one it
    returned relative to it. ``probs`` / ``pz`` (torch backend, together): the ``probs_out`` /
    ``pz_out`` that stats just filled for these rows and temperature, reused (and overwritten when
    ``out`` is one of them or logits' dtype is not fp32) instead of recomputing the softmax.
    ``probs`` alone: an fp32 ``[N, V]`` buffer the probabilities are recomputed into, so that a
    caller looping over chunks does not pay for a fresh buffer (and its page faults) per call.
    """
    _check_temperature(temperature)
    _check_logits_labels(logits, labels)
    n, v = logits.shape
    labels = labels.long()
    lse = _check_row_vector("lse", lse, n)
    entropy = _check_row_vector("entropy", entropy, n)
    grad_logprobs = _check_row_vector("grad_logprobs", grad_logprobs, n)
    grad_entropy = _check_row_vector("grad_entropy", grad_entropy, n)
    shift = _check_row_vector("shift", shift, n)
    _check_chunk_buffers(("probs", "pz"), probs, pz, logits, backend, first_alone=True)
    if out is None:
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    elif out.shape != logits.shape or (n and out.stride(1) != 1):
        raise ValueError(
            f"out must have logits' shape {tuple(logits.shape)} and be contiguous along the vocabulary, "
            f"got shape {tuple(out.shape)} strides {out.stride()}"
        )
    with torch.no_grad():
        if grad_logprobs is None and grad_entropy is None:
            return out.zero_()
        if backend == "triton":
            if shift is not None:
                lse = lse + shift
            return _triton_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, temperature, out, block_v)
        if backend == "torch":
            return _torch_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, temperature, out,
                               shift, probs, pz)
    raise ValueError(f"backend must be 'triton' or 'torch' (already resolved), got {backend!r}")


# ----------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------


def row_blocks(logits: torch.Tensor, labels: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Split ``[..., V]`` logits / ``[...]`` labels into ``(token_offset, [rows, V], [rows])`` blocks.

    Every block is a view (no copy) whose rows share one stride: a single block when the leading
    dimensions flatten to a view (``[N, V]``, a contiguous ``[B, T, V]``), otherwise one block per
    sequence of a ``[B, T, V]`` slice such as ``logits[:, :-1]`` (which no [N, V] view can hold, and
    a copy would be one more [N, V] tensor). Offsets index the flattened tokens (B-major).
    """
    if logits.dim() < 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"shape mismatch: logits has shape {tuple(logits.shape)} (expected labels shape + [V]) "
            f"but labels has shape {tuple(labels.shape)}"
        )
    v = logits.shape[-1]
    if v == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension, got V = 0")
    if logits.numel() and logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernels need unit stride along the vocabulary
    flat_labels = labels.reshape(-1)
    try:
        return [(0, logits.view(-1, v), flat_labels)]
    except RuntimeError:
        pass
    if logits.dim() == 3:
        t = logits.shape[1]
        return [(b * t, logits[b], flat_labels[b * t : (b + 1) * t]) for b in range(logits.shape[0])]
    return [(0, logits.reshape(-1, v), flat_labels)]


def blockwise_stats(blocks, temperature: float, backend: str,
                    check_labels: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`logprob_entropy_stats` of each :func:`row_blocks` block, joined into ``[N]`` tensors."""
    parts = [
        logprob_entropy_stats(block, block_labels, temperature, backend, check_labels=check_labels)
        for _, block, block_labels in blocks
    ]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(columns) for columns in zip(*parts, strict=True))


def _slice(t: torch.Tensor | None, start: int, rows: int) -> torch.Tensor | None:
    return None if t is None else t[start : start + rows]


def blockwise_grad(logits, blocks, lse, entropy, grad_logprobs, grad_entropy, temperature, backend):
    """dlogits of ``logits`` (a new contiguous tensor of its shape), written block by block."""
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat_out = dlogits.view(-1, logits.shape[-1])
    for start, block, block_labels in blocks:
        rows = block.shape[0]
        logprob_entropy_grad(
            block, block_labels, lse[start : start + rows], entropy[start : start + rows],
            _slice(grad_logprobs, start, rows), _slice(grad_entropy, start, rows), temperature, backend,
            out=flat_out[start : start + rows],
        )
    return dlogits


class LogprobEntropyFunction(torch.autograd.Function):
    """Autograd wrapper: forward saves logits and per-row (lse, entropy); backward writes dlogits."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, backend):
        _check_labels_in_range(labels, logits.shape[-1])  # once, not per block
        logprobs, entropy, lse = blockwise_stats(row_blocks(logits, labels), temperature, backend, check_labels=False)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature = temperature
        ctx.backend = backend
        # An output nobody differentiates arrives as None (not zeros) and its term is skipped.
        ctx.set_materialize_grads(False)
        return logprobs.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None
        dlogits = blockwise_grad(
            logits, row_blocks(logits, labels), lse, entropy,
            None if grad_logprobs is None else grad_logprobs.reshape(-1),
            None if grad_entropy is None else grad_entropy.reshape(-1),
            ctx.temperature, ctx.backend,
        )
        return dlogits, None, None, None


def logprob_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(logprobs, entropy)`` of softmax(logits / T) in fp32, differentiable in ``logits``.

    logits ``[N, V]`` or ``[B, T, V]`` (fp32/bf16/fp16; a strided slice such as ``logits[:, :-1]``
    is read in place), labels the matching ``[N]`` / ``[B, T]`` in [0, V). Equal to
    ``logprobs_from_logits`` and ``entropy_from_logits`` of ``fastrlhf.algorithms``, but holds no
    [N, V] tensor beyond the logits and, in backward, their gradient.
    """
    backend = resolve_backend(backend, logits)
    row_blocks(logits, labels)  # shape errors now, not inside autograd
    return LogprobEntropyFunction.apply(logits, labels, temperature, backend)
