"""The critic-free estimators besides GRPO: RLOO's leave-one-out baseline, REINFORCE++'s discounted returns whitened
over the batch (and its group-baseline variant), hand-computed; the traits the config checks read."""

from types import SimpleNamespace

import pytest
import torch

from fastrlhf.algorithms import (
    ADV_ESTIMATOR_TRAITS,
    ADV_ESTIMATORS,
    adv_estimator_of,
    compute_rloo_advantages,
    discounted_returns,
    kl_in_reward,
    kl_penalty,
    masked_whiten,
)


def test_rloo_is_each_score_less_the_mean_of_the_others():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 4.0])
    groups = [0, 0, 0, 0, 1, 2, 2]
    adv = compute_rloo_advantages(scores, groups)
    # 1 - (0 + 0 + 1) / 3; 0 - (1 + 0 + 1) / 3; a group of one: 0; 2 - 4 and 4 - 2.
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, -2.0, 2.0]))
    assert compute_rloo_advantages(scores.double(), groups).dtype == torch.float64
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_rloo_advantages(scores, groups[:-1])


def test_discounted_returns_skip_masked_tokens_as_gae_does():
    rewards = torch.tensor([[0.5, 9.0, 0.0, 2.0, 7.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]])  # position 1: a tool's output; 4: padding
    gamma = 0.5
    # Kept tokens 0, 2, 3: G3 = 2, G2 = 0 + 0.5 * 2 = 1, G0 = 0.5 + 0.5 * 1 = 1; masked positions 0.
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), torch.tensor([[1.0, 0.0, 1.0, 2.0, 0.0]]))


def experience(scores, groups, mask, old, ref):
    return SimpleNamespace(scores=scores, group_ids=torch.tensor(groups), response_mask=mask, old_logprobs=old,
                           ref_logprobs=ref)


def trainer(**over):
    base = dict(kl_in_reward=False, kl_coef=0.1, kl_kind="k1", gamma=1.0, whiten_advantages=True, scale_by_std=True)
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize("baseline", [False, True], ids=["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("kl", [False, True], ids=["kl-in-loss", "kl-in-reward"])
def test_reinforce_pp_by_hand(baseline, kl):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    old, ref = torch.randn(4, 3, generator=g) * mask, torch.randn(4, 3, generator=g) * mask
    scores, groups = torch.tensor([1.0, 0.0, 3.0, 1.0]), [0, 0, 1, 1]
    cfg = trainer(kl_in_reward=kl, gamma=0.9)
    name = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
    adv, returns = ADV_ESTIMATORS[name](experience(scores, groups, mask, old, ref), cfg)
    assert returns is None
    base = scores - torch.tensor([0.5, 0.5, 2.0, 2.0]) if baseline else scores
    kl_tokens = kl_penalty(old, ref, "k1") * mask
    want = torch.zeros(4, 3)
    for b in range(4):
        n = int(mask[b].sum())
        for t in range(n):
            reward = [(base[b] if s == n - 1 else 0.0) - (0.1 * kl_tokens[b, s] if kl else 0.0) for s in range(n)]
            want[b, t] = sum(0.9 ** (s - t) * reward[s] for s in range(t, n))
    torch.testing.assert_close(adv, masked_whiten(want, mask))
    raw, _ = ADV_ESTIMATORS[name](experience(scores, groups, mask, old, ref), trainer(kl_in_reward=kl, gamma=0.9,
                                                                                      whiten_advantages=False))
    torch.testing.assert_close(raw, want)


def test_traits_say_what_each_estimator_needs_and_where_the_kl_goes():
    t = ADV_ESTIMATOR_TRAITS
    assert t["gae"].needs_values and t["gae"].gives_returns and t["gae"].takes_kl_in_reward
    assert not any(t[n].needs_values or t[n].gives_returns for n in ("grpo", "rloo", "reinforce_plus_plus"))
    assert [n for n in sorted(t) if t[n].needs_groups] == ["gpg", "grpo", "grpo_passk", "opo",
                                                            "reinforce_plus_plus_baseline", "rloo"]

    def config(algorithm, estimator, in_reward):
        return SimpleNamespace(algorithm=algorithm, trainer=SimpleNamespace(adv_estimator=estimator,
                                                                            kl_in_reward=in_reward))

    assert adv_estimator_of(config("ppo", "auto", True)) == "gae"
    assert adv_estimator_of(config("grpo", "rloo", False)) == "rloo"
    assert kl_in_reward(config("ppo", "auto", True)) and kl_in_reward(config("grpo", "reinforce_plus_plus", True))
    assert not kl_in_reward(config("grpo", "auto", True))  # GRPO's KL is always in the loss
    assert not kl_in_reward(config("grpo", "rloo", True)) and not kl_in_reward(config("ppo", "auto", False))
