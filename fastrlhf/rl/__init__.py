"""The RL core: PPO and GRPO steps (``step.RLStep``) and the ``train`` loop (``trainer.run``).

Modules: ``experience`` (rollouts -> padded tensors), ``rewards`` (reward functions and reward
models), ``forward`` (logprobs / fused policy loss / values through the models), ``ppo`` and ``grpo``
(advantages, critic loss), ``update`` (epochs x minibatches x accumulation, NaN-guarded),
``learner`` (DeepSpeed engine or module + optimizer), ``step`` (one step), ``trainer`` (the run).
Nothing heavy is imported here.
"""
