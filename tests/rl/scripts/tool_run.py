"""Tools for the `fastrlhf train` runs with multi-turn episodes (tests/rl/test_rl_tools.py), imported by the
run config (``imports: [tool_run]``): a tool, a TRL-style environment and a parser that reads a call in every
turn (a random tiny model writes none of its own), so that each episode takes several turns."""

from fastrlhf.rollout.tools import ToolCall, register_tool_call_parser


@register_tool_call_parser("every-turn")
def every_turn(text: str) -> list[ToolCall]:
    return [ToolCall("increment", {"by": len(text) % 3 + 1})]


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


class Counter:
    """reset(**row) -> text for the user message; increment is its tool; get_reward scores the episode."""

    def reset(self, **row):
        self.value = 0
        return None

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.value += by
        return str(self.value)

    def get_reward(self) -> float:
        return self.value / 10.0


class Silent(Counter):
    """An environment with no reward of its own."""

    get_reward = None
