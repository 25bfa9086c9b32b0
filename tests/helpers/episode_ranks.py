"""Ranks of the two-rank environment tests: rank 1's environment fails (its ``reset()`` raises, or its
``get_reward()`` hangs), rank 0's does not; each rank then goes on into the step's next collective, as the RL step
does, and records how it ended (``out[rank]``)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

FAILS_TO_START = "tests.helpers.episodes3b_environments:FailsWhenAsked"
HANGS_ON_REWARD = "tests.helpers.episodes4_environments:HangsOnReward"


def _recorded(rank: int, port: int, out, body: Callable[[], None]) -> None:
    import torch.distributed as dist

    from fastrlhf.distributed import comm
    from fastrlhf.engine.guards import StepFailed

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    started = time.monotonic()
    try:
        body()
        comm.reduce_floats([1.0])  # the step's next collective (the reward agreement's)
        out[rank] = {"ended": "ok", "seconds": time.monotonic() - started}
    except Exception as exc:  # noqa: BLE001 -- recorded for the test to compare
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


def episode_rank(rank: int, port: int, out) -> None:
    """Rank 1's environment fails to start in ``EpisodeRunner.generate``."""

    def body() -> None:
        from fastrlhf.modeling.tiny_chat import build_chat_tokenizer
        from fastrlhf.rollout import SamplingConfig
        from fastrlhf.rollout.episodes import EpisodeRunner
        from fastrlhf.rollout.tools import load_toolbox
        from tests.helpers.tool_fixtures import ScriptedEngine

        tokenizer = build_chat_tokenizer()
        runner = EpisodeRunner(ScriptedEngine(tokenizer, {"Q": ["The answer is 6."]}),
                               load_toolbox([], FAILS_TO_START), tokenizer, 2, say=None)
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False,
                                             add_generation_prompt=True)
        prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        runner.generate([prompt], SamplingConfig(n=2, max_new_tokens=20, seed=1), [{"fail": rank == 1}])

    _recorded(rank, port, out, body)


def reward_rank(rank: int, port: int, out) -> None:
    """Rank 1's ``get_reward()`` hangs; each rank scores its episode as the RL step does (agreed across the ranks)."""

    def body() -> None:
        from fastrlhf.rl.reward_results import agree_on_reward_failure, environment_scores
        from fastrlhf.rollout.tools import load_toolbox

        toolbox = load_toolbox([], HANGS_ON_REWARD, timeout_s=3.0)  # rank 0's quick call: well inside it
        environment, _ = toolbox.new_environment({"hangs": rank == 1})
        agree_on_reward_failure(lambda: environment_scores("HangsOnReward", [environment])[0])

    _recorded(rank, port, out, body)


def assert_every_rank_ended_alike(target: Callable, kind: str, said: str) -> None:
    """Both ranks of ``target`` ended with ``kind``, saying ``said`` (exit 1, the last good step kept); rank 1 raised
    it, rank 0 heard it from the agreement (not from a timeout of its next collective)."""
    from tests.helpers.launch import spawn_ranks

    out = spawn_ranks(target)
    for rank in (0, 1):
        ended = out[rank]
        assert ended["ended"] == kind, (rank, ended)
        assert ended["message"] == said and ended["exit_code"] == 1 and ended["step_failed"], (rank, ended)
        assert ended["local"] == (rank == 1), (rank, ended)
    assert "\n" not in said
