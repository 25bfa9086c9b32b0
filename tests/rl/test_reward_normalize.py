"""``reward.normalize``: training scores normalised by the running moments of every score seen so far, every rank's
(fastrlhf/rl/reward_norm.py), before the clip; validation scores as scored; the moments kept across ``--resume``."""

import dataclasses
import math
import subprocess

import pytest
import torch
from helpers.launch import spawn_ranks
from helpers.rewardnorm_ranks import normalize_rank, rank_batches

from fastrlhf.config import RewardConfig, load_config
from fastrlhf.rl.reward_norm import RunningMoments

RAW = torch.tensor([0.0, 1.0, 4.0, 1.0, 2.0, 0.0])  # a batch's scores: 2 prompts x 3 completions


class TRLRunningMoments:
    """TRL's ``RunningMoments.update`` (trl/trainer/utils.py, from MOSS-RLHF's utils.py) on one process, and the
    normalisation TRL's PPOTrainer.step applies with ``use_score_scaling`` and ``use_score_norm``, written out."""

    def __init__(self):
        self.mean, self.std, self.var, self.count = 0, 1, 1, 1e-24

    def update(self, xs):
        xs_count = xs.numel()
        xs_var, xs_mean = torch.var_mean(xs, unbiased=False)
        xs_mean, xs_var = xs_mean.float(), xs_var.float()
        delta = xs_mean - self.mean
        tot_count = self.count + xs_count
        new_sum = xs_var * xs_count
        old_sum = self.var * self.count + delta**2 * self.count * xs_count / tot_count
        tot_sum = old_sum + new_sum
        self.mean += (delta * xs_count / tot_count).item()
        new_var = tot_sum / tot_count
        self.std = (new_var * tot_count / (tot_count - 1)).float().sqrt().item()
        self.var = new_var.item()
        self.count = tot_count

    def normalize(self, scores):
        self.update(scores)
        factor = torch.tensor(self.std, dtype=scores.dtype) + torch.finfo(scores.dtype).eps
        return (scores - torch.tensor(self.mean, dtype=scores.dtype)) / factor


def _batches():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(n, generator=g) * s + m
        for n, s, m in ((8, 1.0, 0.0), (5, 3.0, 2.0), (16, 0.5, -1.0), (2, 10.0, 4.0))
    ]


def test_the_moments_and_normalised_scores_are_trls_running_moments_over_several_batches():
    ours, trl = RunningMoments(), TRLRunningMoments()
    for batch in _batches():
        torch.testing.assert_close(ours.normalize(batch), trl.normalize(batch), rtol=1e-5, atol=1e-5)
        assert ours.mean.dtype == ours.var.dtype == ours.count.dtype == torch.float64
        assert ours.mean.item() == pytest.approx(trl.mean, rel=1e-6)
        assert ours.var.item() == pytest.approx(trl.var, rel=1e-6)
        assert ours.std.item() == pytest.approx(trl.std, rel=1e-6)
        assert ours.count.item() == trl.count
    # Every score seen so far, with the mean subtracted and the unbiased deviation: the plain statistics of them all.
    seen = torch.cat(_batches()).double()
    assert ours.mean.item() == pytest.approx(seen.mean().item(), rel=1e-9)
    assert ours.std.item() == pytest.approx(seen.std().item(), rel=1e-9)


def test_a_non_finite_score_stays_non_finite_and_leaves_the_moments_as_its_batch_finite_scores_make_them():
    with_nan, finite = RunningMoments(), RunningMoments()
    batch = torch.tensor([1.0, float("nan"), 3.0, float("inf"), 2.0])
    out = with_nan.normalize(batch)
    finite.update(torch.tensor([1.0, 3.0, 2.0]))
    assert math.isnan(out[1]) and not math.isfinite(out[3]) and torch.isfinite(out[[0, 2, 4]]).all()
    for name in ("mean", "var", "count"):
        assert getattr(with_nan, name).item() == getattr(finite, name).item(), name
    # A batch with no finite score changes nothing (the next step's scores are not divided by a NaN deviation).
    before = with_nan.state_dict()
    with_nan.update(torch.tensor([float("nan")] * 3))
    assert all(torch.equal(before[k], v) for k, v in with_nan.state_dict().items())


