"""The CPU probe and in-place packed weights on this machine as oneDNN sees it (run it under
``ONEDNN_MAX_CPU_ISA`` to stand in for an older CPU: AVX2, AVX-512 without bf16).

``python cpu4_isa_check.py``: for each dtype and weight shape, whether ``new_packed_weight`` gives an in-place
packed weight and, where it does, how far its GEMM is from torch's own oneDNN linear on a weight oneDNN packed
itself (``BITWISE`` must be exact: the same kernel on the same bytes) and from ``F.linear`` (``LINEAR``).
Prints the probe's summary, then one line per case: ``CASE dtype n k in_place BITWISE d LINEAR e``."""

import torch

from fastrlhf.cpu.packed_linear import new_packed_weight
from fastrlhf.cpu.probe import cpu_probe

# The probe's shapes, GQA qkv / MLP shapes of small models, N not a multiple of 64, K not of 16 or 32.
SHAPES = ((64, 64), (1536, 512), (192, 64), (1152, 896), (128, 48), (96, 64), (64, 40), (256, 24))


def main() -> None:
    probe = cpu_probe()
    print("SUMMARY", probe.summary(), flush=True)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in SHAPES:
            weight = torch.randn(n, k, generator=g).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype)
            x = torch.randn(7, k, generator=g).to(dtype)
            packed = new_packed_weight(n, k, dtype, probe)
            if packed is None:
                print(f"CASE {dtype} {n} {k} False", flush=True)
                continue
            packed.write_rows(0, weight[: n // 2])  # in two pieces, as a fused layer's parts arrive
            packed.write_rows(n // 2, weight[n // 2 :])
            ours = packed(x, torch.empty(0, dtype=dtype), bias)
            theirs = torch.ops.mkldnn._linear_pointwise(
                x, torch.ops.mkldnn._reorder_linear_weight(weight, 256), bias, "none", [], ""
            )
            linear = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
            bitwise = (ours.float() - theirs.float()).abs().max().item()
            close = (ours.float() - linear).abs().max().item()
            print(f"CASE {dtype} {n} {k} True BITWISE {bitwise} LINEAR {close}", flush=True)


if __name__ == "__main__":
    main()
