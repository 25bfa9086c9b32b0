"""Per-token log-probability and entropy of softmax(logits / T), without an extra [N, V] tensor.

Three layers, as in Liger-Kernel's ops:

* Triton kernels (built lazily by :func:`triton_kernels`, so importing this module never imports
  triton): ``stats`` makes one pass over each row's vocabulary keeping an online max, sum of
  exponentials and entropy accumulator, and writes three fp32 numbers per row; ``grad`` recomputes
  the softmax block by block and writes ``dlogits`` directly.
* A torch path (the CPU implementation, also used per chunk by ``fused_linear.py`` and
  ``policy_loss.py``) doing the same work on whole row chunks with two fp32 chunk buffers: shift
  by the row max, ATen's fused softmax, in-place products and row sums, a handful of passes per
  chunk and no [N, V] temporary; a -inf logit (p = 0) contributes 0, not 0 * -inf = NaN. Stats
  can leave p and p * z for a gradient of the same rows computed right after. Row chunks follow
  the device's budget (``_backend.chunk_budget_bytes``), and off the CPU nothing reads a tensor
  value into Python, so a chunk loop never waits for the device (see ``_backend.py``).
* :class:`LogprobEntropyFunction` / :func:`logprob_entropy`, the differentiable public op.

The internal functions :func:`logprob_entropy_stats` and :func:`logprob_entropy_grad` are shared
with ``fused_linear.py`` and ``policy_loss.py``; their ``backend`` argument is already resolved.
The reference math is ``fastrlhf.algorithms.logprobs_from_logits`` / ``entropy_from_logits``.
"""

from __future__ import annotations

import functools
import types

import torch

from fastrlhf.algorithms import _check_temperature

from ._backend import chunk_budget_bytes, interpreter_enabled, on_cpu, resolve_backend

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

# A log-probability below this has exp() == 0 in fp32 (the smallest subnormal is e^-103.3), so
# clamping there changes no probability, yet keeps p * log p and g * log p finite where a logit is
# -inf (0 * -inf would be NaN).
_LOGP_FLOOR = -1000.0

# Widest vocabulary block one Triton program loads at once. On a GPU wider blocks spill registers;
# under the interpreter the cost is per loop iteration, nearly independent of width, so one block
# per row is fastest. Tests lower these (or pass block_v) to exercise the multi-block loop.
MAX_BLOCK_V_GPU = 4096
MAX_BLOCK_V_INTERPRETER = 1 << 16

# Torch-path chunking on the CPU: row chunks whose fp32 [rows, V] buffers hold TORCH_CHUNK_ELEMENTS
# (64 MiB; the whole input when smaller). Every op is an OpenMP parallel region, and on a busy
# machine each region's barrier costs milliseconds, so few large chunks win (2 threads on 2 busy
# cores, N=4096 V=32768: about 3x faster at 64 MiB chunks than at 4 MiB; single-threaded, chunk
# size barely matters). It equals fused_linear's CPU chunk, so one of its chunks is one chunk here.
# Other devices use their own budget, _backend.chunk_budget_bytes (see _chunk_rows).
TORCH_CHUNK_ELEMENTS = 1 << 24


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_block_v(vocab_size: int, on_gpu: bool | None = None) -> int:
    """BLOCK_V for a vocabulary: next power of two of V, capped (lower on GPU than in the interpreter)."""
    if on_gpu is None:
        on_gpu = not interpreter_enabled()
    cap = MAX_BLOCK_V_GPU if on_gpu else MAX_BLOCK_V_INTERPRETER
    return max(16, min(_next_power_of_2(vocab_size), cap))


