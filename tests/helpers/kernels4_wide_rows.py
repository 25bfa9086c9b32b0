"""Row offsets past 2^31 elements in the Triton kernels, checked without allocating them; run as a script
by tests/kernels/test_kernels_audit4.py, in a child process (a wrapped int32 offset is a wild pointer, and a
segfault there must fail one test, not end the suite).

A micro-batch of 16,384 tokens at Qwen2's 151,936 vocabulary puts its last rows 2.49e9 elements past the first,
beyond int32. Two modes:

* ``interpret DIR`` (TRITON_INTERPRET=1): bf16 logits whose three rows lie 2^30 + 16 elements apart, in a sparse
  file mapped privately (only the pages the rows touch take memory), so the last row starts 2^31 + 32 elements
  in; the statistics, gradient and row-loss kernels must give exactly what they give for the same rows
  contiguous. Prints ``OK``; exits 2 when the file system keeps no sparse file (``SKIP``).
* ``compile`` (TRITON_INTERPRET=0): the same kernels compiled for sm_90 with int32 strides, as the JIT
  specialises a stride of 151,936; every product of a row and a stride in their Triton IR must be int64. Prints
  one JSON object: kernel -> the types of those products.
"""

import json
import os
import re
import sys

ROWS, V, STRIDE = 3, 37, (1 << 30) + 16


def _wide_logits(folder):
    import torch

    path = os.path.join(folder, "logits.bin")
    total = STRIDE * (ROWS - 1) + V
    with open(path, "wb") as f:
        f.truncate(total * 2)
    if os.stat(path).st_blocks * 512 > (1 << 20):
        print("SKIP: no sparse files here")
        sys.exit(2)
    store = torch.from_file(path, shared=False, size=total, dtype=torch.bfloat16)
    return store.as_strided((ROWS, V), (STRIDE, 1))


def interpret(folder):
    import torch
    from fastrlhf.kernels.logprob_entropy import logprob_entropy_grad, logprob_entropy_stats
    from fastrlhf.kernels.policy_loss_triton import triton_row_loss_and_grad

    wide = _wide_logits(folder)
    vals = (torch.randn(ROWS, V, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    labels = torch.tensor([3, 30, 7])
    assert (ROWS - 1) * wide.stride(0) >= 2**31

    def both(fn):
        wide.copy_(vals)
        return fn(wide), fn(vals.clone())

    stats = both(lambda x: logprob_entropy_stats(x, labels, 0.9, "triton"))
    for got, want in zip(*stats, strict=True):
        assert torch.equal(got, want), ("stats", got, want)
    lp, ent, lse = stats[1]
    g_lp, g_ent = torch.tensor([1.0, -0.5, 0.25]), torch.tensor([0.3, 0.2, -0.1])
    got, want = both(lambda x: logprob_entropy_grad(x, labels, lse, ent, g_lp, g_ent, 0.9, "triton", out=x))
    assert torch.equal(got, want), ("grad", got, want)
    weights, adv, old = torch.full((ROWS,), 1 / ROWS), torch.tensor([1.0, -1.0, 0.5]), torch.full((ROWS,), -3.0)
    for programs in (None, 2):

        def rows(x, programs=programs):
            loss, sums = triton_row_loss_and_grad(
                x, labels, old, adv, weights, None, 0.9, out=x, programs=programs, entropy_coef=0.01
            )
            return torch.stack([loss, *sums.values()]), x.clone()

        for got, want in zip(*both(rows), strict=True):
            assert torch.equal(got, want), ("rows", programs, got, want)
    print("OK")


def _stride_products(ttir: str, strides) -> list[str]:
    """Types of the ``arith.muli`` ops that take a stride argument (or its widened copy)."""
    names = {f"%{s}" for s in strides}
    names |= {m.group(1) for m in re.finditer(r"(%\S+) = arith\.extsi (%\S+) :", ttir) if m.group(2) in names}
    return [
        m.group(3)
        for m in re.finditer(r"arith\.muli (%[^,\s]+), (%[^\s:]+) : (\S+)", ttir)
        if m.group(1) in names or m.group(2) in names
    ]


def compile_kernels():
    import triton
    from fastrlhf.kernels._triton_aot import kernel_specs, row_loss_specs
    from triton.backends.compiler import GPUTarget

    specs = kernel_specs("bfloat16", 1024)[:2] + row_loss_specs("bfloat16", 1024)[:1]
    found = {}
    for label, fn, sig, constexprs, warps in specs:
        strides = [name for name in sig if name.startswith("stride")]
        sig = {**sig, **{name: "i32" for name in strides}, **{name: "constexpr" for name in constexprs}}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        found[label] = _stride_products(compiled.asm["ttir"], strides)
    print(json.dumps(found))


if __name__ == "__main__":
    if sys.argv[1] == "interpret":
        interpret(sys.argv[2])
    else:
        compile_kernels()
