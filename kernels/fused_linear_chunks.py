"""What one chunk of a fused-linear op holds (``fused_linear.py``): the softmax buffers a chunk reuses, the
LM head's gradient accumulators, the chunk's logits GEMM, and the iteration over chunks (skipping chunks
with no kept token). No autograd here: ``fused_linear.py`` builds its functions from these.
"""

from __future__ import annotations

import torch

from ._backend import on_cpu


class _SoftmaxBuffers:
    """The torch path's fp32 chunk buffers, allocated once per call and lent to the shared primitives.

    ``logprob_entropy_stats`` fills them (``probs_out`` / ``pz_out``: p and p * (logits / T - max))
    and ``logprob_entropy_grad`` reuses them (``probs`` / ``pz``) when it runs right after on the
    same chunk (the policy loss). The products overwrite the chunk's own logits when those are
    fp32 and T == 1, so then only the probabilities take a buffer. Other backends need none.
    """

    def __init__(self, backend, rows, vocab, dtype, device, temperature, with_products=True):
        """``with_products=False``: no stats will run (a recompute-only backward), so no buffer for p * z."""
        self.probs = self.pz = None
        self.enabled = backend == "torch"
        if self.enabled:
            self.probs = torch.empty(rows, vocab, dtype=torch.float32, device=device)
            if with_products and (dtype != torch.float32 or temperature != 1.0):
                self.pz = torch.empty_like(self.probs)

    def stats_kwargs(self, logits):
        if not self.enabled:
            return {}
        n = logits.shape[0]
        return dict(probs_out=self.probs[:n], pz_out=logits if self.pz is None else self.pz[:n])

    def grad_kwargs(self, logits, after_stats):
        """``after_stats``: right after ``stats`` of the same chunk (with ``stats_kwargs`` of these
        logits), whose buffers are reused; otherwise the probabilities buffer is lent for the recompute."""
        if not self.enabled:
            return {}
        if not after_stats:
            return dict(probs=self.probs[: logits.shape[0]])
        return {name.removesuffix("_out"): t for name, t in self.stats_kwargs(logits).items()}


class _HeadGrads:
    """Per-chunk GEMMs of the head's backward, accumulated into preallocated buffers."""

    def __init__(self, hidden, weight, bias, need_hidden, need_weight, need_bias):
        self.weight = weight
        self.grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None
        self.grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        # A bf16 GEMM cannot write into an fp32 buffer on every backend: land it in a scratch first.
        self._weight_scratch = (
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            if need_weight and weight.dtype != torch.float32
            else None
        )
        self.grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        self.any = need_hidden or need_weight or need_bias

    def add_chunk(self, start, stop, hidden_chunk, dlogits):
        if self.grad_hidden is not None:
            torch.mm(dlogits, self.weight, out=self.grad_hidden[start:stop])
        if self.grad_weight is not None:
            if self._weight_scratch is None:
                self.grad_weight.addmm_(dlogits.t(), hidden_chunk)
            else:
                self.grad_weight.add_(torch.mm(dlogits.t(), hidden_chunk, out=self._weight_scratch))
        if self.grad_bias is not None:
            self.grad_bias.add_(dlogits.sum(0, dtype=torch.float32))

    def finish(self, hidden_dtype, weight_dtype):
        """Drop scratch, cast the fp32 accumulators to the input dtypes; returns (hidden, weight, bias) grads."""
        self._weight_scratch = None
        grad_weight = self.grad_weight
        if grad_weight is not None and grad_weight.dtype != weight_dtype:
            grad_weight = grad_weight.to(weight_dtype)
        grad_bias = self.grad_bias
        if grad_bias is not None and grad_bias.dtype != weight_dtype:
            grad_bias = grad_bias.to(weight_dtype)
        return self.grad_hidden, grad_weight, grad_bias


def _logits_into(buf, hidden_chunk, weight, bias):
    if bias is None:
        return torch.mm(hidden_chunk, weight.t(), out=buf)
    return torch.addmm(bias, hidden_chunk, weight.t(), out=buf)


def _chunks(n, chunk_size):
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


def _chunks_with_kept_tokens(weights, chunk_size):
    """Per chunk, whether any token in it is kept (weight > 0), so the loop can skip the others.

    CPU only (one host read up front instead of one per chunk); elsewhere reading it would stall
    the host on the device, so every chunk counts as kept: a masked one adds zero loss and gradient.
    """
    n = weights.shape[0]
    n_chunks = -(-n // chunk_size)
    if not on_cpu(weights):
        return [True] * n_chunks
    kept = torch.zeros(n_chunks * chunk_size, dtype=torch.bool, device=weights.device)
    kept[:n] = weights > 0
    return kept.view(n_chunks, chunk_size).any(1).tolist()
