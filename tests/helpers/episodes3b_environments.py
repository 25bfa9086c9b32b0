"""A TRL-style environment whose ``reset`` fails for the rows that ask it to, for the audit-3b episode tests."""

from __future__ import annotations


class FailsWhenAsked:
    """``reset(**row)`` raises for a row with ``fail: true`` (a sandbox that refuses it), else starts quietly."""

    def reset(self, fail: bool = False, **row) -> None:
        if fail:
            raise ConnectionError("the sandbox refused the connection")

    def poke(self, x: int) -> str:
        """Pokes the environment.

        Args:
            x: anything
        """
        return str(x)


class FailsAfterFourStarts(FailsWhenAsked):
    """Starts four episodes (one step of 2 prompts x 2 samples), then refuses every later one."""

    starts = 0

    def reset(self, **row) -> None:
        type(self).starts += 1
        if type(self).starts > 4:
            raise ConnectionError("the sandbox refused the connection")
