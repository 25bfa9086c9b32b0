"""TRL-style environments whose ``reset`` hangs or raises, for the episode follow-up tests (``module:Class`` specs)."""

from __future__ import annotations

import time


class _Tools:
    def poke(self, x: int) -> str:
        """Pokes the environment.

        Args:
            x: anything
        """
        return str(x)


class HangingReset(_Tools):
    """A sandbox that never comes up: ``reset`` sleeps far past any tool timeout."""

    def reset(self, **row) -> None:
        time.sleep(60)


class FailingReset(_Tools):
    """``reset`` raises: the row it was given cannot start an episode."""

    def reset(self, **row) -> None:
        raise KeyError("task_id")
