"""The rules of the RL algorithm's settings in ``trainer`` (the policy loss and its options, the advantage estimator,
importance weights, the entropy mask, the KL controller, dynamic sampling), each failure a one-line ConfigError naming
the key (``fastrlhf.config.checks`` calls them). The registries are imported only where a non-default name is read:
the default config needs no torch import."""

from __future__ import annotations

from .errors import ConfigError
from .errors import positive as _positive

__all__ = ["check_adv_estimator", "check_advantage_scaling", "check_filter_groups", "check_group_size",
           "check_kl_in_reward", "check_kl_target", "check_off_policy_mask", "check_policy_loss", "check_tis",
           "check_top_entropy_quantile"]


def check_policy_loss(t) -> None:
    """The policy loss by its registered name, and its options (numbers, as the loader made sure) by its own
    arguments and checks."""
    import torch

    from fastrlhf.algorithms import POLICY_LOSSES, policy_loss_options

    if t.policy_loss not in POLICY_LOSSES:
        raise ConfigError("trainer.policy_loss", f"unknown policy loss {t.policy_loss!r}; registered: "
                                                 f"{', '.join(sorted(POLICY_LOSSES))}")
    options = policy_loss_options(t.policy_loss)
    for key in t.policy_loss_args:
        if key not in options:
            takes = f"its options: {', '.join(sorted(options))}" if options else "it takes none"
            raise ConfigError(f"trainer.policy_loss_args.{key}",
                              f"is not an option of policy loss {t.policy_loss} ({takes})")
    if t.policy_loss_args:  # the loss's own checks of its options, on one sequence of one token
        one = torch.ones(1, 1)
        try:
            POLICY_LOSSES[t.policy_loss].fn(one, one, one, one, clip_low=t.clip_low, clip_high=t.clip_high,
                                            dual_clip=t.dual_clip, **t.policy_loss_args)
        except ValueError as err:
            raise ConfigError("trainer.policy_loss_args", str(err)) from None


def check_tis(t) -> None:
    _positive(t.tis_cap, "trainer.tis_cap")
    _positive(t.tis_floor, "trainer.tis_floor")
    if t.tis_cap is None:
        for name, default in (("tis_level", "token"), ("tis_mode", "truncate"), ("tis_floor", None)):
            if getattr(t, name) != default:
                raise ConfigError(f"trainer.{name}", "shapes the importance weights that trainer.tis_cap turns on; "
                                                     "set trainer.tis_cap too")
    if t.tis_floor is not None:
        if t.tis_floor >= t.tis_cap:
            raise ConfigError("trainer.tis_floor", f"must be below trainer.tis_cap ({t.tis_cap}), got {t.tis_floor}")


def check_top_entropy_quantile(t) -> None:
    q, key = t.top_entropy_quantile, "trainer.top_entropy_quantile"
    if not 0.0 < q <= 1.0:  # NaN too
        raise ConfigError(key, f"must be in (0, 1] (the share of tokens by entropy that trains the policy term; "
                               f"1: all), got {q}")
    if q == 1.0:
        return
    if t.entropy_coef != 0.0:  # TRL gives its entropy bonus the kept tokens only; the fused kernel gives every token
        raise ConfigError(key, f"masks the policy term by entropy, which TRL does to its entropy bonus too and the "
                               f"fused loss cannot: set trainer.entropy_coef 0 (got {t.entropy_coef}) or quantile 1")
    _keep_kl_out_of_masked_advantages(t, key, "a token's", "quantile 1")


def check_off_policy_mask(t) -> None:
    """TRL's off-policy sequence masking: a threshold > 0 (a mean KL of k1 estimates can be negative, but TRL asks
    for a positive delta); it drops policy terms by zeroing their advantages, as the entropy mask does."""
    delta, key = t.off_policy_mask_threshold, "trainer.off_policy_mask_threshold"
    if delta is None:
        return
    if not delta > 0:  # NaN too
        raise ConfigError(key, f"must be > 0 (the mean per-token KL above which a negative-advantage completion "
                               f"leaves the policy loss; e.g. 0.5) or null, got {delta}")
    _keep_kl_out_of_masked_advantages(t, key, "a completion's", "leave off_policy_mask_threshold unset")


def _keep_kl_out_of_masked_advantages(t, key: str, whose: str, off: str) -> None:
    """A mask that drops policy terms by zeroing advantages would zero the KL too where trainer.kl_in_reward puts it
    in them (TRL keeps the KL of a masked token)."""
    if t.kl_in_reward and t.kl_coef != 0.0:
        raise ConfigError(key, f"drops {whose} policy term by zeroing its advantage, which with trainer.kl_in_reward "
                               f"holds {whose.replace('a ', 'the ', 1)} KL too (TRL keeps it): set kl_in_reward false "
                               f"(the KL in the loss) or {off}")


