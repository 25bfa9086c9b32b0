"""``trainer.top_entropy_quantile`` ("Beyond the 80/20 Rule"): the tokens kept are TRL's, the threshold is one over
every rank's tokens, a GRPO step gives the dropped tokens no policy gradient, and the config checks name the key."""

import pytest
import torch
from helpers.entropy_mask_ranks import rank_batch, threshold_rank
from helpers.launch import spawn_ranks
from helpers.model_folders import fake_train_raw
from helpers.rl_case import PAD, PROMPTS, SCORES, FixedScorer, fixed_completions, make_config, tiny_actor

from fastrlhf.config import ConfigError, parse_config
from fastrlhf.rl.entropy_mask import high_entropy_mask
from fastrlhf.rl.step import RLStep, skips_old_logprobs


def trl_high_entropy_mask(entropies, mask, threshold, gather=lambda local: local):
    """TRL's ``GRPOTrainer.get_high_entropy_mask`` (huggingface/trl, trl/trainer/grpo_trainer.py at commit
    f2cd57710ae345ea6428ae95363267fcf38a3dc8), written out; ``gather`` stands for its
    ``accelerator.pad_across_processes`` + ``accelerator.gather`` (the identity on one process). TRL calls it with
    ``threshold = 1 - top_entropy_quantile``."""
    local = entropies[mask.bool()].float()
    pad_value = -1e9
    gathered = gather(local)
    gathered = gathered[gathered != pad_value]
    if gathered.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(gathered, threshold)
    masked_entropies = entropies * mask.float()
    entropy_mask = masked_entropies >= entropy_threshold
    return entropy_mask & mask.bool()


def random_cases(count=200):
    g = torch.Generator().manual_seed(7)
    for case in range(count):
        rows, width = (int(torch.randint(1, 7, (1,), generator=g)) for _ in range(2))
        entropy = torch.rand(rows, width, generator=g) * 4
        if case % 3 == 0:  # ties at the threshold
            entropy = entropy.round()
        mask = (torch.rand(rows, width, generator=g) > 0.4).float()
        if case % 17 == 0:
            mask.zero_()  # no trained token at all
        quantile = 1.0 if case % 11 == 0 else 0.01 + 0.98 * float(torch.rand(1, generator=g))
        yield entropy, mask, quantile


def test_the_kept_tokens_are_trls():
    for entropy, mask, quantile in random_cases():
        keep, metrics = high_entropy_mask(entropy, mask, quantile)
        expected = trl_high_entropy_mask(entropy, mask, 1 - quantile)
        assert torch.equal(keep, expected), (entropy, mask, quantile)
        assert float(metrics["entropy_kept_fraction"]) == pytest.approx(int(expected.sum()) / max(int(mask.sum()), 1))
        if mask.sum():
            assert metrics["entropy_threshold"] == torch.quantile(entropy[mask.bool()], 1 - quantile)


def test_two_ranks_share_the_threshold_of_all_their_tokens():
    """Rank 0 holds low entropies, rank 1 high ones, in batches of other shapes: each keeps its tokens at or above
    the quantile of both ranks' tokens together (TRL's gathered one), not of its own."""
    out = spawn_ranks(threshold_rank)
    batches = [rank_batch(rank) for rank in (0, 1)]
    both = torch.cat([e[m.bool()] for e, m in batches])
    threshold = torch.quantile(both, 0.8)
    assert out[0][1] == out[1][1] == threshold
    for rank, (entropy, mask) in enumerate(batches):
        expected = trl_high_entropy_mask(entropy, mask, 0.8, gather=lambda _local: both)
        assert torch.equal(out[rank][0], expected), rank
        alone, _ = high_entropy_mask(entropy, mask, 0.2)
        assert not torch.equal(alone, expected)  # its own quantile would keep other tokens
    kept = sum(int(out[rank][0].sum()) for rank in (0, 1))
    assert out[0][2] == out[1][2] == pytest.approx(kept / both.numel())
    assert int(out[0][0].sum()) < int(out[1][0].sum())  # the low-entropy rank keeps fewer


