"""Reference RL math: the one home of every formula the trainer and the kernels use. Plain
PyTorch, importable with torch alone. Per-token tensors are ``[B, T]`` aligned on response tokens;
``mask`` is 1.0 where a token counts and 0.0 elsewhere. Names follow verl's ``core_algos``.

Masking is done with ``torch.where`` rather than multiplication so that whatever sits at a
masked position (-inf logprobs of padding, NaN values) can never leak into a result.

What differs between PPO and GRPO lives in two registries, verl-style:

* :data:`ADV_ESTIMATORS` (``@register_adv_est``): ``gae`` (PPO, with a critic), ``grpo``, ``rloo``,
  ``reinforce_plus_plus`` and ``reinforce_plus_plus_baseline``, and verl's ``grpo_passk``, ``opo`` and ``gpg``;
  ``ADV_ESTIMATOR_OF[algorithm]`` says which one an algorithm uses, :data:`ADV_ESTIMATOR_TRAITS` what each
  needs (values, groups) and gives (returns).
* :data:`POLICY_LOSSES` (``@register_policy_loss``): ``vanilla`` (clipped surrogate, clip-higher,
  dual clip), ``cispo``, ``gspo`` and ``sapo``, and verl's ``gpg``, ``clip_cov`` and ``kl_cov``; chosen by
  ``trainer.policy_loss``, with its own options in ``trainer.policy_loss_args``.

Adding a loss is one registered function. ``token_level=True`` says each token's loss depends on
that token alone; such a loss runs inside the token-chunked fused kernels
(``fastrlhf.kernels.fused_linear_policy_loss``), which evaluate it on chunks of flattened tokens.
A loss that needs a whole sequence (GSPO's sequence-level ratio) is registered with
``token_level=False`` and trained through the fused logprob kernel plus autograd instead; neither
path materialises the ``[tokens, vocab]`` logits.

The formulas live in eight modules, all re-exported here: ``masked`` (masked reductions), ``logprobs``
(logprobs, entropy and KL from logits), ``advantages`` (GAE, GRPO, the estimator registry), ``losses``
(aggregation, the policy-loss registry, value, SFT and reward-model losses), ``kl_control`` (the adaptive
KL coefficient), ``off_policy_mask`` (DeepSeek-V3.2's off-policy sequence masking), and ``verl_estimators`` and
``verl_losses`` (verl's estimators and losses that the others lack; importing them registers them).
"""

from fastrlhf.algorithms.advantages import *  # noqa: F403
from fastrlhf.algorithms.advantages import __all__ as _advantages
from fastrlhf.algorithms.kl_control import *  # noqa: F403
from fastrlhf.algorithms.kl_control import __all__ as _kl_control
from fastrlhf.algorithms.logprobs import *  # noqa: F403
from fastrlhf.algorithms.logprobs import __all__ as _logprobs
from fastrlhf.algorithms.logprobs import _check_temperature  # noqa: F401 (the kernels' argument check)
from fastrlhf.algorithms.losses import *  # noqa: F403
from fastrlhf.algorithms.losses import __all__ as _losses
from fastrlhf.algorithms.masked import *  # noqa: F403
from fastrlhf.algorithms.masked import __all__ as _masked
from fastrlhf.algorithms.off_policy_mask import *  # noqa: F403
from fastrlhf.algorithms.off_policy_mask import __all__ as _off_policy_mask
from fastrlhf.algorithms.verl_estimators import *  # noqa: F403
from fastrlhf.algorithms.verl_estimators import __all__ as _verl_estimators
from fastrlhf.algorithms.verl_losses import *  # noqa: F403
from fastrlhf.algorithms.verl_losses import __all__ as _verl_losses

__all__ = [*_masked, *_logprobs, *_advantages, *_losses, *_kl_control, *_off_policy_mask, *_verl_estimators,
           *_verl_losses]