def test_the_restored_moments_normalise_the_next_batches_as_the_uninterrupted_ones():
    straight, batches = RunningMoments(), _batches()
    for batch in batches[:2]:
        straight.normalize(batch)
    state = straight.state_dict()
    assert all(v.dtype == torch.float64 and v.device.type == "cpu" for v in state.values())
    restored = RunningMoments()
    restored.load_state_dict(state)
    for batch in batches[2:]:
        assert torch.equal(restored.normalize(batch), straight.normalize(batch))


def test_two_gloo_ranks_agree_on_moments_of_every_ranks_scores():
    """Each rank normalises its own batches (different sizes, one NaN) by the moments of both ranks' scores: the
    two hold the same moments, those of one process fed both ranks' finite scores batch by batch."""
    out = spawn_ranks(normalize_rank)
    reference = RunningMoments()
    for i in range(3):
        both = torch.cat([rank_batches(0)[i], rank_batches(1)[i]])
        expected = reference.normalize(both)
        state = {k: v.clone() for k, v in reference.state_dict().items()}
        for rank in (0, 1):
            normalized, moments = out[rank][i]
            for name in ("mean", "var", "count"):
                assert moments[name].item() == pytest.approx(state[name].item(), rel=1e-12), (rank, i, name)
            lo = 0 if rank == 0 else len(rank_batches(0)[i])
            torch.testing.assert_close(normalized, expected[lo : lo + len(normalized)], equal_nan=True)
    assert reference.count.item() == 3 + 5 + 2 + 6 + 1 + 4 - 1  # the NaN is no score seen


class _Rounds:
    """A rollout engine and scorer in one: each call answers 3 completions per prompt, and the scorer gives the
    batch of the next round: all-equal groups first (so ``trainer.filter_groups`` samples again), then differing."""

    def __init__(self, rounds):
        self.rounds, self.scored = rounds, []

    def generate(self, prompts, sampling):
        from fastrlhf.rollout import Completion

        return [[Completion([3 + i + j], [0.0], "stop") for j in range(3)] for i in range(len(prompts))]

    def __call__(self, exp, *rows):
        self.scored.append(self.rounds[len(self.scored) % len(self.rounds)].clone())
        return self.scored[-1]


def _step(reward, rounds=(RAW,), **trainer):
    from helpers.rl_case import GRPO, PAD, make_config, tiny_actor

    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.step import RLStep

    config = dataclasses.replace(make_config(GRPO, max_new_tokens=6, **trainer), reward=reward)
    actor, engine = tiny_actor(), _Rounds(list(rounds))
    rl = RLStep(
        config,
        actor,
        rollout=engine,
        scorer=engine,
        reference=tiny_actor().eval(),
        actor_optimizer=torch.optim.AdamW(actor.parameters()),
        pad_token_id=PAD,
        rollout_shares_actor=True,
    )
    prompts = [[5, 6], [7]]
    completions = engine.generate(prompts, None)
    return rl, (build_experience(prompts, completions, PAD), prompts, completions, [{}, {}])