def _spy_step(monkeypatch, **trainer):
    """A one-update GRPO step on the fixed completions (no KL, no entropy bonus: the policy term alone) whose
    old-logprob entropies and update micro-batches' hidden states (with their gradients) are recorded."""
    import fastrlhf.rl.forward as forward
    import fastrlhf.rl.step as step

    seen = {"entropy": [], "hidden": []}
    real_logprobs, real_hidden = step.sequence_logprobs, forward.response_hidden

    def logprobs(model, exp, **kwargs):
        lp, ent = real_logprobs(model, exp, **kwargs)
        seen["entropy"].append((exp.batch_size, ent.clone()))
        return lp, ent

    def hidden(model, mb):
        h = real_hidden(model, mb)
        if h.requires_grad:
            h.retain_grad()
            seen["hidden"].append((h, mb))
        return h

    monkeypatch.setattr(step, "sequence_logprobs", logprobs)
    monkeypatch.setattr(forward, "response_hidden", hidden)
    config = make_config(
        dict(
            algorithm="grpo",
            n=4,
            prompts_per_step=3,
            temperature=1.0,
            minibatch_size=12,
            grad_accum=1,
            ppo_epochs=1,
            kl_coef=0.0,
            entropy_coef=0.0,
            **trainer,
        )
    )
    actor = tiny_actor()
    rl = RLStep(
        config,
        actor,
        rollout=None,
        scorer=FixedScorer(SCORES),
        pad_token_id=PAD,
        rollout_shares_actor=True,
        actor_optimizer=torch.optim.SGD(actor.parameters(), lr=0.0),
    )
    completions = fixed_completions(tiny_actor().eval(), 1.0)
    metrics = rl(PROMPTS, None, step=1, completions=completions)
    assert metrics["optimizer_steps"] == 1.0 and metrics["skipped"] == 0.0
    return seen, metrics


def _token_gradients(seen, exp_rows):
    """``(grad_norm, trained, row)`` of every token the update saw: its hidden state's gradient norm, whether it
    is trained, and its row in the step's batch (found by its engine logprobs)."""
    out = []
    for h, mb in seen["hidden"]:
        e = mb.exp
        norms = h.grad.norm(dim=-1)
        for r in range(e.batch_size):
            width = e.response_width
            row = next(b for b in range(exp_rows.shape[0]) if torch.equal(exp_rows[b, :width], e.engine_logprobs[r]))
            for t in range(width):
                out.append((float(norms[r, t]), bool(e.response_mask[r, t] > 0), row, t))
    return out


@pytest.mark.parametrize(
    "fused, old_logprobs", [(True, "auto"), (False, "auto"), (True, "recompute")], ids=["fused", "unfused", "recompute"]
)
def test_a_grpo_step_trains_the_high_entropy_tokens_alone(monkeypatch, fused, old_logprobs):
    """q = 0.2 on an on-policy step (``old_logprobs: auto`` would skip the old pass): the pass runs over the whole
    batch, and the tokens below its entropy threshold get no gradient at all while the kept ones do."""
    from fastrlhf.rl.experience import build_experience

    seen, metrics = _spy_step(monkeypatch, top_entropy_quantile=0.2, fused_loss=fused, old_logprobs=old_logprobs)
    exp = build_experience(PROMPTS, fixed_completions(tiny_actor().eval(), 1.0), PAD)
    full = [ent for rows, ent in seen["entropy"] if rows == exp.batch_size]
    assert len(full) == 1, "the old-logprob pass over the whole batch did not run"
    keep = trl_high_entropy_mask(full[0], exp.response_mask, 0.8)
    tokens = _token_gradients(seen, exp.engine_logprobs)
    trained = [(g, keep[row, t]) for g, is_trained, row, t in tokens if is_trained]
    assert len(trained) == int(exp.response_mask.sum())
    dropped = [g for g, kept in trained if not kept]
    assert dropped and max(dropped) == 0.0  # no policy gradient (nor any other) at a dropped token
    assert min(g for g, kept in trained if kept) > 0.0
    assert metrics["entropy_kept_fraction"] == pytest.approx(float(keep.sum() / exp.response_mask.sum()))
    assert 0.2 <= metrics["entropy_kept_fraction"] < 0.5
    on_policy = make_config(dict(minibatch_size=12, n=4, prompts_per_step=3), old_logprobs=old_logprobs)
    assert skips_old_logprobs(on_policy) == (old_logprobs == "auto")  # without the quantile
    with_quantile = make_config(dict(minibatch_size=12, n=4, prompts_per_step=3), top_entropy_quantile=0.2)
    assert not skips_old_logprobs(with_quantile)


def test_the_whole_quantile_trains_every_token(monkeypatch):
    """q = 1 (the default): the old pass is skipped on-policy and every trained token has a gradient."""
    seen, metrics = _spy_step(monkeypatch)
    assert "entropy_kept_fraction" not in metrics
    exp_rows = fixed_completions(tiny_actor().eval(), 1.0)
    from fastrlhf.rl.experience import build_experience

    exp = build_experience(PROMPTS, exp_rows, PAD)
    assert all(rows < exp.batch_size for rows, _ in seen["entropy"])  # the mismatch probe only
    trained = [g for g, is_trained, _, _ in _token_gradients(seen, exp.engine_logprobs) if is_trained]
    assert len(trained) == int(exp.response_mask.sum()) and min(trained) > 0.0


