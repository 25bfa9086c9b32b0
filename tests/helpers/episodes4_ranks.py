"""A rank of the two-rank get_reward test (audit 4): rank 1's environment's ``get_reward()`` hangs, rank 0's
returns; each rank scores its episode as the RL step does (agreed across the ranks), then goes on into the step's
next collective, and records how it ended."""

from __future__ import annotations

import datetime
import time

ENVIRONMENT = "tests.helpers.episodes4_environments:HangsOnReward"


def reward_rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from fastrlhf.distributed import comm
    from fastrlhf.rl.reward_results import agree_on_reward_failure, environment_scores
    from fastrlhf.rollout.tools import load_toolbox

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    started = time.monotonic()
    try:
        toolbox = load_toolbox([], ENVIRONMENT, timeout_s=3.0)  # rank 0's quick call: well inside it
        environment, _ = toolbox.new_environment({"hangs": rank == 1})
        agree_on_reward_failure(lambda: environment_scores("HangsOnReward", [environment])[0])
        comm.reduce_floats([1.0])  # the step's next collective
        out[rank] = {"ended": "ok", "seconds": time.monotonic() - started}
    except Exception as exc:  # noqa: BLE001 -- recorded for the test to compare
        out[rank] = {
            "ended": type(exc).__name__,
            "message": str(exc),
            "local": getattr(exc, "local", None),
            "exit_code": getattr(exc, "exit_code", None),
            "seconds": time.monotonic() - started,
        }
    finally:
        dist.destroy_process_group()
