"""The RL step (fifth audit): errors every rank raises alike are said once (a custom estimator without returns, a
stale engine); a scorer's host scores reach the batch's device; an encoder reward model scores as it was trained."""

import pytest
import torch
from helpers.other_device import OtherDevice
from helpers.reward_classifiers import tiny_classifier
from helpers.rl_case import (
    GRPO,
    PAD,
    PPO,
    PROMPTS,
    SCORES,
    FixedScorer,
    fixed_completions,
    make_config,
    tiny_actor,
    tiny_critic,
)

from fastrlhf.algorithms import ADV_ESTIMATOR_TRAITS, ADV_ESTIMATORS, register_adv_est
from fastrlhf.algorithms.advantages import gae_advantages
from fastrlhf.config import ConfigError
from fastrlhf.distributed import comm
from fastrlhf.engine.guards import AgreedStepFailure
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.forward import reward_model_scores
from fastrlhf.rl.step import RLStep
from fastrlhf.rollout import Completion

NO_RETURNS = "audit5_gae_without_returns"


@pytest.fixture
def estimator_without_traits():
    """A GAE estimator that gives the critic no returns, registered without traits (the config checks cannot see it)."""

    @register_adv_est(NO_RETURNS)
    def gae_without_returns(exp, cfg):
        return gae_advantages(exp, cfg)[0], None

    yield NO_RETURNS
    ADV_ESTIMATORS.pop(NO_RETURNS)
    ADV_ESTIMATOR_TRAITS.pop(NO_RETURNS)


def test_an_estimator_without_returns_for_the_critic_is_said_once_not_once_per_rank(estimator_without_traits):
    """Every rank's estimator returns no returns at step 1: unmarked, the command line printed the ConfigError on
    each rank ('[rank 3] config error: ...', 8 times on 8 GPUs); agreed, rank 0 says it once."""
    hp = make_config(PPO, adv_estimator=estimator_without_traits)
    actor, critic = tiny_actor(), tiny_critic()
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=tiny_actor(seed=1).eval(),
                critic=critic, actor_optimizer=torch.optim.AdamW(actor.parameters()),
                critic_optimizer=torch.optim.AdamW(critic.parameters()), pad_token_id=PAD, rollout_shares_actor=True)
    with pytest.raises(ConfigError, match=f"trainer.adv_estimator: {NO_RETURNS} returns no returns") as raised:
        rl(PROMPTS, None, step=1, completions=fixed_completions(actor, hp.rollout.temperature))
    assert comm.is_agreed(raised.value)
    assert "EstimatorTraits(gives_returns=False)" in str(raised.value)  # how to have it refused at config load


def test_a_scorer_that_scores_on_the_host_trains_on_another_device():
    """RLStep takes any callable with RewardScorer's signature; one that scores on the host (as rule rewards do,
    here the fixed scores) failed on a GPU: 'expected all tensors to be on the same device' in the advantages."""
    hp = make_config(GRPO)
    actor = tiny_actor()
    completions = fixed_completions(actor, hp.rollout.temperature)
    with OtherDevice() as dev:
        actor, reference = dev.move(actor), dev.move(tiny_actor(seed=1).eval())
        rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=reference,
                    actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3), pad_token_id=PAD,
                    rollout_shares_actor=True, device=dev.device)
        metrics = rl(PROMPTS, None, step=1, completions=completions)
    assert metrics["skipped"] == 0.0 and metrics["optimizer_steps"] > 0
    assert metrics["reward_mean"] == pytest.approx(float(SCORES.double().mean()))


def test_a_stale_engine_stops_every_rank_with_one_line_not_a_traceback_each():
    """Every rank compares the same largest mismatch (reduced over ranks) and stops. A plain StepFailed escaped the
    command line's handlers: each rank printed its Python traceback (8 on 8 GPUs); an agreed failure is said once,
    as a reward function's is, and exits with 1 (--resume retries the step)."""
    hp = make_config(GRPO, max_logprob_mismatch=0.01)  # the case's engine logprobs carry 0.3 nats of noise
    actor = tiny_actor()
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=tiny_actor(seed=1).eval(),
                actor_optimizer=torch.optim.AdamW(actor.parameters()), pad_token_id=PAD, rollout_shares_actor=True)
    with pytest.raises(AgreedStepFailure, match=r"differ from the actor's by .* \(rollout.max_logprob_mismatch 0.01\)"
                       ) as raised:
        rl(PROMPTS, None, step=1, completions=fixed_completions(actor, hp.rollout.temperature))
    assert raised.value.exit_code == 1


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", ["deberta-v2", "bert", "roberta", "llama"])
def test_a_reward_model_scores_each_sequence_as_its_own_forward_does(name, packed):
    """An encoder reward model (a DeBERTa-v3 one is a popular RLHF reward model, read re-tokenized) pools the first
    token through a pooler of its own. Its 'classifier' head applied to the last token's hidden state scored
    [-0.0107, 0.0876] where the model scores [0.0043, 0.0083] (DeBERTa-v2), and RoBERTa's head raised IndexError."""
    model = tiny_classifier(name)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12]]  # left-padded to different widths
    completions = [[Completion([13, 14], [0.0] * 2, "stop")], [Completion([15, 16, 17], [0.0] * 3, "stop")],
                   [Completion([18], [0.0], "length")]]
    with torch.no_grad():
        expected = [float(model(input_ids=torch.tensor([p + c[0].token_ids])).logits[0, 0])
                    for p, c in zip(prompts, completions, strict=True)]
    if packed and name == "llama":  # a decoder runs packed rows with fastrlhf's attention, as the trainer sets it up
        from fastrlhf.modeling import use_attention

        use_attention(model, True)
    scores = reward_model_scores(model, build_experience(prompts, completions, 0), micro_batch=2, packed=packed)
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=1e-4)


def test_a_reward_function_that_fails_to_load_is_named_by_its_entry():
    """A ``reward.functions`` entry (or ``eval.reward``) that fails to load was said as ``reward.function``, the
    setting the run did not have, and without its entry."""
    from fastrlhf.config.schema import RewardFunctionConfig
    from fastrlhf.rl.rewards import resolve_reward_function, resolve_text_rewards

    with pytest.raises(ValueError, match=r"^reward.functions\[1\].function 'nosuchmod:fn': cannot import"):
        resolve_text_rewards([RewardFunctionConfig("length"), RewardFunctionConfig("nosuchmod:fn")])
    with pytest.raises(ValueError, match=r"^eval.reward 'fastrlhf.rl.rewards:nothing': module .* has no callable"):
        resolve_reward_function("fastrlhf.rl.rewards:nothing", "eval.reward")


def test_an_engine_whose_logprobs_are_nan_stops_the_run_as_a_stale_one_does():
    """``worst > limit`` is False for NaN: an engine reporting NaN logprobs (broken weights, what the check exists
    for) passed it, and the step trained on its completions. (With ``tis_cap`` the engine's logprobs weigh the loss:
    their NaN skips the step, counted, as any non-finite input does.)"""
    hp = make_config(GRPO, max_logprob_mismatch=0.01, tis_cap=None)
    actor = tiny_actor()
    completions = fixed_completions(actor, hp.rollout.temperature)
    for group in completions:
        for c in group:
            c.logprobs[:] = [float("nan")] * len(c.logprobs)
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=tiny_actor(seed=1).eval(),
                actor_optimizer=torch.optim.AdamW(actor.parameters()), pad_token_id=PAD, rollout_shares_actor=True)
    with pytest.raises(AgreedStepFailure, match=r"differ from the actor's by nan nats"):
        rl(PROMPTS, None, step=1, completions=completions)