def test_the_mask_zeroes_the_policy_term_only_and_keeps_the_denominator(monkeypatch):
    """With a KL term (k3, as TRL's): a dropped token still has the KL gradient, and the loss is divided by every
    trained token (TRL divides by the completion mask, not the kept tokens)."""
    import fastrlhf.rl.entropy_mask as entropy_mask
    from fastrlhf.algorithms import aggregate_loss
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.forward import policy_loss_from_model

    config = make_config(
        dict(
            algorithm="grpo",
            n=4,
            prompts_per_step=3,
            temperature=1.0,
            minibatch_size=12,
            kl_coef=0.5,
            kl_kind="k3",
            agg="token-mean",
            top_entropy_quantile=0.2,
        )
    )
    actor, reference = tiny_actor(), tiny_actor(seed=4).eval()
    exp = build_experience(PROMPTS, fixed_completions(tiny_actor().eval(), 1.0), PAD)
    exp.advantages = torch.linspace(-1, 1, exp.batch_size)[:, None] * exp.response_mask
    from fastrlhf.rl.forward import sequence_logprobs

    exp.old_logprobs, exp.entropy = sequence_logprobs(actor, exp)
    exp.ref_logprobs, _ = sequence_logprobs(reference, exp)
    entropy = exp.entropy.clone()
    entropy_mask.keep_high_entropy_tokens(exp, 0.2)
    keep = trl_high_entropy_mask(entropy, exp.response_mask, 0.8)
    assert exp.entropy is None
    assert torch.equal(exp.advantages != 0, keep & (torch.linspace(-1, 1, exp.batch_size)[:, None] != 0))
    loss, _ = policy_loss_from_model(actor, exp, config)
    # TRL's per-token loss: the policy term masked, the KL term not, over every completion token (token-mean).
    lp, _ = sequence_logprobs(actor, exp)
    kl = torch.exp(exp.ref_logprobs - lp) - (exp.ref_logprobs - lp) - 1
    per_token = -exp.advantages * keep + 0.5 * kl
    expected = aggregate_loss(per_token, exp.response_mask, config.trainer.agg)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture
def raw_config(tmp_path):
    return lambda **trainer: fake_train_raw(tmp_path, **{"max_steps": 10, "minibatch_size": 8, **trainer})


@pytest.mark.parametrize("quantile", [0.0, -0.1, 1.5])
def test_a_quantile_outside_0_1_names_the_key(raw_config, quantile):
    with pytest.raises(ConfigError) as info:
        parse_config(raw_config(top_entropy_quantile=quantile))
    message = str(info.value)
    assert info.value.key == "trainer.top_entropy_quantile" and "\n" not in message
    assert message.startswith("trainer.top_entropy_quantile: must be in (0, 1]"), message


def test_the_entropy_bonus_with_a_quantile_is_refused(raw_config):
    with pytest.raises(ConfigError) as info:
        parse_config(raw_config(top_entropy_quantile=0.2, entropy_coef=0.01))
    assert info.value.key == "trainer.top_entropy_quantile" and "trainer.entropy_coef 0" in str(info.value)
    assert parse_config(raw_config(top_entropy_quantile=0.2)).trainer.top_entropy_quantile == 0.2
    assert parse_config(raw_config(top_entropy_quantile=1.0, entropy_coef=0.01)).trainer.entropy_coef == 0.01


def test_a_policy_loss_that_does_not_scale_with_its_advantages_is_refused(raw_config, monkeypatch):
    """The mask zeroes advantages: a loss with a term beside the advantage's (KL-Cov's ``|logprob - old|``
    penalty) or picks by advantage (Clip-Cov) would still train the dropped tokens or pick others, so it is
    refused (``PolicyLoss.scales_with_advantage``); the losses that scale pass."""
    from fastrlhf.algorithms import POLICY_LOSSES
    from fastrlhf.algorithms.losses import PolicyLoss

    def penalised(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None):
        ratio = torch.exp(logprobs - old_logprobs)
        return -advantages * ratio + (logprobs - old_logprobs).abs(), torch.zeros_like(ratio, dtype=torch.bool)

    monkeypatch.setitem(POLICY_LOSSES, "entropy7_penalised", PolicyLoss(penalised, False, False))
    for name in ("entropy7_penalised", "kl_cov", "clip_cov"):
        with pytest.raises(ConfigError) as info:
            parse_config(raw_config(top_entropy_quantile=0.2, policy_loss=name))
        assert info.value.key == "trainer.top_entropy_quantile"
        assert f"which policy loss {name} does not scale with" in str(info.value)
    assert parse_config(raw_config(policy_loss="entropy7_penalised")).trainer.top_entropy_quantile == 1.0
    for name in ("vanilla", "cispo", "gspo", "sapo", "gpg"):
        parse_config(raw_config(top_entropy_quantile=0.2, policy_loss=name))
