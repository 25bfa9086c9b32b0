"""fastrlhf: kernel-accelerated RLHF (PPO, GRPO, SFT, reward models) on DeepSpeed ZeRO and vLLM."""

__version__ = "0.1.0"

__all__ = ["__version__"]