def test_training_scores_are_normalised_before_the_clip_and_validation_scores_are_not():
    raw = RAW
    rl, args = _step(RewardConfig(function="unused", normalize=True, clip_range=[-1.0, 1.0]))
    validation = rl.score(*args, training=False)
    assert torch.equal(validation, raw) and rl.reward_moments.count.item() < 1  # no moment from validation
    trl = TRLRunningMoments()
    first = rl.score(*args)
    torch.testing.assert_close(first, trl.normalize(raw).clamp(-1.0, 1.0))
    clipped_first = TRLRunningMoments().normalize(raw.clamp(-1.0, 1.0)).clamp(-1.0, 1.0)
    assert not torch.allclose(first, clipped_first)  # the clip comes after: the 4 counts in the moments as a 4
    torch.testing.assert_close(rl.score(*args), trl.normalize(raw).clamp(-1.0, 1.0))
    assert rl.reward_moments.count.item() == 12
    assert torch.equal(rl.score(*args, training=False), raw)
    off, _ = _step(RewardConfig(function="unused"))
    assert off.reward_moments is None and torch.equal(off.score(*args), raw)


def test_under_filter_groups_every_rounds_scored_batch_updates_the_moments_once():
    """Each sampling round's scores are normalised as a step's batch is (the moments updated with them first): the
    moments hold every scored completion once, the filtered-out groups' included (they are the scorer's scores
    of the policy's samples as much as the kept ones), and the kept groups are those without normalisation."""
    from fastrlhf.rl.step_metrics import StepClock

    equal, differing = torch.tensor([1.0, 1.0, 1.0, 3.0, 3.0, 3.0]), RAW
    reward = RewardConfig(function="unused", normalize=True)
    rl, (_, prompts, _, metas) = _step(
        reward, (equal, differing), filter_groups=True, max_sampling_rounds=3, prompts_per_step=2, n=3
    )
    sampled = rl.sample_differing_groups(prompts, metas, 1, lambda: (prompts, metas), StepClock(rl.device))
    assert sampled.metrics["sampling/rounds"] == 2.0 and sampled.rows == list(range(6, 12))  # round 2's groups
    assert rl.reward_moments.count.item() == 12  # two rounds of 6, each once
    trl = TRLRunningMoments()
    trl.normalize(equal)
    torch.testing.assert_close(sampled.scores, trl.normalize(differing))  # by the moments of both rounds
    assert rl.reward_moments.mean.item() == pytest.approx(trl.mean) and rl.reward_moments.std.item() == pytest.approx(
        trl.std, rel=1e-6
    )


def test_reward_normalize_is_accepted_through_the_command_line(tmp_path):
    from helpers.rl_runs import grpo_config, make_tiny

    path = grpo_config(make_tiny(tmp_path), tmp_path / "out")
    assert load_config(path).reward.normalize is False
    assert load_config(path, overrides=["reward.normalize=true"]).reward.normalize is True


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_run_with_reward_normalize_resumes_with_the_same_normalised_scores(tmp_path):
    """GRPO with ``--set reward.normalize=true`` killed mid-step 3 (after the step-2 checkpoint): the resumed run's
    step 3 and 4 scores (reward_mean and reward_std: the normalised ones) equal the uninterrupted run's, as only
    the checkpointed moments of steps 1-2 make them."""
    from helpers.rl_runs import TRAIN, assert_resumed_like_straight, grpo_config, launch_env, make_tiny

    tiny = make_tiny(tmp_path)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    env = launch_env()
    flags = ["--set", "reward.normalize=true"]
    for out, extra, code in (
        (straight, {}, 0),
        (killed, {"FASTRLHF_TEST_KILL_ONCE": str(killed / "checkpoints" / "latest")}, -9),
    ):
        cmd = [*TRAIN, grpo_config(tiny, out, reward="kill_reward:reward"), *flags]
        result = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert result.returncode == code, result.stderr[-3000:]
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step-2"
    state = torch.load(killed / "checkpoints" / "step-2" / "rank-0.pt", weights_only=False)["objects"]
    assert state["reward_moments"]["count"].item() == 8  # two steps of 2 prompts x 2 completions
    cmd = [*TRAIN, grpo_config(tiny, killed, reward="kill_reward:reward"), *flags, "--resume"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed_like_straight(straight, killed, ["reward_mean", "reward_std", "policy_loss"])
