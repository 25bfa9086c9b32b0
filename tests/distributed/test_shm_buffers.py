"""DeepSpeed's CPU shared-memory all-reduce op is neither built nor started by init_distributed, at one rank as at
two. Built, it cost a machine's first run 17-30 s of g++ under a build lock that a killed build left to hang later
runs, and each rank mapped a 66 MiB /dev/shm buffer that DeepSpeed never unlinked (the launcher with one process
sets LOCAL_SIZE=1 too): /dev/shm, which is RAM, filled until a later run was killed for memory."""

import os
import sys

import pytest
from helpers.launch import start_group, wait_groups

from fastrlhf.distributed import free_port

CHILD = """
from fastrlhf.distributed import launch

launch.init_distributed(timeout_s=120)
from deepspeed.comm import comm as backend

print("shm op", backend.cdb.shm_comm_op, flush=True)
from fastrlhf.distributed import comm
print("sum", comm.reduce_floats([1.0])[0], flush=True)
from fastrlhf.cli import exit_with
exit_with(0)  # as every command leaves: past torch's exit-time abort of a started group (SIGABRT, 1 exit in 3)
"""


@pytest.mark.parametrize("world", [1, 2])
def test_init_distributed_builds_no_shared_memory_op_and_leaves_no_buffer(world, tmp_path):
    port = str(free_port())
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_"
    extensions = tmp_path / "torch_extensions"  # where a JIT build would go: torch reads it at each build
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "TORCH_EXTENSIONS_DIR": str(extensions)}
        logs.append(tmp_path / f"rank{rank}.log")
        procs.append(start_group([sys.executable, "-c", CHILD], logs[-1], env=env))
    # A build would take 17-60 s: a timeout that lets one finish, so that the assertions below say what went wrong.
    codes = wait_groups(procs, timeout=180, logs=logs)
    outs = [log.read_text() for log in logs]
    assert codes == [0] * world, "\n".join(o[-3000:] for o in outs)
    assert all("shm op None" in o and f"sum {float(world)}" in o for o in outs), outs
    assert not extensions.exists() or os.listdir(extensions) == [], os.listdir(extensions)
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []
