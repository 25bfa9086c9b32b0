"""DAPO's techniques beside the loss's clip-higher: dynamic sampling (``trainer.filter_groups``: groups whose
completions all scored the same are set aside and more prompts generated), the soft overlong punishment
(``reward.overlong_buffer``) and overlong filtering (``trainer.mask_truncated_completions``: completions cut at
the cap train nothing).

The dynamic-sampling step is checked against the plain step on the groups it should have kept: the same updated
parameters, bit for bit."""

import copy
import dataclasses
import datetime
import json
import math
import subprocess

import pytest
import torch
import torch.distributed as dist
from helpers.launch import spawn_ranks
from helpers.rl_case import GRPO, PAD, N, make_config, tiny_actor
from helpers.rl_runs import TRAIN, grpo_config, launch_env, make_tiny, metrics_by_step

from fastrlhf.algorithms import logprobs_from_logits, overlong_penalty
from fastrlhf.config import RewardConfig
from fastrlhf.rl.dynamic_sampling import differing_groups, pick_groups, sample_groups
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.step import RLStep
from fastrlhf.rollout import Completion

# Two rounds of three prompts (a rank's share is three groups); per prompt, the scores of its N completions.
ROUND_1 = [[5, 6, 7], [8, 9], [10, 11, 12]]
ROUND_2 = [[13, 14], [15, 16, 17], [18]]
SCORES = {(5, 6, 7): [1.0] * N, (8, 9): [0.0, 1.0, 1.0, 0.0], (10, 11, 12): [0.0] * N,
          (13, 14): [0.5, 0.5, 0.2, 0.5], (15, 16, 17): [1.0] * N, (18,): [0.0, 0.0, 0.0, 2.0]}


