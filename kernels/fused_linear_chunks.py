"""What one chunk of a fused-linear op holds (``fused_linear.py``): the softmax buffers a chunk reuses, the
LM head's gradient accumulators, the chunk's logits GEMM, and the iteration over chunks (skipping chunks
with no kept token). No autograd here: ``fused_linear.py`` builds its functions from these.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ._backend import on_cpu


@dataclasses.dataclass
class FusedLinearPaths:
    """The fused-linear ops' faster paths, each on by default where it applies. ``benchmarks/gpu`` turns them off
    (:func:`fused_linear_paths`) to time each one before and after in the same device call.

    ``gemm_fp32_sum``: ``grad_weight`` summed in fp32 by the GEMM itself, with the longer chunks that spares
    (CUDA, bf16/fp16 heads; :func:`accumulates_in_gemm`). ``one_pass_rows``: each chunk's statistics, loss and
    ``dlogits`` in one Triton launch (the vanilla policy loss; ``policy_loss_triton.triton_row_loss_and_grad``)
    instead of the stats, token-loss and gradient launches. ``cast_kernel``: the backward's scale and cast of the
    fp32 sums by the Triton backend's own kernel (``grad_cast_triton.py``) instead of torch's ``mul``.
    ``row_programs_per_sm``: on CUDA, the row kernel that writes ``dlogits`` runs that many programs per SM, each
    looping over rows with larger blocks (:func:`row_programs`); 0 (the default): one program per row. A row is
    read twice (statistics, then gradient): with a program per row about eight run on each SM at once, 1,056 rows
    of the 7B head's 152,064 bf16 logits on an H100 (321 MB), far more than its 50 MB L2, so the second read may
    come from HBM; with one per SM, 132 rows (40 MB) are in flight and the second read can find its row in L2, but
    each SM has one program's loads to hide the memory's latency. Off until a GPU race says which is faster
    (``benchmarks/gpu/lm_head.py``: ``fused_rows_1_per_sm``, ``fused_rows_2_per_sm``)."""

    gemm_fp32_sum: bool = True
    one_pass_rows: bool = True
    cast_kernel: bool = True
    row_programs_per_sm: int = 0


PATHS = FusedLinearPaths()


@contextlib.contextmanager
def fused_linear_paths(**paths: bool):
    """Within the block, :data:`PATHS` with these fields changed (``one_pass_rows=False``: the three launches), each
    to its field's type."""
    names = [f.name for f in dataclasses.fields(PATHS)]
    unknown = sorted(set(paths) - set(names))
    if unknown:
        raise ValueError(f"no fused-linear path {', '.join(map(repr, unknown))}; expected one of {', '.join(names)}")
    saved = dataclasses.replace(PATHS)
    try:
        for name, value in paths.items():
            setattr(PATHS, name, type(getattr(saved, name))(value))
        yield PATHS
    finally:
        for field in dataclasses.fields(PATHS):
            setattr(PATHS, field.name, getattr(saved, field.name))


def row_programs(device: torch.device) -> int | None:
    """The row kernel's grid when it writes ``dlogits``: :attr:`FusedLinearPaths.row_programs_per_sm` programs per
    SM on CUDA (the count is the device's property, read on the host without a sync); None (one program per row)
    when that is 0 or off CUDA."""
    if device.type != "cuda" or PATHS.row_programs_per_sm <= 0:
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count * PATHS.row_programs_per_sm


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


_FP32_OUT_GEMM: dict[tuple[str, torch.dtype], bool] = {}


