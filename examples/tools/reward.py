"""The tools example's reward: the arithmetic example's strict ``correctness`` (TRL's signature), which reads a
completion's last assistant message (``fastrlhf.rl.rewards.completion_text``): for an episode, its final answer.
1.0 for ``The answer is N`` with N the row's ``answer``; a number that appears only in the tool's message does
not count, only what the policy itself states."""

from examples.arithmetic.reward import correctness

__all__ = ["correctness"]