def completions_of(actor, prompts, temperature):
    """Fixed completions (tokens by prompt) whose engine logprobs are the actor's own plus noise, as in
    ``helpers.rl_case.fixed_completions``."""
    out = []
    for p in prompts:
        g = torch.Generator().manual_seed(sum(p))
        tokens = [torch.randint(3, 96, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(N)]
        out.append([Completion(t, [0.0] * len(t), "stop") for t in tokens])
    exp = build_experience(prompts, out, PAD)
    with torch.no_grad():
        logits = actor(input_ids=exp.input_ids, attention_mask=exp.attention_mask,
                       position_ids=exp.position_ids).logits[:, exp.response_slice()]
        lp = logprobs_from_logits(logits, exp.labels, temperature)
    for b, c in enumerate(c for samples in out for c in samples):
        c.logprobs = (lp[b, :len(c.token_ids)] + 0.1).tolist()
    return out


class ScriptedEngine:
    """Answers each prompt with its fixed completions; records the prompts and seeds it was asked for."""

    def __init__(self, completions: dict):
        self.completions, self.calls = completions, []

    def generate(self, prompts, sampling):
        self.calls.append(([list(p) for p in prompts], sampling.seed))
        return [copy.deepcopy(self.completions[tuple(p)]) for p in prompts]


def score_by_prompt(exp, prompts, completions, metas):
    seen = {}
    out = []
    for p in prompts:
        j = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
        out.append(SCORES[tuple(p)][j])
    return torch.tensor(out)


def _step(config, engine=None):
    actor = tiny_actor()
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    rl = RLStep(config, actor, rollout=engine, scorer=score_by_prompt, reference=tiny_actor().eval(),
                actor_optimizer=opt, pad_token_id=PAD, rollout_shares_actor=True)
    return rl, actor


def _engine(config):
    prompts = ROUND_1 + ROUND_2
    completions = completions_of(tiny_actor(), prompts, config.rollout.temperature)
    return ScriptedEngine({tuple(p): c for p, c in zip(prompts, completions, strict=True)})


def test_groups_differ_unless_every_score_is_the_same_and_finite():
    assert differing_groups([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, float("nan"), float("nan")], 2) == [False, True, False,
                                                                                                True]
    with pytest.raises(ValueError, match="5 scores do not split into groups of 2"):
        differing_groups([0.0] * 5, 2)


def test_the_first_differing_groups_are_kept_in_draw_order_and_equal_ones_fill_the_rest():
    assert pick_groups([False, True, False, True, True, True], 3) == ([1, 3, 4], 0)
    assert pick_groups([False, True, False, False, True], 3) == ([0, 1, 4], 1)
    assert pick_groups([False, False], 2) == ([0, 1], 2)
    with pytest.raises(ValueError, match="1 groups cannot fill a share of 2"):
        pick_groups([True], 2)


def test_the_filtered_step_trains_exactly_the_plain_step_on_the_kept_groups():
    config = make_config(GRPO, filter_groups=True)
    engine = _engine(config)
    filtered, actor = _step(config, engine)
    draws = iter([(ROUND_2, [{}] * 3)])
    metrics = filtered(ROUND_1, None, step=2, more_prompts=lambda: next(draws))
    # Round 1 has one group that differs ([8, 9]), round 2 two: three, a full share, after two rounds.
    assert [prompts for prompts, _ in engine.calls] == [ROUND_1, ROUND_2]
    assert engine.calls[0][1] != engine.calls[1][1]  # each round samples with its own seed
    kept = [[8, 9], [13, 14], [18]]

    plain, plain_actor = _step(dataclasses.replace(config, trainer=dataclasses.replace(config.trainer,
                                                                                         filter_groups=False)))
    expected = plain(kept, None, step=2, completions=[copy.deepcopy(engine.completions[tuple(p)]) for p in kept])
    for a, b in zip(actor.parameters(), plain_actor.parameters(), strict=True):
        assert torch.equal(a, b)
    for key in ("policy_loss", "reward_mean", "reward_std", "advantage_mean", "mean_response_length"):
        assert metrics[key] == expected[key], key
    everything = [s for p in ROUND_1 + ROUND_2 for s in SCORES[tuple(p)]]
    assert metrics["sampling/rounds"] == 2.0 and metrics["sampling/filled_fraction"] == 0.0
    assert metrics["sampling/differing_fraction"] == pytest.approx(3 / 6)
    assert metrics["sampling/reward_mean"] == pytest.approx(sum(everything) / len(everything))
    # Tokens generated in both rounds, the set-aside groups' included.
    assert metrics["generated_tokens"] == sum(len(c.token_ids) for c in engine.completions.values() for c in c)
    assert metrics["generated_tokens"] > expected["generated_tokens"] == metrics["mean_response_length"] * 12


class SpacedIds:
    """A tokenizer stand-in for text rewards: ids as space-separated numbers."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row)) for row in ids]


def test_text_rewards_are_logged_over_the_kept_groups_as_reward_mean_is():
    from fastrlhf.rl.rewards import RewardScorer, TextReward

    def by_prompt(prompts, completions, completion_ids, **_):
        seen, out = {}, []
        for text in prompts:
            p = tuple(map(int, text.split()))
            j = seen[p] = seen.get(p, -1) + 1
            out.append(None if p == (15, 16, 17) else SCORES[p][j])  # not applicable there (an all-equal group)
        return out

    config = make_config(GRPO, filter_groups=True)
    engine = _engine(config)
    actor = tiny_actor()
    scorer = RewardScorer(text_rewards=[TextReward("by_prompt", by_prompt)], tokenizer=SpacedIds(),
                          reward_format="text")
    rl = RLStep(config, actor, rollout=engine, scorer=scorer, reference=tiny_actor().eval(),
                actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-2), pad_token_id=PAD,
                rollout_shares_actor=True)
    draws = iter([(ROUND_2, [{}] * 3)])
    metrics = rl(ROUND_1, None, step=2, more_prompts=lambda: next(draws))
    kept = SCORES[(8, 9)] + SCORES[(13, 14)] + SCORES[(18,)]  # the groups that differ, as above
    assert metrics["reward/by_prompt"] == pytest.approx(sum(kept) / 12) == metrics["reward_mean"]
    last_round = SCORES[(13, 14)] + SCORES[(18,)]  # what the scorer saw last (its applicable rows)
    assert scorer.metrics["reward/by_prompt"] == pytest.approx(sum(last_round) / 8) != metrics["reward/by_prompt"]


def test_after_the_last_round_groups_of_equal_scores_fill_the_share():
    config = make_config(GRPO, filter_groups=True, max_sampling_rounds=2)
    engine = _engine(config)
    rl, _ = _step(config, engine)
    # Round 1: [18] differs; round 2: [8, 9]; the cap of two rounds stops there, and the first all-equal group
    # drawn ([15, 16, 17]) fills the share, in its place in draw order.
    draws = iter([(ROUND_1, [{}] * 3)])
    metrics = rl(ROUND_2[1:] + ROUND_1[:1], None, step=0, more_prompts=lambda: next(draws))
    assert len(engine.calls) == 2 and metrics["sampling/filled_fraction"] == pytest.approx(1 / 3)
    assert metrics["reward_mean"] == pytest.approx((1.0 * 4 + 2.0 + 2 * 1.0) / 12)

    engine.calls.clear()
    draws = iter([(ROUND_2[1:2] + ROUND_1[1:], [{}] * 3), (ROUND_1[2:] * 3, [{}] * 3)])
    metrics = rl(ROUND_1[:1] + ROUND_1[2:] + ROUND_2[1:2], None, step=1, more_prompts=lambda: next(draws))
    # Round 1: none differs; round 2: only [8, 9]; the cap of two rounds stops there: two all-equal groups fill in.
    assert len(engine.calls) == 2 and metrics["sampling/rounds"] == 2.0
    assert metrics["sampling/filled_fraction"] == pytest.approx(2 / 3)
    assert metrics["reward_mean"] == pytest.approx((1.0 * 4 + 0.0 * 4 + 2 * 1.0 + 2 * 0.0) / 12)


def test_without_more_prompts_or_with_given_completions_the_step_samples_once():
    config = make_config(GRPO, filter_groups=True)
    engine = _engine(config)
    rl, _ = _step(config, engine)
    metrics = rl(ROUND_1, None, step=0)
    assert len(engine.calls) == 1 and "sampling/rounds" not in metrics


def _sample_on_rank(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        def generate_and_score(prompts, metas, round_):
            # Rank 0's first round already differs everywhere; rank 1's groups differ from round 3 on.
            differ = rank == 0 or round_ >= 2
            scores = torch.tensor([float(j) if differ else 0.0 for _ in prompts for j in range(2)])
            return [[Completion([3], [0.0], "stop")] * 2 for _ in prompts], scores, 2 * len(prompts)

        draws = iter([([[round_]], [{}]) for round_ in (1, 2, 3)])
        got = sample_groups(generate_and_score, [[0]], [{}], lambda: next(draws), n=2, max_rounds=4)
        out[rank] = (got.prompts, got.metrics["sampling/rounds"], got.generated_tokens)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_rank_samples_as_many_rounds_as_the_rank_that_needs_the_most():
    result = spawn_ranks(_sample_on_rank)
    # Both ranks generate three rounds (rank 0 waits on rank 1), and each keeps its first differing group.
    assert result[0] == ([[0]], 3.0, 6.0)
    assert result[1] == ([[2]], 3.0, 6.0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_trainer_draws_the_next_prompts_for_each_round(tmp_path):
    """``fastrlhf train`` with a reward that never differs within a group: every step runs all its rounds, each on
    the sampler's next prompts, and trains on groups of equal scores."""
    tiny = make_tiny(tmp_path)
    config = grpo_config(tiny, tmp_path / "out", reward="sample_rewards:constant_logging_prompts",
                         trainer={"max_steps": 2, "save_every": 0, "save_final": False, "filter_groups": True})
    log = tmp_path / "prompts.log"
    result = subprocess.run([*TRAIN, config], env=launch_env(FASTRLHF_TEST_PROMPT_LOG=str(log)), capture_output=True,
                            text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = metrics_by_step(tmp_path / "out")
    for step in (1, 2):
        assert metrics[step]["sampling/rounds"] == 3.0 and metrics[step]["sampling/filled_fraction"] == 1.0
        assert metrics[step]["sampling/differing_fraction"] == 0.0 and metrics[step]["skipped"] == 0.0
    # 2 steps x 3 rounds x 2 prompts x 2 completions scored; the first 8 prompts drawn are one epoch: all 8.
    scored = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    assert len(scored) == 24 and scored[::2] == scored[1::2]
    assert len(set(scored[:16:2])) == 8


def test_overlong_penalty_ramps_over_the_buffer_to_the_cap():
    lengths = torch.tensor([0, 6, 7, 8, 9, 10])
    penalty = overlong_penalty(lengths, max_len=10, buffer=4, factor=0.5)
    assert penalty.tolist() == [0.0, 0.0, pytest.approx(-0.125), pytest.approx(-0.25), pytest.approx(-0.375), -0.5]


def test_the_overlong_penalty_shapes_training_scores_not_validation_scores():
    completions = completions_of(tiny_actor(), ROUND_1, 0.8)
    flat = [c for samples in completions for c in samples]
    flat[0].finish_reason = "length"
    reward = RewardConfig(function="unused", overlong_buffer=3, overlong_penalty=2.0, truncated_reward=-1.0)
    config = dataclasses.replace(make_config(GRPO, max_new_tokens=6), reward=reward)
    rl, _ = _step(config)
    exp = build_experience(ROUND_1, completions, PAD)
    raw = score_by_prompt(exp, [p for p in ROUND_1 for _ in range(N)], None, None)
    lengths = torch.tensor([float(len(c.token_ids)) for c in flat])
    expected = raw - 2.0 * ((lengths - 3).clamp(min=0) / 3)
    expected[0] = -1.0  # cut at the cap: truncated_reward replaces whatever it scored
    assert any(length > 3 for length in lengths[1:])  # the case has penalised completions that are not cut
    torch.testing.assert_close(rl.score(exp, ROUND_1, completions, [{}] * 3), expected)
    torch.testing.assert_close(rl.score_rollout(ROUND_1, completions, [{}] * 3), torch.where(
        torch.arange(len(flat)) == 0, torch.tensor(-1.0), raw))
    assert math.isfinite(float(expected.sum()))


def test_reward_clip_range_clamps_training_scores_not_validation_scores():
    """``reward.clip_range`` (OpenRLHF's --reward.clip_range): training scores clamped, before the overlong
    penalty; validation scores as scored."""
    completions = completions_of(tiny_actor(), ROUND_1, 0.8)
    exp = build_experience(ROUND_1, completions, PAD)
    raw = score_by_prompt(exp, [p for p in ROUND_1 for _ in range(N)], None, None)
    low, high = 0.25, 0.75
    assert (raw < low).any() and (raw > high).any()  # the case clamps at both ends (its scores are 0 and 1)
    reward = RewardConfig(function="unused", clip_range=[low, high])
    rl, _ = _step(dataclasses.replace(make_config(GRPO, max_new_tokens=6), reward=reward))
    torch.testing.assert_close(rl.score(exp, ROUND_1, completions, [{}] * 3), raw.clamp(low, high))
    torch.testing.assert_close(rl.score_rollout(ROUND_1, completions, [{}] * 3), raw)


# --------------------------------------------------------------------------------------------
# Overlong filtering
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "ppo", "packed",
                                 "reinforce++"])
