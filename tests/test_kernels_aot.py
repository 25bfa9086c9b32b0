"""Every Triton kernel compiles to PTX and cubin for sm_80 and sm_90, with no GPU present.

The interpreter never lowers a kernel, so this is what catches GPU-only compile errors on CPU CI.
It runs in a subprocess because this test process has TRITON_INTERPRET=1 (tests/conftest.py),
under which triton.jit builds interpreter objects that cannot be compiled.
"""

import json
import os
import subprocess
import sys

KERNEL_VARIANTS_PER_DTYPE_AND_BLOCK = 1 + 3 * 2  # stats + grad x (lp/ent switches) x (out dtype)


def test_every_kernel_compiles_for_sm80_and_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-m", "fastrlhf.kernels._triton_aot", "--sm", "80", "90",
           "--dtype", "float32", "bfloat16", "float16", "--block", "4096", "256"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    # fp32 logits have a single out dtype, so 4 variants there instead of 7.
    expected_per_sm = 2 * (4 + KERNEL_VARIANTS_PER_DTYPE_AND_BLOCK * 2)
    for sm in (80, 90):
        built = [r for r in rows if r["sm"] == sm]
        assert len(built) == expected_per_sm, [r["kernel"] for r in built]
        assert {r["kernel"].split("[")[0] for r in built} == {"stats", "grad"}
        assert {r["block_v"] for r in built} == {4096, 256}
        for r in built:
            assert r["ptx_chars"] > 1000 and r["cubin_bytes"] > 1000, r
            assert r["ptx_target"].startswith(f"sm_{sm}"), r