def _num_warps(block_v: int) -> int:
    return 16 if block_v >= 8192 else 8 if block_v >= 2048 else 4


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@functools.cache
def triton_kernels():
    """Build the Triton kernels on first use; returns a namespace with ``stats`` and ``grad``.

    Whether ``triton.jit`` makes an interpreted or a compiled kernel is fixed when the kernel is
    defined, from TRITON_INTERPRET at that moment.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _logprob_entropy_stats_kernel(
        logits_ptr,
        stride_row,
        labels_ptr,
        logprobs_ptr,
        entropy_ptr,
        lse_ptr,
        V,
        inv_temperature,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK_V)
        # Online softmax statistics of z = logits / T, relative to the running max m:
        # s = sum exp(z - m), a = sum exp(z - m) * (z - m); then H = log s - a / s.
        # m starts finite so that z - m never meets -inf - -inf.
        m = tl.full((), -3.0e38, tl.float32)
        s = tl.zeros((), tl.float32)
        a = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            valid = idx < V
            z = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
            m_new = tl.maximum(m, tl.max(z, axis=0))
            shift = m - m_new
            scale = tl.exp(shift)
            d = tl.maximum(z - m_new, -1000.0)  # _LOGP_FLOOR
            e = tl.exp(d)
            a = scale * (a + s * shift) + tl.sum(e * d, axis=0)
            s = s * scale + tl.sum(e, axis=0)
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        label = tl.load(labels_ptr + row)
        z_label = tl.load(row_ptr + label).to(tl.float32) * inv_temperature
        tl.store(logprobs_ptr + row, z_label - lse)
        tl.store(entropy_ptr + row, log_s - a / s)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _logprob_entropy_grad_kernel(
        logits_ptr,
        stride_row,
        labels_ptr,
        lse_ptr,
        entropy_ptr,
        grad_logprobs_ptr,
        grad_entropy_ptr,
        out_ptr,
        stride_out_row,
        V,
        inv_temperature,
        HAS_GRAD_LOGPROBS: tl.constexpr,
        HAS_GRAD_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # dlogits_j = (1/T) * [g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + H)]
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        out_row_ptr = out_ptr + row * stride_out_row
        cols = tl.arange(0, BLOCK_V)
        lse = tl.load(lse_ptr + row)
        label = tl.load(labels_ptr + row)
        if HAS_GRAD_LOGPROBS:
            g_lp = tl.load(grad_logprobs_ptr + row).to(tl.float32)
        else:
            g_lp = tl.zeros((), tl.float32)
        if HAS_GRAD_ENTROPY:
            g_ent = tl.load(grad_entropy_ptr + row).to(tl.float32)
            h = tl.load(entropy_ptr + row)
        else:
            g_ent = tl.zeros((), tl.float32)
            h = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            valid = idx < V
            z = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_temperature
            logp = tl.maximum(z - lse, -1000.0)  # _LOGP_FLOOR
            p = tl.exp(logp)
            coef = g_lp + g_ent * (logp + h)
            d = tl.where(idx == label, g_lp, 0.0) - p * coef
            d = d * inv_temperature
            # (The interpreter truncates fp32 -> bf16 here; GPUs round to nearest even.)
            tl.store(out_row_ptr + idx, d.to(out_ptr.dtype.element_ty), mask=valid)

    return types.SimpleNamespace(stats=_logprob_entropy_stats_kernel, grad=_logprob_entropy_grad_kernel)


def _triton_stats(logits, labels, temperature, block_v):
    n, v = logits.shape
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    if n:
        block = block_v or default_block_v(v, on_gpu=logits.is_cuda)
        triton_kernels().stats[(n,)](
            logits, logits.stride(0), labels, logprobs, entropy, lse, v, 1.0 / temperature,
            BLOCK_V=block, num_warps=_num_warps(block),
        )
    return logprobs, entropy, lse


def _triton_grad(logits, labels, lse, entropy, grad_logprobs, grad_entropy, temperature, out, block_v):
    n, v = logits.shape
    if n:
        block = block_v or default_block_v(v, on_gpu=logits.is_cuda)
        # An absent gradient is a constexpr switch; the pointer passed for it is never read.
        triton_kernels().grad[(n,)](
            logits, logits.stride(0), labels, lse, entropy,
            grad_logprobs if grad_logprobs is not None else lse,
            grad_entropy if grad_entropy is not None else lse,
            out, out.stride(0), v, 1.0 / temperature,
            HAS_GRAD_LOGPROBS=grad_logprobs is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
            BLOCK_V=block, num_warps=_num_warps(block),
        )
    return out


# ----------------------------------------------------------------------------------------------
# torch path
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Internal contract (shared with fused_linear.py and policy_loss.py)
# ----------------------------------------------------------------------------------------------


def _check_logits_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(
            f"shape mismatch: logits has shape {tuple(logits.shape)} (expected labels shape + [V]) "
            f"but labels has shape {tuple(labels.shape)}"
        )
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.shape[0] and logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous along the vocabulary, got strides {logits.stride()}")
    _check_label_dtype(labels)


def _check_label_dtype(labels: torch.Tensor) -> None:
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be an integer tensor (int64 or int32), got {labels.dtype}")


def _check_labels_in_range(labels: torch.Tensor, vocab_size: int, vocab_name: str = "the vocabulary size") -> None:
    """Labels in [0, V): a clear ValueError on the CPU; elsewhere a device-side assert, which
    needs no host sync (an out-of-range label would otherwise index out of bounds; on meta the
    assert is a no-op)."""
    _check_label_dtype(labels)
    if labels.numel() == 0:
        return

    def message(found: str = "") -> str:
        return (f"labels must lie in [0, {vocab_size}) ({vocab_name}){found}; "
                "ignore indices such as -100 are not supported: mask those tokens instead")

    if not on_cpu(labels):
        torch._assert_async(((labels >= 0) & (labels < vocab_size)).all(), message())
        return
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(message(f", found {lo if lo < 0 else hi}"))


def _check_row_vector(name: str, t: torch.Tensor | None, n: int, out: bool = False) -> torch.Tensor | None:
    if t is None:
        return None
    if t.shape != (n,) or (out and t.dtype != torch.float32):
        kind = "a float32 tensor of shape" if out else "shape"
        raise ValueError(f"{name} must have {kind} ({n},) (one value per logits row), got {t.dtype} {tuple(t.shape)}")
    return t if out else t.float().contiguous()


def _check_chunk_buffers(names, first, second, logits, backend, first_alone=False):
    """``probs_out`` / ``pz_out`` (or ``probs`` / ``pz``): fp32 ``[N, V]``, torch backend only; the
    second needs the first, and the first needs the second unless ``first_alone``."""
    if first is None and second is None:
        return
    if first is None:
        raise ValueError(f"{names[1]} needs {names[0]}: pass both or neither")
    if second is None and not first_alone:
        raise ValueError(f"{names[0]} needs {names[1]}: pass both or neither")
    if backend != "torch":
        raise ValueError(f"{names[0]} / {names[1]} are for backend='torch' only, got {backend!r}")
    for name, t in zip(names, (first, second), strict=True):
        if t is None:
            continue
        if t.shape != logits.shape or t.dtype != torch.float32 or (t.shape[0] and t.stride(1) != 1):
            raise ValueError(
                f"{name} must be a float32 tensor of logits' shape {tuple(logits.shape)}, contiguous along the "
                f"vocabulary, got dtype {t.dtype} shape {tuple(t.shape)} strides {t.stride()}"
            )


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

