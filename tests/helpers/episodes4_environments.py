"""TRL-style environments that hang, for the audit-4 episode tests (importable as ``module:Class`` specs).

Each hang waits on its class's ``release`` event, with a 20 s safety net so that a test run on code without the
timeouts under test ends (and fails) rather than hangs."""

from __future__ import annotations

import threading

SAFETY_NET_S = 20.0


class HangsOnTool:
    """``hang`` never returns until ``release`` is set; ``calls`` counts the calls that reached it, per instance."""

    release = threading.Event()

    def reset(self, **row) -> None:
        self.calls = 0

    def hang(self, x: int) -> str:
        """Hangs.

        Args:
            x: anything
        """
        self.calls += 1
        type(self).release.wait(SAFETY_NET_S)
        return "woke"

    def get_reward(self) -> float:
        return float(self.calls)


class HangsOnReward:
    """``get_reward`` hangs until ``release`` is set (a grader that never answers) where ``hangs`` (a row column)."""

    release = threading.Event()

    def reset(self, hangs: bool = True, **row) -> None:
        self.hangs = hangs

    def poke(self, x: int) -> str:
        """Pokes the environment.

        Args:
            x: anything
        """
        return str(x)

    def get_reward(self) -> float:
        if self.hangs:
            type(self).release.wait(SAFETY_NET_S)
        return 1.0


def cuda_device_here(x: int) -> str:
    """The CUDA device the call runs on.

    Args:
        x: anything
    """
    import torch

    return str(torch.cuda.current_device())