def check_advantage_scaling(t) -> None:
    """TIS weights, the entropy mask and the off-policy mask act through the advantages: refused with a policy loss
    that does not scale with them (``PolicyLoss.scales_with_advantage``: Clip-Cov, KL-Cov)."""
    check_off_policy_mask(t)
    on = [key for key, is_set in (("trainer.tis_cap", t.tis_cap is not None),
                                  ("trainer.top_entropy_quantile", t.top_entropy_quantile < 1.0),
                                  ("trainer.off_policy_mask_threshold", t.off_policy_mask_threshold is not None))
          if is_set]
    if not on or t.policy_loss == "vanilla":
        return
    from fastrlhf.algorithms import POLICY_LOSSES

    loss = POLICY_LOSSES.get(t.policy_loss)
    if loss is not None and not loss.scales_with_advantage:
        raise ConfigError(on[0], f"acts on each token's policy term through its advantage, which policy loss "
                                 f"{t.policy_loss} does not scale with (it picks tokens by their advantages or has a "
                                 f"term of its own): use another policy loss, or leave {on[0]} unset")


def check_kl_in_reward(c) -> None:
    """``trainer.kl_in_reward`` with an estimator that takes no token rewards (GRPO's and the other group estimators,
    which read each completion's score alone) would leave the KL in the loss, a different objective than asked for
    (an OpenRLHF ``group_norm`` run with its KL in the rewards): refused while a KL term is on."""
    t = c.trainer
    if not t.kl_in_reward or t.kl_coef == 0.0:
        return
    name = t.adv_estimator if t.adv_estimator != "auto" else ("gae" if c.algorithm == "ppo" else "grpo")
    if name == "gae":  # PPO's default takes it (and needs no torch import to say so)
        return
    from fastrlhf.algorithms import ADV_ESTIMATOR_TRAITS

    traits = ADV_ESTIMATOR_TRAITS.get(name)
    if traits is not None and not traits.takes_kl_in_reward:
        takers = sorted(n for n, tr in ADV_ESTIMATOR_TRAITS.items() if tr.takes_kl_in_reward)
        raise ConfigError("trainer.kl_in_reward", f"advantage estimator {name} takes no token rewards, so the KL would "
                                                  f"stay in the loss: set kl_in_reward false (the KL in the loss), or "
                                                  f"an estimator that takes it ({', '.join(takers)})")


def check_kl_target(t, rollout_batch: int) -> None:
    _positive(t.kl_target, "trainer.kl_target")
    _positive(t.kl_horizon, "trainer.kl_horizon")
    if t.kl_target is None:
        return
    from fastrlhf.algorithms.kl_control import KL_ERROR_CLIP

    if t.kl_horizon <= KL_ERROR_CLIP * rollout_batch:
        # One step changes the coefficient by up to KL_ERROR_CLIP x rollout_batch / kl_horizon of itself.
        raise ConfigError("trainer.kl_horizon", f"must be > {KL_ERROR_CLIP:g} x the {rollout_batch} completions of a "
                                                f"step, got {t.kl_horizon}: one step could take the coefficient to 0 "
                                                "or below")
    if t.kl_coef == 0.0:
        raise ConfigError("trainer.kl_target", "adapts trainer.kl_coef, its starting value, which is 0 (no KL term and "
                                               "no reference model); set kl_coef > 0, e.g. 0.001")


def check_filter_groups(c) -> None:
    from fastrlhf.algorithms import ADV_ESTIMATOR_TRAITS, adv_estimator_of

    name = adv_estimator_of(c)
    traits = ADV_ESTIMATOR_TRAITS.get(name)
    if traits is None or not traits.needs_groups:
        grouped = sorted(n for n, tr in ADV_ESTIMATOR_TRAITS.items() if tr.needs_groups)
        raise ConfigError("trainer.filter_groups", f"sets aside groups of equal scores, which only an estimator that "
                                                   f"compares a group's completions ignores; {name} does not (use "
                                                   f"{', '.join(grouped)})")


def check_adv_estimator(c) -> None:
    """A registered ``trainer.adv_estimator`` that the algorithm can run: values only with PPO's critic, returns
    for it to train on, groups of ``rollout.n >= 2`` where it compares completions of a prompt."""
    from fastrlhf.algorithms import ADV_ESTIMATOR_TRAITS, ADV_ESTIMATORS

    name = c.trainer.adv_estimator
    if name not in ADV_ESTIMATORS:
        raise ConfigError("trainer.adv_estimator", f"unknown advantage estimator {name!r}; registered: "
                                                   f"{', '.join(sorted(ADV_ESTIMATORS))} (or auto)")
    traits = ADV_ESTIMATOR_TRAITS[name]
    if traits.needs_values and c.algorithm != "ppo":
        raise ConfigError("trainer.adv_estimator", f"{name} needs a critic's values: algorithm ppo")
    if traits.gives_returns is False and c.algorithm == "ppo":
        raise ConfigError("trainer.adv_estimator", f"{name} gives no returns for algorithm ppo's critic to train on; "
                                                   "run it with algorithm grpo (no critic)")
    if traits.needs_groups:
        check_group_size(name, c.rollout.n)


def check_group_size(estimator: str, n: int) -> None:
    if n < 2:
        raise ConfigError("rollout.n", f"{estimator} compares completions within a group and needs rollout.n >= 2, "
                                       f"got {n}")
