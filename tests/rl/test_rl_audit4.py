"""The RL step's update and metrics (fourth audit): the old logprobs of a one-step update, and which of the step's
metrics are means over every rank's tokens."""

from types import SimpleNamespace

import pytest
import torch
from helpers.rl_case import (
    PAD,
    PROMPTS,
    SCORES,
    FixedScorer,
    fixed_completions,
    lora_dropout_actor,
    make_config,
    tiny_actor,
)

from fastrlhf.distributed import comm
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.step import RLStep, on_policy_update, skips_old_logprobs
from fastrlhf.rl.step_metrics import reduce_step_metrics
from fastrlhf.rl.update import Minibatch

ONE_STEP = dict(algorithm="grpo", n=4, prompts_per_step=3, temperature=1.0, minibatch_size=12, ppo_epochs=1,
                kl_coef=0.0)
GSPO = dict(policy_loss="gspo", agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4)


def _dropout_actor():
    """A LoRA actor with dropout 0.05 (a common LoRA setting) and a non-zero adapter."""
    torch.manual_seed(0)
    return lora_dropout_actor(0.05)


@pytest.mark.parametrize("change", [dict(tis_cap=100.0), dict(old_logprobs="recompute")], ids=["tis", "recompute"])
def test_a_one_step_update_is_on_policy_even_when_the_old_logprobs_were_recomputed(change):
    """One optimizer step per batch: the ratio is exactly 1 (verl's ``on_policy``), also where the old logprobs
    were recomputed for TIS or asked for. They came from a dropout-free pass and the update trains with dropout:
    GSPO's 3e-4 clip clipped 27% of the tokens (no gradient) and approx_kl read 0.0034 on a step that moved nothing."""
    config = make_config(ONE_STEP, **GSPO, **change)
    assert not skips_old_logprobs(config)  # the old logprobs are recomputed
    actor = _dropout_actor()
    rl = RLStep(config, actor, rollout=None, scorer=FixedScorer(SCORES), pad_token_id=PAD, rollout_shares_actor=True,
                actor_optimizer=torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=0.0))
    metrics = rl(PROMPTS, None, step=1, completions=fixed_completions(tiny_actor().eval(), 1.0))
    assert metrics["optimizer_steps"] == 1.0 and metrics["skipped"] == 0.0
    assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == 0.0


def test_only_a_one_step_update_drops_the_old_logprobs_and_more_steps_need_them():
    exp = build_experience(PROMPTS, fixed_completions(tiny_actor().eval(), 1.0), PAD)
    exp.old_logprobs = torch.zeros_like(exp.response_mask)
    rows = torch.arange(exp.batch_size)
    one = [Minibatch(rows, [list(range(exp.batch_size))])]
    two = [Minibatch(rows[:6], [[0]]), Minibatch(rows[6:], [[0]])]
    assert on_policy_update(exp, one).old_logprobs is None
    assert on_policy_update(exp, one).loss_weights is None and exp.old_logprobs is not None  # a copy
    assert on_policy_update(exp, two) is exp
    exp.old_logprobs = None  # later minibatches would take their own logprobs as old: no clipping at all
    with pytest.raises(ValueError, match="2 optimizer steps.*trainer.minibatch_size"):
        on_policy_update(exp, two)


PER_TOKEN = ("entropy", "rollout_entropy", "loss_kl", "kl", "clipfrac", "approx_kl", "advantage_mean", "vf_clipfrac")


def test_the_updates_per_token_metrics_weigh_each_rank_by_its_tokens(monkeypatch):
    """Two ranks of 10 and 1,000 completion tokens. On-policy, ``entropy`` is ``rollout_entropy`` and ``loss_kl`` is
    ``kl`` (the same values, docs/config.md): they were logged as 1.25 (the mean of the ranks' means) beside 0.515."""

    def rank(tokens, value):
        exp = SimpleNamespace(scores=torch.zeros(1), response_mask=torch.ones(1, tokens), batch_size=1)
        return exp, {**{k: torch.tensor(value) for k in PER_TOKEN}, "policy_loss": value}

    times = {"generate": 1.0, "score": 1.0, "train": 1.0, "sync": 1.0}
    sent = []
    monkeypatch.setattr(comm, "all_reduce_", lambda t, op="sum", group=None: sent.append(t.clone()) or t)
    reduce_step_metrics(*rank(1000, 0.5), times, 1, skipped=False, skipped_total=0, world=1)
    other = sent[0]  # what the other rank puts into the collectives
    monkeypatch.setattr(comm, "all_reduce_", lambda t, op="sum", group=None: t.add_(other) if op == "sum"
                        else torch.maximum(t, other, out=t))
    metrics = reduce_step_metrics(*rank(10, 2.0), times, 1, skipped=False, skipped_total=0, world=2)
    for name in PER_TOKEN:
        assert metrics[name] == pytest.approx((2.0 * 10 + 0.5 * 1000) / 1010), name
    assert metrics["policy_loss"] == pytest.approx(1.25)  # each rank's share of the loss: their mean is the loss
