"""What decides the fused head's GPU branches, read on the device in seconds (issue #43, point 2): whether this
torch's ``mm``/``addmm`` take bf16 inputs with an fp32 output (``fp32_out_gemm``), and what that GEMM costs at
the 7B head's grad_W shape against the plain bf16 GEMM and the scratch path it replaces (bf16 GEMM, then the
add into the fp32 accumulator). Prints one JSON line and writes it to ``$OUT/probe.json``.

    python3 scripts/gpu_probe.py      (on the GPU machine, after .gpu-carry/on_device.sh)
"""

from __future__ import annotations

import json
import os

import torch
from fastrlhf.kernels.fused_linear_chunks import fp32_out_gemm

from benchmarks.gpu.timing import measure


def _ms(fn, reps: int = 10) -> float:
    return measure(fn, torch.device("cuda"), warmup=1, repeats=reps)[0]["time_ms"]


def main() -> dict:
    dev = torch.device("cuda")
    out = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, cuda=torch.version.cuda,
               fp32_out_gemm_bf16=fp32_out_gemm(dev, torch.bfloat16))
    vocab, hidden, rows = 152_064, 3_584, 1_664  # one balanced chunk of the 7B head at 16,384 tokens
    g = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16)
    h = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    acc = torch.zeros(vocab, hidden, device=dev, dtype=torch.float32)
    scratch = torch.empty(vocab, hidden, device=dev, dtype=torch.bfloat16)
    flops = 2 * rows * vocab * hidden
    out["gemm_bf16_ms"] = _ms(lambda: torch.mm(g.t(), h, out=scratch))
    out["scratch_path_ms"] = _ms(lambda: (torch.mm(g.t(), h, out=scratch), acc.add_(scratch)))
    if out["fp32_out_gemm_bf16"]:
        out["addmm_fp32_out_ms"] = _ms(lambda: torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc))
        out["mm_fp32_out_ms"] = _ms(lambda: torch.mm(g.t(), h, out_dtype=torch.float32, out=acc))
    for k in [k for k in out if k.endswith("_ms")]:
        out[k.replace("_ms", "_tflops")] = round(flops / out[k] / 1e9, 1)
    return out


if __name__ == "__main__":
    result = main()
    line = json.dumps(result)
    print(line)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe.json"), "w") as f:
            f.write(line + "\n")
