"""ZeRO-3 -> vLLM weight sync on 2 ranks under the deepspeed launcher (tests/rollout/scripts/zero3_sync.py).

Measured on the 2-core dev machine: about 60-100 s wall (two ranks each importing deepspeed and vLLM
and starting an engine; the sync itself takes ~0.1-0.3 s).
"""

import json
import os
import sys

import pytest
from helpers.launch import run_group
from helpers.paths import ROOT as REPO

from fastrlhf.distributed import free_port

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(REPO, "tests", "rollout", "scripts", "zero3_sync.py")
TIMEOUT_S = 240


def test_zero3_bucketed_sync_reaches_every_ranks_engine(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("deepspeed")
    out_dir, work_dir = tmp_path / "out", tmp_path / "work"
    out_dir.mkdir()
    work_dir.mkdir()
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "2", "--master_port", str(free_port()), SCRIPT, str(out_dir), str(work_dir)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rc, output = run_group(cmd, TIMEOUT_S, env=env, cwd=REPO)
    assert rc == 0, output[-4000:]

    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    for r, report in enumerate(reports):
        assert report["rank"] == r and report["world_size"] == 2
        assert report["partitioned"], "the trainer's parameters were not ZeRO-3 partitioned"
        assert report["num_buckets"] > 1 and report["max_bucket_bytes"] <= 64 << 10
        assert report["reference_missing"] == []
        assert report["changed"], f"rank {r}: the engine still generates what the initial model did"
        assert report["matches_trainer"], f"rank {r}: the engine does not generate what the trainer's weights do"
        assert report["all_reduce_after_close"] == 3.0, "the trainer's process group did not survive the engine"
    assert reports[0]["bytes"] == reports[1]["bytes"] > 0
