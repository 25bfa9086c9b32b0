"""kernels/grad_cast_triton.py (the fused head's last backward pass on the Triton backend) against its reference,
torch's ``mul`` into a bf16/fp16 ``out`` (``fused_linear_chunks.scale_and_cast``'s torch branch), under the
interpreter here (tests/conftest.py sets TRITON_INTERPRET=1): the same bits in fp16; in bf16 within one unit in the
last place, since the interpreter's bf16 conversion truncates where a GPU's rounds to nearest even (the same bits
there: tests/gpu/test_kernels_at_scale.py). test_kernels_aot.py compiles it for sm_80 and sm_90."""

import pytest
import torch
from fastrlhf.kernels.fused_linear_chunks import scale_and_cast
from fastrlhf.kernels.grad_cast_triton import BLOCK, scale_cast

SPECIAL = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3.0e38, -7.0e4, 1.0e-40, 65504.0, 1.0 / 3]


def _values(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e3
    x[: min(n, len(SPECIAL))] = torch.tensor(SPECIAL[: min(n, len(SPECIAL))])
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 7, BLOCK + 1, 3 * BLOCK + 5])  # one element, a partial block, several blocks
@pytest.mark.parametrize("scale", [1.0, -0.37, 3.0e4])  # fp16 overflows to inf at 3e4 x 1e3, as torch's does
def test_scale_cast_writes_torch_mul_bit_for_bit(dtype, n, scale):
    grad = _values(n)
    grad_output = torch.tensor(scale)
    got = scale_cast(grad, grad_output, dtype)
    want = scale_and_cast(grad.clone(), grad_output, dtype)  # the torch branch: the reference
    assert got.dtype == dtype and got.shape == grad.shape
    assert_cast_equal(got, want)


def assert_cast_equal(got, want):
    """Equal bits in fp16; in bf16 the same special values and signs, normal values within one ulp (see above)."""
    if got.dtype == torch.float16:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        return
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), w.isinf())
    # and the interpreter's bf16 of an fp32 subnormal is off by far more than that (1e-40 reads 1.01e-39)
    finite = w.isfinite() & g.isfinite() & (w.abs() >= torch.finfo(torch.bfloat16).smallest_normal)
    assert torch.equal(torch.signbit(g[finite]), torch.signbit(w[finite]))
    ulp = (w.abs() * 2.0**-7).clamp(min=2.0**-133)  # bf16's spacing: 2^-7 of a normal value, 2^-133 subnormal
    assert ((g - w).abs()[finite] <= ulp[finite]).all(), (g - w).abs().max()
    assert torch.equal(g[g.isinf()], w[w.isinf()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
# 1/3 is neither a bf16 nor an fp16 value; 65,536 is inf in fp16 (and exact in bf16: there the old branch agrees)
@pytest.mark.parametrize("scale", [1.0 / 3, 65536.0])
def test_scale_cast_scales_a_low_precision_grad_in_place_in_fp32(dtype, scale):
    """A bf16/fp16 gradient (the fused head's grad_hidden) scaled in place: each product in fp32, rounded once,
    as the torch branch does it, not by ``grad_output`` rounded to the gradient's dtype first."""
    grad = (_values(BLOCK + 3, seed=1) * 1e-3).to(dtype)
    grad_output = torch.tensor(scale)
    want = (grad.float() * scale).to(dtype)
    torch.testing.assert_close(scale_and_cast(grad.clone(), grad_output, dtype), want, rtol=0, atol=0,
                               equal_nan=True)
    got = grad.clone()
    assert scale_cast(got, grad_output, dtype, out=got).data_ptr() == got.data_ptr()
    assert_cast_equal(got, want)
    if float(grad_output.to(dtype)) != scale:  # not a value of dtype: the old in-place branch's rounded scale differs
        old, finite = grad * grad_output.to(dtype), want.isfinite()
        assert (old[finite] != want[finite]).any()


def test_scale_cast_keeps_the_shape_and_an_empty_tensor():
    grad = _values(5 * 13).reshape(5, 13)
    got = scale_cast(grad, torch.tensor(2.0), torch.float16)
    torch.testing.assert_close(got, (grad * 2).half(), rtol=0, atol=0, equal_nan=True)
    assert scale_cast(torch.empty(0, 4), torch.tensor(2.0), torch.bfloat16).shape == (0, 4)


@pytest.mark.parametrize("grad,dtype", [(torch.zeros(4, 6).t(), torch.bfloat16), (torch.zeros(3), torch.float32),
                                         (torch.zeros(3, dtype=torch.bfloat16), torch.float16)],
                         ids=["not-contiguous", "fp32-out", "bf16-in"])
def test_what_scale_cast_does_not_cover_fails_with_the_reason_and_scale_and_cast_takes_torch(grad, dtype):
    with pytest.raises(ValueError, match=r"contiguous float32 \(or .*\) grad and a bf16/fp16 dtype"):
        scale_cast(grad, torch.tensor(2.0), dtype)
    out = scale_and_cast(grad.clone(), torch.tensor(2.0), dtype, backend="triton")  # falls back, no error
    assert out.dtype == dtype and out.shape == grad.shape