def test_masked_truncated_completions_train_nothing(agg, monkeypatch):
    """With ``mask_truncated_completions`` the tokens of cut completions never reach the gradient: rewriting them
    (same lengths, same scores, so the same group advantages) leaves the updated parameters equal bit for bit,
    and the other rows are weighted as if the cut ones were not in the batch (token-mean: each minibatch's
    weights still sum to 1). Without it the update moves. PPO: the actor and the critic alike, its advantages
    whitened over the tokens trained (the cut rows' shifted every other row's advantage); REINFORCE++ alike, its
    KL in the reward making a cut row's returns depend on its tokens. Packed: micro-batches of at most 40 tokens,
    each one row with no padding."""
    from helpers.rl_case import PPO, PROMPTS, SCORES, FixedScorer, changed, fixed_completions, tiny_critic

    from fastrlhf.modeling import use_attention
    from fastrlhf.rl import step as step_module

    weights = []  # (weights, cut rows) of each micro-batch the actor's loss sees
    original = step_module.policy_loss_from_model
    monkeypatch.setattr(step_module, "policy_loss_from_model", lambda module, mb, config: weights.append(
        (mb.loss_weights, mb.loss_rows)) or original(module, mb, config))

    ppo = agg == "ppo"
    critics = []

    def step(completions, mask):
        packed = dict(agg="token-mean", packing=True, max_tokens_per_microbatch=40, grad_accum=1)
        reinforce = dict(adv_estimator="reinforce_plus_plus", kl_in_reward=True, whiten_advantages=True)
        hp = (make_config(PPO, whiten_advantages=True, mask_truncated_completions=mask) if ppo else
              make_config(GRPO, **reinforce, mask_truncated_completions=mask) if agg == "reinforce++" else
              make_config(GRPO, **(packed if agg == "packed" else {"agg": agg}), mask_truncated_completions=mask))
        actor, critic, reference = tiny_actor(), tiny_critic() if ppo else None, tiny_actor(seed=1).eval()
        for model in (actor, reference):
            use_attention(model, hp.trainer.packing)
        rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=reference,
                    actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-2), pad_token_id=PAD,
                    critic=critic, critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=1e-2) if ppo else None,
                    rollout_shares_actor=True)
        weights.clear()
        critics.append(critic)
        return rl(PROMPTS, None, step=1, completions=completions), actor

    completions = fixed_completions(tiny_actor(), GRPO["temperature"])
    for i, samples in enumerate(completions):
        for j, c in enumerate(samples):
            c.finish_reason = "length" if (i + j) % 3 == 0 else "stop"
    rewritten = copy.deepcopy(completions)
    g = torch.Generator().manual_seed(7)
    for samples in rewritten:
        for c in samples:
            if c.finish_reason == "length":
                c.token_ids = torch.randint(3, 96, (len(c.token_ids),), generator=g).tolist()
    (metrics, masked), (_, masked_rewritten) = step(completions, True), step(rewritten, True)
    assert metrics["truncated_fraction"] == pytest.approx(4 / 12) and metrics["skipped"] == 0
    # GRPO's case: 2 epochs x 2 minibatches of 6 rows, each in 2 micro-batches of 3 (PPO's: 3 minibatches of 4)
    assert all(rows is not None for _, rows in weights)
    for w, rows in weights:
        assert float(w[rows == 0].abs().sum()) == 0.0
    if agg in ("token-mean", "ppo"):  # per minibatch, unless all its rows were cut
        assert len(weights) == (12 if ppo else 8)
        for k in range(0, len(weights), 2):
            kept = float(weights[k][0].sum() + weights[k + 1][0].sum())
            assert kept == pytest.approx(1.0) or (kept == 0 and not weights[k][1].any() and not weights[k + 1][1].any())
    assert changed(masked, masked_rewritten) == 0.0
    if ppo:
        assert changed(critics[0], critics[1]) == 0.0
    assert changed(masked, tiny_actor()) > 1e-3  # it trained the rest
    (_, plain), (_, plain_rewritten) = step(completions, False), step(rewritten, False)
    assert changed(plain, plain_rewritten) > 1e-4


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_step_whose_completions_were_all_cut_moves_no_weight(algo):
    """Every completion cut with ``mask_truncated_completions``: the gradients are zeros, and AdamW would still
    move every weight (the momentum of the step before, and weight decay). No minibatch steps, none counts as a
    skipped step, and the actor (and PPO's critic) stay as they were, bit for bit."""
    from helpers.rl_case import PPO, PROMPTS, SCORES, FixedScorer, fixed_completions, tiny_critic

    ppo = algo == "ppo"
    hp = (make_config(PPO, whiten_advantages=False, mask_truncated_completions=True) if ppo else
          make_config(GRPO, mask_truncated_completions=True))
    actor, critic = tiny_actor(), tiny_critic() if ppo else None
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (actor, critic) if m]
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=tiny_actor(seed=1).eval(),
                actor_optimizer=optimizers[0], pad_token_id=PAD, critic=critic,
                critic_optimizer=optimizers[1] if ppo else None, rollout_shares_actor=True)
    ended = fixed_completions(tiny_actor(), GRPO["temperature"])
    for samples in ended:
        for c in samples:
            c.finish_reason = "stop"
    first = rl(PROMPTS, None, step=1, completions=ended)
    assert first["optimizer_steps"] > 0 and first["empty_minibatches"] == 0  # momentum to carry
    completions = fixed_completions(actor, GRPO["temperature"])  # the trained actor's; every one cut at the cap
    before = [copy.deepcopy(m.state_dict()) for m in (actor, critic) if m]
    metrics = rl(PROMPTS, None, step=2, completions=completions)
    assert metrics["truncated_fraction"] == 1.0 and metrics["skipped"] == 0 and metrics["optimizer_steps"] == 0
    assert metrics["empty_minibatches"] == first["optimizer_steps"]  # every minibatch of the update
    for model, state in zip((m for m in (actor, critic) if m), before, strict=True):
        for name, value in model.state_dict().items():
            assert torch.equal(value, state[name]), name
    assert rl.guard.skipped_total == 0 and rl.guard.skipped_in_row == 0


