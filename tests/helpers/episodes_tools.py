"""``async def`` tools for the episode audit tests (importable as ``module:name`` specs)."""

from __future__ import annotations

import asyncio


async def add_async(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    await asyncio.sleep(0)
    return str(a + b)


async def sleepy_async(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "woke"
