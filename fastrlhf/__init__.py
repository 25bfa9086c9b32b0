"""fastrlhf: kernel-accelerated RLHF (PPO, GRPO, SFT, reward models) on DeepSpeed ZeRO and vLLM."""

from fastrlhf.version import __version__

__all__ = ["__version__"]
