"""Joining the process group when the launcher shows each rank fewer GPUs than its local rank needs.

SLURM's ``--gpus-per-task`` (or ``CUDA_VISIBLE_DEVICES`` set per rank) leaves rank 3 of a node one GPU, numbered
0. DeepSpeed puts each rank on GPU ``LOCAL_RANK`` (``DeepSpeedEngine._set_distributed_vars``), so it cannot run
there: the run must stop at once with one line saying why, from rank 0 too, instead of CUDA's "invalid device
ordinal" on rank 3 alone and the other ranks waiting in the rendezvous until ``FASTRLHF_DIST_TIMEOUT``. The GPUs
are emulated (``tests/helpers/launch_fake_gpus.py``): the ranks never reach a collective.
"""

import os
import sys
import time

import pytest
from helpers.launch import start_group, wait_groups
from helpers.paths import ROOT

from fastrlhf.distributed import free_port

CHILD = os.path.join(ROOT, "tests", "helpers", "launch_fake_gpus.py")
TIMEOUT_S = 20


def start_ranks(tmp_path, visible: int, world: int, timeouts=None):
    """Ranks 0..world-1 on one node, each seeing ``visible`` GPUs, rank r with ``FASTRLHF_DIST_TIMEOUT``
    ``timeouts[r]``; returns (exit codes, outputs, seconds)."""
    port = str(free_port())
    timeouts = timeouts or [str(TIMEOUT_S)] * world
    procs, logs = [], []
    for r in range(world):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "FASTRLHF_DIST_TIMEOUT": timeouts[r],
            "PYTHONPATH": ROOT,
        }
        logs.append(tmp_path / f"rank{r}.log")
        procs.append(start_group([sys.executable, CHILD, str(visible)], logs[-1], env=env))
    started = time.monotonic()
    codes = wait_groups(procs, TIMEOUT_S + 90, logs)
    return codes, [log.read_text() for log in logs], time.monotonic() - started


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_a_rank_past_its_visible_gpus_stops_every_rank_at_once_with_one_line(tmp_path):
    codes, outputs, seconds = start_ranks(tmp_path, visible=1, world=2)
    assert codes == [2, 2], outputs
    assert seconds < TIMEOUT_S, (seconds, outputs)  # the start gate, not the rendezvous timeout
    mine = last_line(outputs[1])
    assert mine.startswith("NodeError exit=2: distributed error: LOCAL_RANK is 1 but this rank sees 1 GPU(s)"), mine
    assert "--gpus-per-task" in mine
    # Rank 0 (whose line is the one the launcher's user reads) names the failing rank.
    assert last_line(outputs[0]).startswith("PeerFailedChecks exit=2: distributed error: LOCAL_RANK is 1"), outputs[0]
    assert "(on rank 1 on node 0" in outputs[0]


def test_one_rank_past_its_visible_gpus_says_why(tmp_path):
    codes, outputs, _ = start_ranks(tmp_path, visible=0, world=1)
    assert codes == [0], outputs  # no GPU at all: a CPU run, nothing to check
    env_rank = {
        "RANK": "0",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "FASTRLHF_DIST_TIMEOUT": str(TIMEOUT_S),
        "PYTHONPATH": ROOT,
    }
    log = tmp_path / "alone.log"
    code = wait_groups(
        [start_group([sys.executable, CHILD, "2"], log, env={**os.environ, **env_rank})], TIMEOUT_S + 90, [log]
    )
    assert code == [2]
    assert "LOCAL_RANK is 2 but this rank sees 2 GPU(s) (CUDA_VISIBLE_DEVICES=" in log.read_text()


@pytest.mark.parametrize("value", ["30s", "0", "-5", "inf"])
def test_an_unusable_dist_timeout_is_one_config_line_naming_the_variable(tmp_path, value):
    # Before: "ValueError: could not convert string to float: '30s'" (a traceback), and for 0 or -5 the
    # rendezvous' "client socket has timed out after 0ms" / "after -5000ms".
    codes, outputs, _ = start_ranks(tmp_path, visible=0, world=1, timeouts=[value])
    assert codes == [2], outputs
    assert last_line(outputs[0]) == (
        f"NodeError exit=2: config error: FASTRLHF_DIST_TIMEOUT: must be a number of seconds above 0, got {value!r}"
    )


def test_an_unusable_dist_timeout_on_one_rank_stops_the_others_at_once(tmp_path):
    codes, outputs, seconds = start_ranks(tmp_path, visible=0, world=2, timeouts=[str(TIMEOUT_S), "30s"])
    assert codes == [2, 2], outputs
    assert seconds < TIMEOUT_S, (seconds, outputs)
    assert "FASTRLHF_DIST_TIMEOUT: must be a number of seconds above 0, got '30s' (on rank 1" in outputs[0]


GROUP_TIMEOUTS = """
import torch
from fastrlhf.distributed import init_distributed
from deepspeed.utils import groups
import torch.distributed as dist

init_distributed()
def timeout(group):
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
print("world", timeout(dist.distributed_c10d._get_default_group()), "zero", timeout(groups._get_data_parallel_group()),
      "new", timeout(dist.new_group([0])), flush=True)
"""


def test_zero_and_every_later_group_take_the_runs_timeout(tmp_path):
    # Before: "world 20.0 zero 1800.0 new 1800.0": ZeRO's data-parallel group (its reduce-scatters and gathers)
    # kept torch's default, 30 min on gloo, 10 min on NCCL, whatever FASTRLHF_DIST_TIMEOUT said.
    # A port of its own: an earlier test's group in this pytest process may hold the one in os.environ.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    log = tmp_path / "groups.log"
    proc = start_group([sys.executable, "-c", GROUP_TIMEOUTS], log,
                       env={**env, "FASTRLHF_DIST_TIMEOUT": "20", "MASTER_PORT": str(free_port())})
    assert wait_groups([proc], 120, [log]) == [0], log.read_text()
    assert last_line(log.read_text()) == "world 20.0 zero 20.0 new 20.0"
