"""The torch path of :func:`~fastrlhf.kernels.logprob_entropy.logprob_entropy` (the CPU implementation).

Also used per chunk by ``fused_linear.py`` and ``policy_loss.py`` (through the dispatch functions
of ``logprob_entropy.py``). It does the work of the Triton kernels on whole row chunks with two
fp32 chunk buffers: shift by the row max, ATen's fused softmax, in-place products and row sums, a
handful of passes per chunk and no [N, V] temporary; a -inf logit (p = 0) contributes 0, not
0 * -inf = NaN. Stats can leave p and p * z for a gradient of the same rows computed right after.
Row chunks follow the device's budget (``_backend.chunk_budget_bytes``), and off the CPU nothing
reads a tensor value into Python, so a chunk loop never waits for the device (see ``_backend.py``).
"""

from __future__ import annotations

import torch

from ._backend import chunk_budget_bytes, on_cpu

# A log-probability below this has exp() == 0 in fp32 (the smallest subnormal is e^-103.3), so
# clamping there changes no probability, yet keeps p * log p and g * log p finite where a logit is
# -inf (0 * -inf would be NaN).
_LOGP_FLOOR = -1000.0

# Torch-path chunking on the CPU: row chunks whose fp32 [rows, V] buffers hold TORCH_CHUNK_ELEMENTS
# (64 MiB; the whole input when smaller). Every op is an OpenMP parallel region, and on a busy
# machine each region's barrier costs milliseconds, so few large chunks win (2 threads on 2 busy
# cores, N=4096 V=32768: about 3x faster at 64 MiB chunks than at 4 MiB; single-threaded, chunk
# size barely matters). It equals fused_linear's CPU chunk, so one of its chunks is one chunk here.
# Other devices use their own budget, _backend.chunk_budget_bytes (see _chunk_rows).
TORCH_CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(n_rows: int, vocab_size: int, device: torch.device | None = None, lent: bool = False) -> int:
    """Rows per torch-path chunk whose fp32 [rows, V] buffers fit the device's budget (None: the CPU).

    ``lent``: the caller lends [n_rows, V] buffers, sized by its own chunk budget. On an
    accelerator they are then used whole: splitting them again would only multiply kernel launches
    (and a free-memory query made now, after the caller's allocations, would split them).
    """
    if on_cpu(device):
        elements = TORCH_CHUNK_ELEMENTS
    elif lent:
        return max(1, n_rows)
    else:
        elements = chunk_budget_bytes(device) // 4
    return max(1, min(elements // vocab_size, n_rows))


def _scaled_into(buf: torch.Tensor, logits_chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    # Upcast first (bf16 / T would round in bf16), and divide rather than multiply by 1/T so
    # values match the reference's logits.float() / T bit for bit.
    if logits_chunk.dtype == torch.float32:
        return torch.div(logits_chunk, temperature, out=buf)
    buf.copy_(logits_chunk)
    return buf if temperature == 1.0 else buf.div_(temperature)


def _shifted_into(buf, logits, temperature, shift=None):
    """``z = logits / T - shift`` in fp32, written into ``buf`` (which may be ``logits`` itself).

    ``shift`` ([k, 1]) defaults to the row max of logits / T. Returns ``(z, shift, argmax)``,
    argmax None when ``shift`` was given.
    """
    scaled = logits if logits.dtype == torch.float32 and temperature == 1.0 else _scaled_into(buf, logits, temperature)
    top = None
    if shift is None:
        shift, top = scaled.max(-1, keepdim=True)
    return torch.sub(scaled, shift, out=buf), shift, top


def _row_chunks(n, rows):
    for start in range(0, n, rows):
        yield slice(start, min(start + rows, n))


def _chunk_buffer(given, rows, n, v, device):
    # A caller's [N, V] fp32 buffer, or one reused [chunk rows, V] scratch.
    return given if given is not None else torch.empty(min(rows, n), v, dtype=torch.float32, device=device)


def _products_and_dot(z, p, host_reads):
    """``p * z`` (in place of z) and its row sums, where a -inf logit (p == 0, z == -inf) adds 0, not NaN.

    ``host_reads`` (CPU): multiply as is and repair only the rare chunk whose sums are not
    finite, a check that costs one host read per chunk. Elsewhere branch-free: z floored at
    _LOGP_FLOOR first, which changes no product (exp(z) is already 0 there, so p is 0).
    """
    if not host_reads:
        pz = z.clamp_(min=_LOGP_FLOOR).mul_(p)
        return pz, pz.sum(-1)
    pz = z.mul_(p)
    dot = pz.sum(-1)
    if not bool(torch.isfinite(dot).all()):
        dot = pz.masked_fill_(p == 0, 0.0).sum(-1)
    return pz, dot


def _torch_stats(logits, labels, temperature, shift_out=None, probs_out=None, pz_out=None):
    """Whole-chunk statistics with z = logits / T - max (per row, so z <= 0 and the max is 0):
    ``p = softmax(z)``, ``lse - max = -log p[argmax]`` (p[argmax] >= 1/V: exact to an ulp),
    ``logprob = z[label] - (lse - max)`` and ``H = (lse - max) - sum(p * z)`` (every term <= 0,
    so no cancellation; ATen's pairwise row sum, as BLAS dot products lose ~1e-4 at V = 152k).

    ``probs_out`` receives p and ``pz_out`` the products p * z, for a :func:`_torch_grad` of the
    same rows; ``pz_out`` may be ``logits`` itself (fp32, T == 1), which is then overwritten.
    Otherwise two reused chunk buffers hold them. With ``shift_out`` the row max is written there
    and the returned lse is relative to it.
    """
    n, v = logits.shape
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    rows = _chunk_rows(n, v, logits.device, lent=probs_out is not None)
    z_buf = _chunk_buffer(pz_out, rows, n, v, logits.device)
    p_buf = _chunk_buffer(probs_out, rows, n, v, logits.device)
    host_reads = on_cpu(logits)
    for sl in _row_chunks(n, rows):
        buf_sl = sl if pz_out is not None else slice(0, sl.stop - sl.start)
        z, shift, top = _shifted_into(z_buf[buf_sl], logits[sl], temperature)
        p = torch._softmax(z, -1, False, out=p_buf[sl if probs_out is not None else buf_sl])
        z_label = z.gather(1, labels[sl].unsqueeze(1)).squeeze(1)
        lse_shifted = p.gather(1, top).log_().neg_().squeeze(1)
        _, dot = _products_and_dot(z, p, host_reads)
        logprobs[sl] = z_label - lse_shifted
        entropy[sl] = lse_shifted - dot
        shift = shift.squeeze(1)
        if shift_out is not None:
            shift_out[sl] = shift
            lse[sl] = lse_shifted
        else:
            lse[sl] = lse_shifted + shift
    return logprobs, entropy, lse


def _torch_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, temperature, out,
                shift=None, probs=None, pz=None):
    """``dlogits = a * p + b * (p * z) + (g_lp / T) * onehot`` per row, with
    ``a = -(g_lp + g_ent * (H - lse')) / T`` and ``b = -g_ent / T`` (the contract's formula with
    log p = z - lse', z = logits / T - shift and lse' = lse - shift; without ``shift`` it is lse,
    so z = log p). ``probs`` and ``pz`` from :func:`_torch_stats` of the same rows are reused;
    otherwise p (into ``probs`` when given alone) and p * z are recomputed, z floored at
    _LOGP_FLOOR so that p * z is 0 (not NaN) where a logit is -inf.
    """
    n, v = logits.shape
    inv_t = 1.0 / temperature
    if shift is None:
        shift, lse = lse, torch.zeros_like(lse)
    write_direct = out.dtype == torch.float32
    reuse = pz is not None
    rows = _chunk_rows(n, v, logits.device, lent=probs is not None)
    z_buf = out if write_direct else _chunk_buffer(pz, rows, n, v, logits.device)
    p_buf = _chunk_buffer(probs, rows, n, v, logits.device)
    for sl in _row_chunks(n, rows):
        local = slice(0, sl.stop - sl.start)
        target = z_buf[sl if write_direct or reuse else local]
        p = p_buf[sl if probs is not None else local]
        g_lp = grad_logprobs[sl] if grad_logprobs is not None else torch.zeros_like(lse[sl])
        if reuse:
            q = pz[sl]
        else:
            z = _shifted_into(target, logits[sl], temperature, shift[sl].unsqueeze(1))[0]
            torch._softmax(z, -1, False, out=p)
            q = z.clamp_(min=_LOGP_FLOOR).mul_(p) if grad_entropy is not None else None
        if grad_entropy is None:
            torch.mul(p, g_lp.mul(-inv_t).unsqueeze(1), out=target)
        else:
            g_ent = grad_entropy[sl]
            a = (entropy[sl] - lse[sl]).mul_(g_ent).add_(g_lp).mul_(-inv_t)
            torch.mul(q, g_ent.mul(-inv_t).unsqueeze(1), out=target).addcmul_(p, a.unsqueeze(1))
        if grad_logprobs is not None:
            # The one-hot term, added in fp32 before any rounding to out's dtype.
            target.scatter_add_(1, labels[sl].unsqueeze(1), g_lp.mul(inv_t).unsqueeze(1))
        if not write_direct:
            out[sl].copy_(target)
    return out
