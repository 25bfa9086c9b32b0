"""The RL core: one PPO / GRPO step (``step.RLStep``, read it top to bottom) and the ``train`` run
(``trainer.run``; ``rollout_setup``: its rollout engine). ``experience`` (rollouts -> padded tensors),
``rewards`` (reward functions and reward models; ``reward_results``: what a function returns, read as TRL
reads it, and its failures), ``forward`` (model passes and losses), ``update`` (epochs x minibatches x
accumulation, the learners), ``validation`` (held-out reward during a run), ``lora_sync``. The formulas, and
the PPO/GRPO registries, are in ``fastrlhf.algorithms``. Nothing heavy is imported here.
"""
