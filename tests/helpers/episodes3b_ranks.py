"""A rank of the two-rank episode test (audit 3b): rank 1's environment fails to start, rank 0's starts; each rank
then goes on into the step's next collective, as the RL step does, and records how it ended."""

from __future__ import annotations

import datetime
import time

ENVIRONMENT = "tests.helpers.episodes3b_environments:FailsWhenAsked"


def episode_rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from fastrlhf.distributed import comm
    from fastrlhf.modeling.tiny_chat import build_chat_tokenizer
    from fastrlhf.rollout import SamplingConfig
    from fastrlhf.rollout.episodes import EpisodeRunner
    from fastrlhf.rollout.tools import load_toolbox
    from tests.helpers.tool_fixtures import ScriptedEngine

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    started = time.monotonic()
    try:
        tokenizer = build_chat_tokenizer()
        runner = EpisodeRunner(
            ScriptedEngine(tokenizer, {"Q": ["The answer is 6."]}),
            load_toolbox([], ENVIRONMENT),
            tokenizer,
            2,
            say=None,
        )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Q"}], tokenize=False, add_generation_prompt=True
        )
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        runner.generate([prompt], SamplingConfig(n=2, max_new_tokens=20, seed=1), [{"fail": rank == 1}])
        comm.reduce_floats([1.0])  # the step's next collective (the reward agreement's)
        out[rank] = {"ended": "ok"}
    except Exception as exc:  # noqa: BLE001 -- recorded for the test to compare
        from fastrlhf.engine.guards import StepFailed

        out[rank] = {
            "ended": type(exc).__name__,
            "message": str(exc),
            "local": getattr(exc, "local", None),
            "exit_code": getattr(exc, "exit_code", None),
            "step_failed": isinstance(exc, StepFailed),
            "seconds": time.monotonic() - started,
        }
    finally:
        dist.destroy_process_group()
