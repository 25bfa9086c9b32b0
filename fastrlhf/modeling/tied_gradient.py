"""One ``[V, H]`` gradient for a tied input embedding and LM head, instead of two.

Autograd gives a weight used twice two gradients and sums them: the LM head's dense ``[V, H]`` one
and the input embedding's, which ``embedding_dense_backward`` builds as a second ``[V, H]`` tensor
(zeros, plus the looked-up rows). The fused loss computes the head's gradient in its forward, so it
is held through the whole backward, and at the embedding both are alive beside the optimizer's
gradient buffer (Qwen2's 151,936 x 256 in fp32: 2 x 148 MiB).

:func:`tied_gradient_handoff` routes the head's gradient to the embedding instead: the head takes the
weight through an identity whose backward hands the gradient over and gives autograd nothing, and
the embedding's backward adds its rows into that tensor in place and returns it as the
weight's only gradient. The sum is the same; repeated rows are summed in another order than
``embedding_dense_backward``'s, so the two agree to rounding, not bitwise. As there, each row's lookups
are summed in fp32 and rounded once into a bf16 gradient (:func:`_add_rows`).

Only for a weight that the embedding and the head share and that is trained as an ordinary tensor:
not for a frozen one (LoRA), nor for a ZeRO-3 partitioned one (whose hooks gather and release it per
module), where the context does nothing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["tied_gradient_handoff"]

# Devices whose index_add_ sums a low-precision tensor's repeated rows in fp32 (see _add_rows)
INDEX_ADD_SUMS_IN_FP32 = ("cpu",)


class _Handoff:
    """The head's gradient on its way to the embedding's backward of the same graph."""

    __slots__ = ("armed", "closed", "grad")

    def __init__(self):
        self.armed = False  # an embedding lookup of this context will take the gradient
        self.closed = False  # an embedding's backward has run: later head gradients go the usual way
        self.grad = None


class _HeadWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, handoff):
        ctx.handoff = handoff
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        handoff = ctx.handoff
        if not handoff.armed or handoff.closed:  # no embedding backward is left to take it
            return grad, None
        handoff.grad = grad if handoff.grad is None else handoff.grad + grad
        return None, None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx, handoff):
        ctx.save_for_backward(ids)
        ctx.handoff, ctx.padding_idx = handoff, padding_idx
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        handoff = ctx.handoff
        grad, handoff.grad, handoff.closed = handoff.grad, None, True
        if grad is None:  # the head's backward did not run (its output was unused)
            grad = grad_out.new_zeros(ctx.weight_shape, dtype=ctx.weight_dtype)
        rows = ids.reshape(-1)
        grad_rows = grad_out.reshape(-1, grad.shape[1]).to(grad.dtype)
        if ctx.padding_idx is not None:
            # As nn.Embedding: the padding row gets no gradient from the lookup (a mask, not boolean
            # indexing, which would wait for the device to count the kept rows).
            grad_rows = grad_rows.masked_fill((rows == ctx.padding_idx).unsqueeze(1), 0)
        _add_rows(grad, rows, grad_rows)
        return None, grad, None, None


def _add_rows(grad: torch.Tensor, rows: torch.Tensor, grad_rows: torch.Tensor) -> None:
    """``grad[rows[i]] += grad_rows[i]``, each row's lookups summed in fp32 and rounded to ``grad``'s dtype once, as
    ``embedding_dense_backward`` sums them. On CUDA ``index_add_`` adds with atomics in the tensor's dtype: in bf16
    every lookup of a row rounds (3,500 lookups of one token, those roundings simulated on a CPU: a sixth of the
    row lost); ``index_put_``'s accumulate sorts the rows and sums each run in fp32, deterministically. On a CPU
    it is the other way round: ``index_add_`` sums in fp32, ``index_put_`` rounds per lookup. ``unsafe``: no range
    check of the rows (the forward's lookup made it), which in some torch versions reads their min and max on the
    host, as autograd's own backward of indexing calls it."""
    if grad.device.type in INDEX_ADD_SUMS_IN_FP32:
        grad.index_add_(0, rows, grad_rows)
    else:
        torch._index_put_impl_(grad, (rows,), grad_rows, accumulate=True, unsafe=True)


def _shared_trained_weight(embedding, head) -> torch.Tensor | None:
    weight = getattr(head, "weight", None)
    if (not isinstance(embedding, torch.nn.Embedding) or weight is None or embedding.weight is not weight
            or not weight.requires_grad or hasattr(weight, "ds_tensor")):
        return None
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return None  # lookups that renormalise or scale rows, or want a sparse gradient: left to nn.Embedding
    return weight


@contextlib.contextmanager
def tied_gradient_handoff(embedding: torch.nn.Module, head: torch.nn.Module):
    """Within the context, ``embedding(ids)`` and the yielded ``head_weight()`` (the head's weight as
    the head's computation should take it) send the tied weight ONE gradient: the head's, with the
    embedding's rows added in place. Yields ``head_weight``, a function returning ``head.weight``
    itself where the weight is not tied and trained (nothing else changes then).

    Forward passes only inside; their backward may run after the context has closed.
    """
    weight = _shared_trained_weight(embedding, head)
    if weight is None:
        yield lambda: head.weight
        return
    handoff = _Handoff()

    def lookup(ids):
        if torch.is_grad_enabled():
            handoff.armed = True
        return _Embedding.apply(ids, embedding.weight, embedding.padding_idx, handoff)

    def head_weight():
        return _HeadWeight.apply(head.weight, handoff) if torch.is_grad_enabled() else head.weight

    embedding.forward = lookup
    try:
        yield head_weight
    finally:
        del embedding.forward