def fp32_out_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm`` / ``torch.addmm`` take ``dtype`` inputs and write fp32 (``out_dtype=``) on this
    kind of device: cuBLAS accumulates a bf16 GEMM in fp32 anyway, so ``grad_weight``'s fp32 sum over chunks
    then needs no ``[V, H]`` scratch, no zeros pass and no separate add. Asked once per device kind and
    dtype, on two tiny tensors (the CPU kernels have no such GEMM; meta has, so the meta-device tests run
    this branch)."""
    key = (torch.device(device).type, dtype)
    if key not in _FP32_OUT_GEMM:
        a = torch.zeros(2, 2, dtype=dtype, device=device)
        try:
            torch.addmm(torch.mm(a, a, out_dtype=torch.float32), a, a, out_dtype=torch.float32)
            _FP32_OUT_GEMM[key] = True
        except (RuntimeError, NotImplementedError, TypeError):
            _FP32_OUT_GEMM[key] = False
    return _FP32_OUT_GEMM[key]


def mm_fp32_out(a, b, out, accumulate: bool) -> None:
    """``out = a @ b`` (or ``out += a @ b``) with ``a``, ``b`` in bf16/fp16 and ``out`` fp32, in one GEMM. Where
    :func:`fp32_out_gemm` says no (the CPU), the same sums from fp32 copies: the stand-in the CPU tests run
    this branch with (exact products of bf16 values, fp32 accumulation, as cuBLAS)."""
    if fp32_out_gemm(out.device, a.dtype):
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


def accumulates_in_gemm(weight: torch.Tensor) -> bool:
    """Whether ``grad_weight`` of this bf16/fp16 head sums in fp32 inside its GEMMs (:func:`mm_fp32_out`) rather
    than through a scratch of the weight's dtype (unless :data:`PATHS` turns it off). The tests force it on the
    CPU, whose stand-in then runs."""
    return PATHS.gemm_fp32_sum and fp32_out_gemm(weight.device, weight.dtype)


class _HeadGrads:
    """Per-chunk GEMMs of the head's backward, accumulated into preallocated buffers.

    ``grad_weight`` sums in fp32 whatever the weight's dtype. fp32 weights: ``addmm_`` into a zeroed buffer.
    bf16/fp16 where :func:`fp32_out_gemm` holds (CUDA): the first chunk's GEMM writes the fp32 buffer and the
    later ones add into it (:func:`mm_fp32_out`). Elsewhere (the CPU) each chunk's GEMM lands in a scratch of
    the weight's dtype that is added into the zeroed fp32 buffer.
    """

    def __init__(self, hidden, weight, bias, need_hidden, need_weight, need_bias):
        self.weight = weight
        self.grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None
        low_precision = need_weight and weight.dtype != torch.float32
        self._fp32_gemm = low_precision and accumulates_in_gemm(weight)
        self._weight_written = False  # whether a chunk wrote grad_weight yet (fp32_gemm: the first one overwrites)
        alloc = torch.empty if self._fp32_gemm else torch.zeros
        self.grad_weight = alloc(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        self._weight_scratch = (
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            if low_precision and not self._fp32_gemm
            else None
        )
        self.grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        self.any = need_hidden or need_weight or need_bias
        self._dlogits_low: torch.Tensor | None = None  # fp32 logits' gradient in the weight's dtype, for the GEMMs

    def add_chunk(self, start, stop, hidden_chunk, dlogits):
        """The head's gradients of one chunk from its ``dlogits`` (the weight's dtype, or fp32 logits' fp32
        gradient, rounded here once to the weight's dtype for the GEMMs, as the in-place path rounds it)."""
        if self.grad_bias is not None:
            self.grad_bias.add_(dlogits.sum(0, dtype=torch.float32))
        if dlogits.dtype != self.weight.dtype:
            if self._dlogits_low is None:  # the first chunk is the largest
                self._dlogits_low = torch.empty(dlogits.shape, dtype=self.weight.dtype, device=dlogits.device)
            dlogits = self._dlogits_low[: dlogits.shape[0]].copy_(dlogits)
        if self.grad_hidden is not None:
            torch.mm(dlogits, self.weight, out=self.grad_hidden[start:stop])
        if self.grad_weight is not None:
            if self._fp32_gemm:
                mm_fp32_out(dlogits.t(), hidden_chunk, self.grad_weight, accumulate=self._weight_written)
            elif self._weight_scratch is None:
                self.grad_weight.addmm_(dlogits.t(), hidden_chunk)
            else:
                self.grad_weight.add_(torch.mm(dlogits.t(), hidden_chunk, out=self._weight_scratch))
            self._weight_written = True

    def finish(self, hidden_dtype, weight_dtype, cast=True):
        """Drop scratch; returns the (hidden, weight, bias) grads, the fp32 accumulators cast to the weight's
        dtype unless ``cast=False`` (then :func:`scale_and_cast` does it later, with ``grad_output``, in one pass)."""
        self._weight_scratch = self._dlogits_low = None
        if self._fp32_gemm and not self._weight_written:  # no chunk ran (all masked): nothing overwrote it
            self.grad_weight.zero_()
        grad_weight, grad_bias = self.grad_weight, self.grad_bias
        if cast:
            grad_weight, grad_bias = (None if g is None else g.to(weight_dtype) for g in (grad_weight, grad_bias))
        return self.grad_hidden, grad_weight, grad_bias