def _decide_on_rank(rank, port, out):
    from fastrlhf.engine.guards import StepGuard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        guard, decisions = StepGuard(), []
        # (rank 0's tokens, rank 1's tokens, finite) per optimizer step
        for tokens, finite in (((0, 5), True), ((0, 0), True), ((3, 0), True), ((0, 0), False)):
            guard.note_trained(torch.tensor(float(tokens[rank])))
            decisions.append((guard.should_skip(torch.tensor(finite)), guard.step_empty, guard.update_skipped,
                              guard.drops_step))
            guard.end_step()
        out[rank] = (decisions, guard.skipped_total)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_step_is_empty_only_when_no_rank_trains_a_token():
    """The ranks decide together: one rank with tokens is enough to step (its gradient is the ranks' mean); a
    step with no token anywhere is dropped as empty, not as bad; a non-finite one is bad even when empty."""
    result = spawn_ranks(_decide_on_rank)
    expected = [(False, False, False, False), (True, True, False, True), (False, False, False, False),
                (True, False, True, True)]
    assert result[0] == result[1] == (expected, 1)


def test_a_step_that_stepped_no_minibatch_syncs_nothing():
    """Every completion cut: the actor's weights are the engine's already, so no weight sync follows. With one
    completion that ended, the two minibatches (of four: two epochs of two) that hold it step, and the sync
    follows."""
    from helpers.rl_case import PROMPTS, SCORES, FixedScorer, fixed_completions

    from fastrlhf.rollout import RolloutEngine

    class Engine(RolloutEngine):
        def __init__(self, completions):
            self.completions, self.calls = completions, []

        def generate(self, prompt_token_ids, sampling):
            self.calls.append("generate")
            return copy.deepcopy(self.completions)

        def sleep(self):
            self.calls.append("sleep")

        def update_weights(self, named_tensors):
            self.calls.append("update_weights")
            list(named_tensors)

    hp = make_config(GRPO, mask_truncated_completions=True)
    cut = fixed_completions(tiny_actor(), GRPO["temperature"])  # every one cut at the cap
    one_ended = copy.deepcopy(cut)
    one_ended[0][0].finish_reason = "stop"
    for completions, steps, calls in ((cut, 0, ["generate", "sleep"]),
                                      (one_ended, 2, ["generate", "sleep", "update_weights"])):
        actor = tiny_actor()
        engine = Engine(completions)
        rl = RLStep(hp, actor, rollout=engine, scorer=FixedScorer(SCORES), reference=tiny_actor(seed=1).eval(),
                    actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-2), pad_token_id=PAD)
        metrics = rl(PROMPTS, None, step=1)
        assert metrics["optimizer_steps"] == steps and metrics["empty_minibatches"] == 4 - steps, metrics
        assert metrics["skipped"] == 0 and engine.calls == calls, metrics
