"""DeepSpeed's CPU shared-memory all-reduce buffers (66 MiB of /dev/shm per rank, never unlinked by DeepSpeed) are
gone once init_distributed returns, at one rank as at two: the launcher with one process sets LOCAL_SIZE=1 too,
and such runs (every command's CPU half in tests/gpu) left one buffer each until /dev/shm, which is RAM, filled
and a later run was killed for memory."""

import os
import sys

import pytest
from helpers.launch import start_group, wait_groups

from fastrlhf.distributed import free_port

CHILD = """
import os
from fastrlhf.distributed import launch

name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{os.environ['MASTER_PORT']}_{os.environ['RANK']}"
real = launch._unlink_shm_buffers

def spy():
    before = os.path.exists(name)
    real()
    print(f"buffer before {before} after {os.path.exists(name)}", flush=True)

launch._unlink_shm_buffers = spy
launch.init_distributed(timeout_s=120)
from fastrlhf.distributed import comm
print("sum", comm.reduce_floats([1.0])[0], flush=True)  # the group still reduces after the unlink
from fastrlhf.cli import exit_with
exit_with(0)  # as every command leaves: past torch's exit-time abort of a started group (SIGABRT, 1 exit in 3)
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_init_distributed_leaves_no_shared_memory_buffer(world, tmp_path):
    port = str(free_port())
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_"
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        logs.append(tmp_path / f"rank{rank}.log")
        procs.append(start_group([sys.executable, "-c", CHILD], logs[-1], env=env))
    # A first DeepSpeed shm-op build on this machine takes up to a minute.
    codes = wait_groups(procs, timeout=300, logs=logs)
    outs = [log.read_text() for log in logs]
    assert codes == [0] * world, "\n".join(o[-3000:] for o in outs)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert left == [], left
    reports = [next(line for line in o.splitlines() if line.startswith("buffer before")) for o in outs]
    if reports == ["buffer before False after False"] * world:
        pytest.skip("DeepSpeed's shared-memory op is not built on this CPU: no buffer to leave")
    assert reports == ["buffer before True after False"] * world, reports
    assert all(f"sum {float(world)}" in o for o in outs), outs