# Elements of a bf16/fp16 gradient scaled per fp32 temporary by the torch branch (64 MiB of fp32).
SCALE_BLOCK_ELEMENTS = 1 << 24


def scale_and_cast(grad: torch.Tensor | None, grad_output: torch.Tensor | None, dtype: torch.dtype,
                   backend: str = "torch"):
    """``grad * grad_output`` in ``dtype``: one pass over an fp32 accumulator (read fp32, write ``dtype``), or in
    place where ``grad`` already has the dtype. ``grad_output`` None: the cast alone. The Triton backend makes the
    pass with its own vectorized kernel (``grad_cast_triton.py``: torch's casting kernel runs it at about half the
    copy rate on an H100); the products are the same. Each product is taken in fp32 and rounded once, as autograd's
    would be: a bf16 ``grad`` scaled by ``grad_output`` rounded to bf16 first would be off by up to 2^-9 of it
    (``loss / 3``), and an fp16 one by a loss scale of 65,536 would be inf."""
    if grad is None:
        return None
    if grad_output is None:
        return grad.to(dtype)
    if backend == "triton" and PATHS.cast_kernel:
        from .grad_cast_triton import scale_cast, takes

        if takes(grad, dtype):
            return scale_cast(grad, grad_output, dtype, out=grad if grad.dtype == dtype else None)
    if grad.dtype == dtype and dtype in (torch.bfloat16, torch.float16):
        scale = grad_output.to(torch.float32)
        flat = grad.view(-1) if grad.is_contiguous() else None
        if flat is None:
            return grad.copy_(grad.float().mul_(scale))
        for start in range(0, flat.numel(), SCALE_BLOCK_ELEMENTS):
            block = flat[start:start + SCALE_BLOCK_ELEMENTS]
            block.copy_(block.float().mul_(scale))
        return grad
    if grad.dtype == dtype:
        return grad.mul_(grad_output.to(dtype))
    return torch.mul(grad, grad_output, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


def logits_dtype(hidden: torch.Tensor, fp32_logits: bool) -> torch.dtype:
    """The dtype of a chunk's logits: the inputs' (bf16 GEMMs round them to bf16, as the peers' heads do), or with
    ``fp32_logits`` fp32, summed and kept in fp32 by the GEMM itself (``model.fp32_logits``: the trainer's side of
    vLLM's ``head_dtype: float32``)."""
    return torch.float32 if fp32_logits else hidden.dtype


def _logits_into(buf, hidden_chunk, weight, bias):
    if buf.dtype != hidden_chunk.dtype:  # fp32 logits of bf16/fp16 operands: exact products, fp32 sums
        mm_fp32_out(hidden_chunk, weight.t(), buf, accumulate=False)
        return buf if bias is None else buf.add_(bias)
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
