"""The ``@triton.jit`` kernel of ``grad_cast_triton.py`` (read its docstring). Importing this module imports triton
and fixes, from TRITON_INTERPRET at that moment, whether the kernel is interpreted, so only the launcher imports
it, on first use."""

import triton
import triton.language as tl


@triton.jit
def scale_cast(src_ptr, scale_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """``dst = src * scale`` over ``n`` contiguous elements: fp32 (or ``dst``'s dtype, ``dst`` may be ``src``) in,
    the product in fp32 rounded once to ``dst``'s dtype, ``scale`` one fp32 value on the device."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    scale = tl.load(scale_ptr)
    x = tl.load(src_ptr + offsets, mask=inside)
    # Rounded to nearest even, as torch rounds (a GPU's default; TRITON_INTERPRET's bf16 truncates regardless).
    tl.store(dst_ptr + offsets, (x * scale).to(dst_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
