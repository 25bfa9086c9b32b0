"""The RL step against a hand-written, unfused, single-process version of the same step.

Both sides get the same prompts, the same fixed completions (with engine logprobs that differ from
the model's, so the truncated importance weights matter) and the same rewards. The hand-written
side pads by hand, materialises full logits, uses ``fastrlhf.algorithms`` and a plain AdamW; the
RLStep side runs the fused-linear kernels through the model body + LM head. Losses and every
updated parameter must agree.
"""

import copy
import dataclasses
import math

import pytest
import torch
from helpers.rl_case import (
    GRPO,
    PAD,
    PPO,
    PROMPTS,
    SCORES,
    FixedScorer,
    N,
    changed,
    fixed_completions,
    flat,
    guarded_step,
    lora_dropout_actor,
    make_config,
    tiny_actor,
    tiny_critic,
)

import fastrlhf.rl.step as step_module
from fastrlhf.algorithms import (
    aggregate_loss,
    aggregation_weights,
    clipped_surrogate,
    compute_gae,
    compute_grpo_advantages,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
    sapo_policy_loss,
    shape_rewards,
    value_loss,
)
from fastrlhf.config import (
    RewardConfig,
)
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.step import RLStep, skips_old_logprobs
from fastrlhf.rl.step_metrics import probe_rows
from fastrlhf.rollout import Completion

# ----------------------------------------------------------------------------------------------
# The hand-written step
# ----------------------------------------------------------------------------------------------


def hand_written_step(config, actor, ref, opt, completions, scores, step, critic=None, critic_opt=None):
    hp = flat(config)
    rows = [(i, p, c) for i, p in enumerate(PROMPTS) for c in completions[i]]
    B = len(rows)
    P = max(len(p) for _, p, _ in rows)
    T = max(len(c.token_ids) for _, _, c in rows)
    ids = torch.full((B, P + T), PAD)
    attn = torch.zeros((B, P + T), dtype=torch.long)
    mask = torch.zeros((B, T))
    engine_lp = torch.zeros((B, T))
    for b, (_, p, c) in enumerate(rows):
        n = len(c.token_ids)
        ids[b, P - len(p):P] = torch.tensor(p)
        ids[b, P:P + n] = torch.tensor(c.token_ids)
        attn[b, P - len(p):P + n] = 1
        mask[b, :n] = 1
        engine_lp[b, :n] = torch.tensor(c.logprobs)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    groups = torch.tensor([i for i, _, _ in rows])
    labels = ids[:, P:]

    def logits_of(model, r):
        return model(input_ids=ids[r], attention_mask=attn[r], position_ids=pos[r]).logits[:, P - 1:P - 1 + T]

    def values_of(r):
        return critic(input_ids=ids[r], attention_mask=attn[r], position_ids=pos[r])[:, P - 1:P - 1 + T].float()

    every = torch.arange(B)
    with torch.no_grad():
        old_logits = logits_of(actor, every)
        old = logprobs_from_logits(old_logits, labels, hp.temperature) * mask
        ref_lp = logprobs_from_logits(logits_of(ref, every), labels, hp.temperature) * mask
        rollout = {"kl": float(masked_mean(kl_penalty(old, ref_lp, hp.kl_kind), mask)),
                   "rollout_entropy": float(masked_mean(entropy_from_logits(old_logits, hp.temperature), mask))}
        weights = torch.ones_like(mask)
        if hp.tis_cap:  # the ratio of each token, of each completion, or of its per-token geometric mean
            log_ratio = (old - engine_lp) * mask
            if hp.tis_level != "token":
                log_ratio = log_ratio.sum(-1, keepdim=True) / (mask.sum(-1, keepdim=True)
                                                               if hp.tis_level == "geometric" else 1.0)
            ratio = torch.exp(log_ratio)
            inside = (ratio <= hp.tis_cap) & (ratio >= (hp.tis_floor or 0.0))
            rollout["tis_outside_fraction"] = float(masked_mean((~inside).float().expand_as(mask), mask))
            if hp.tis_mode == "truncate":
                weights = ratio.clamp(max=hp.tis_cap) * mask
            else:
                weights = torch.where(inside, ratio, 0.0) * mask
        estimator = hp.adv_estimator
        # KL in the token rewards with the estimators that take it (gae, REINFORCE++), else in the loss.
        kl_shaped = hp.kl_in_reward and (hp.algorithm == "ppo" or estimator.startswith("reinforce"))
        if estimator == "rloo":  # each score less the mean of the others of its prompt, by hand
            others = [[scores[j] for j in range(B) if groups[j] == groups[b] and j != b] for b in range(B)]
            adv = torch.stack([scores[b] - sum(o) / len(o) for b, o in enumerate(others)]).float()[:, None] * mask
        elif estimator.startswith("reinforce"):
            base = scores.float()
            if estimator == "reinforce_plus_plus_baseline":
                base = base - torch.stack([scores[groups == groups[b]].float().mean() for b in range(B)])
            token_rewards = shape_rewards(base, old, ref_lp, mask, hp.kl_coef if kl_shaped else 0.0, hp.kl_kind)
            returns_ = torch.zeros_like(token_rewards)
            running = torch.zeros(B)
            for t in reversed(range(T)):  # completions are left-aligned: masked positions only trail
                running = token_rewards[:, t] + hp.gamma * running
                returns_[:, t] = running * mask[:, t]
            adv = masked_whiten(returns_, mask)
        elif hp.algorithm == "grpo":
            adv = compute_grpo_advantages(scores, groups, scale_by_std=hp.scale_by_std)[:, None] * mask
        else:
            old_values = values_of(every) * mask
            kl_coef = hp.kl_coef if hp.kl_in_reward else 0.0
            token_rewards = shape_rewards(scores, old, ref_lp, mask, kl_coef, hp.kl_kind)
            adv, returns = compute_gae(token_rewards, old_values, mask, hp.gamma, hp.lam)
            adv = masked_whiten(adv, mask)

    loss_kl = 0.0 if kl_shaped else hp.kl_coef
    g = torch.Generator().manual_seed(hp.seed * 7919 + step)
    minibatch = hp.minibatch_size
    micro = minibatch // hp.grad_accum
    plan = []
    for _ in range(hp.ppo_epochs):
        perm = torch.randperm(B, generator=g)
        plan += [perm[s:s + minibatch] for s in range(0, B, minibatch)]

    def optimise(model, optimizer, loss_of):
        # One minibatch, one loss: its aggregate over all its rows (trainer.agg), which each
        # micro-batch's rows contribute to with the minibatch's per-token weights.
        losses = []
        for mb in plan:
            # Dr.GRPO's divisor is the generation budget, a constant, not this batch's longest completion
            w = dict(zip(mb.tolist(), aggregation_weights(mask[mb], hp.agg, length=hp.max_new_tokens), strict=True))
            total = 0.0
            for r in mb.view(hp.grad_accum, micro):
                loss = loss_of(r, torch.stack([w[int(i)] for i in r]))
                loss.backward()
                total += float(loss.detach())
            losses.append(total)
            torch.nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        return sum(losses) / len(losses)

    def actor_loss(r, w):
        logits = logits_of(actor, r)
        lp = logprobs_from_logits(logits, labels[r], hp.temperature)
        m = mask[r]
        if hp.policy_loss == "sapo":  # the soft gate with the config's temperatures (its formula: by hand elsewhere)
            loss_mat, _ = sapo_policy_loss(lp, old[r], adv[r] * weights[r], m, **hp.policy_loss_args)
        else:
            loss_mat, _ = clipped_surrogate(lp, old[r], adv[r] * weights[r], hp.clip_low, hp.clip_high, hp.dual_clip)
        loss = aggregate_loss(loss_mat, m, hp.agg, w)
        if loss_kl:
            loss = loss + loss_kl * aggregate_loss(kl_penalty(lp, ref_lp[r], hp.kl_kind), m, hp.agg, w)
        if hp.entropy_coef:
            loss = loss - hp.entropy_coef * aggregate_loss(entropy_from_logits(logits, hp.temperature), m, hp.agg, w)
        return loss

    result = {"policy_loss": optimise(actor, opt, actor_loss), **rollout}
    if critic is not None:
        def critic_loss(r, w):
            loss, _ = value_loss(values_of(r), old_values[r], returns[r], mask[r], hp.vf_clip, hp.agg, w)
            return hp.vf_coef * loss

        result["value_loss"] = optimise(critic, critic_opt, critic_loss) / hp.vf_coef
    return result


def assert_same_params(a, b, atol=2e-5):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=atol, rtol=1e-4), f"{name}: max diff {(pa - pb).abs().max():.3g}"


@pytest.mark.parametrize("case", ["grpo", "grpo-drgrpo-tokensum", "grpo-unfused", "ppo", "grpo-on-policy",
                                  "grpo-on-policy-unfused", "grpo-rloo", "grpo-reinforce-pp-kl-in-reward",
                                  "grpo-reinforce-pp-baseline", "grpo-tis-sequence-mask", "grpo-tis-geometric-floor",
                                  "grpo-sapo"])
def test_step_matches_hand_written_unfused_step(case, monkeypatch):
    torch.manual_seed(0)
    if case == "grpo":
        hp = make_config(GRPO)
    elif case.startswith("grpo-on-policy"):
        # One optimizer step per batch, no TIS: the step skips the old-logprob pass (the hand-written
        # step still recomputes them), so this proves the shortcut changes nothing but the cost.
        hp = make_config(GRPO, ppo_epochs=1, minibatch_size=12, grad_accum=3, tis_cap=None,
                     fused_loss=case == "grpo-on-policy")
    elif case == "grpo-drgrpo-tokensum":
        hp = make_config(GRPO, scale_by_std=False, agg="seq-mean-token-sum-norm", tis_cap=None, grad_accum=3,
                     minibatch_size=12, loss_chunk_size=5)
    elif case == "grpo-unfused":
        hp = make_config(GRPO, fused_loss=False, entropy_coef=0.05)
    elif case == "grpo-rloo":
        hp = make_config(GRPO, adv_estimator="rloo")
    elif case == "grpo-reinforce-pp-kl-in-reward":  # the KL in the token rewards, discounted, none in the loss
        hp = make_config(GRPO, adv_estimator="reinforce_plus_plus", kl_in_reward=True, kl_kind="k1", gamma=0.9)
    elif case == "grpo-reinforce-pp-baseline":
        hp = make_config(GRPO, adv_estimator="reinforce_plus_plus_baseline")
    elif case == "grpo-sapo":
        hp = make_config(GRPO, policy_loss="sapo", policy_loss_args={"tau_pos": 0.5, "tau_neg": 3.0})
    elif case == "grpo-tis-sequence-mask":  # TRL's sequence_mask: no policy gradient from a completion above the cap
        hp = make_config(GRPO, tis_level="sequence", tis_mode="mask", tis_cap=1.1)
    elif case == "grpo-tis-geometric-floor":  # ICEPOP-like bounds on each completion's geometric-mean ratio
        hp = make_config(GRPO, tis_level="geometric", tis_mode="mask", tis_cap=1.1, tis_floor=0.9)
    else:
        hp = make_config(PPO)
    actor, ref = tiny_actor(), tiny_actor(seed=1).eval()  # a reference that differs: KL > 0
    completions = fixed_completions(actor, hp.rollout.temperature)
    actor_ref_copy = copy.deepcopy(actor)
    lr = 5e-3
    opt = torch.optim.AdamW(actor.parameters(), lr=lr, weight_decay=0.01)
    opt_h = torch.optim.AdamW(actor_ref_copy.parameters(), lr=lr, weight_decay=0.01)
    critic = critic_h = copt = copt_h = None
    if hp.algorithm == "ppo":
        critic = tiny_critic()
        critic_h = copy.deepcopy(critic)
        copt = torch.optim.AdamW(critic.parameters(), lr=lr)
        copt_h = torch.optim.AdamW(critic_h.parameters(), lr=lr)
    before = copy.deepcopy(actor)

    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=ref, critic=critic,
                actor_optimizer=opt, critic_optimizer=copt, pad_token_id=PAD, rollout_shares_actor=True)
    forward_passes, parts = [], []
    original = step_module.sequence_logprobs
    monkeypatch.setattr(step_module, "sequence_logprobs", lambda model, exp, *a, **k:
                        forward_passes.append((model, exp.batch_size)) or parts.append(exp.token_parts())
                        or original(model, exp, *a, **k))
    metrics = rl(PROMPTS, None, step=3, completions=completions)
    monkeypatch.undo()
    on_policy = skips_old_logprobs(hp)
    assert on_policy == case.startswith("grpo-on-policy")
    # On-policy the actor re-scores only a probe of rollout.mismatch_probe sequences (a stale engine
    # check): the shortest ones, the cheapest to re-score.
    assert forward_passes == ([(actor, 2), (ref, 12)] if on_policy else [(actor, 12), (ref, 12)])
    if on_policy:
        assert sorted(map(sum, parts[0])) == sorted(map(sum, parts[1]))[:2]
    expected = hand_written_step(hp, actor_ref_copy, ref, opt_h, completions, SCORES, 3, critic_h, copt_h)

    assert metrics["skipped"] == 0.0
    assert metrics["optimizer_steps"] == hp.trainer.ppo_epochs * 12 // hp.trainer.minibatch_size
    assert math.isclose(metrics["policy_loss"], expected["policy_loss"], rel_tol=1e-4, abs_tol=1e-6)
    assert changed(before, actor) > 1e-3  # the step really moved the weights
    assert_same_params(actor, actor_ref_copy)
    if critic is not None:
        assert math.isclose(metrics["value_loss"], expected["value_loss"], rel_tol=1e-4, abs_tol=1e-6)
        assert_same_params(critic, critic_h)
    # The engine logprobs were given noise of std 0.3: the mismatch metric must see it (every step).
    # (mean |noise| 0.24; on-policy over the probe's few tokens only, so the max can stay under 0.3).
    assert 0.1 < metrics["logprob_mismatch_mean"] < 0.5
    assert metrics["logprob_mismatch_max"] > max(metrics["logprob_mismatch_mean"], 0.2)
    if on_policy:
        assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == 0.0
        assert math.isclose(metrics["kl"], expected["kl"], rel_tol=1e-4, abs_tol=1e-7)
        assert math.isclose(metrics["rollout_entropy"], expected["rollout_entropy"], rel_tol=1e-4)
    for key in ("reward_mean", "reward_std", "entropy", "clipfrac", "approx_kl", "grad_norm", "kl"):
        assert math.isfinite(metrics[key]), key
    assert math.isclose(metrics["reward_mean"], float(SCORES.mean()), rel_tol=1e-6)
    if hp.trainer.tis_cap:  # the engine's noise puts some tokens or completions beyond the bounds, not all
        assert 0.0 < metrics["tis_outside_fraction"] < 1.0
        assert math.isclose(metrics["tis_outside_fraction"], expected["tis_outside_fraction"], rel_tol=1e-6)
    assert metrics["generated_tokens"] == sum(len(c.token_ids) for s in completions for c in s)


def test_probe_rows_are_the_cheapest_rows_with_a_completion():
    parts = [(10, 5), (3, 0), (4, 2), (10, 1), (2, 3)]  # (prompt, completion) tokens per row
    assert probe_rows(parts, 2) == [2, 4]  # 6 and 5 tokens; row 1 is shorter but has nothing to compare
    assert probe_rows(parts, 4) == [0, 2, 3, 4]
    assert probe_rows(parts, 9) == [0, 1, 2, 3, 4]
    assert probe_rows([(5, 0), (1, 0)], 1) == [1]


@pytest.mark.parametrize("case", ["grpo", "ppo"])
def test_gradient_checkpointing_changes_memory_not_the_update(case):
    # model.gradient_checkpointing (non-reentrant) on the actor and critic: the RL step's loss and
    # updated weights must equal those of the same step without it.
    hp = make_config(GRPO) if case == "grpo" else make_config(PPO)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        actor, ref = tiny_actor(), tiny_actor().eval()
        completions = fixed_completions(actor, hp.rollout.temperature)
        critic = tiny_critic() if case == "ppo" else None
        if checkpointing:
            for model in (actor, critic.lm if critic is not None else None):
                if model is not None:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                    assert model.is_gradient_checkpointing
        opt = torch.optim.AdamW(actor.parameters(), lr=5e-3)
        copt = torch.optim.AdamW(critic.parameters(), lr=5e-3) if critic is not None else None
        rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=ref, critic=critic,
                    actor_optimizer=opt, critic_optimizer=copt, pad_token_id=PAD, rollout_shares_actor=True)
        metrics = rl(PROMPTS, None, step=3, completions=completions)
        results.append((metrics, actor, critic))
    (m0, a0, c0), (m1, a1, c1) = results
    assert m1["skipped"] == 0.0
    assert math.isclose(m0["policy_loss"], m1["policy_loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert_same_params(a0, a1, atol=1e-6)
    if c0 is not None:
        assert math.isclose(m0["value_loss"], m1["value_loss"], rel_tol=1e-5, abs_tol=1e-7)
        assert_same_params(c0, c1, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# NaN guard
# ----------------------------------------------------------------------------------------------


def test_nan_reward_skips_step_and_keeps_parameters():
    hp = make_config(GRPO)
    rl, actor, opt = guarded_step(hp)
    before = copy.deepcopy(actor)
    completions = fixed_completions(actor, hp.rollout.temperature)
    bad = SCORES.clone()
    bad[4] = float("nan")
    rl.scorer = FixedScorer(bad)
    metrics = rl(PROMPTS, None, step=0, completions=completions)
    assert metrics["skipped"] == 1.0 and metrics["skipped_steps"] == 1.0
    assert metrics["reward_nonfinite"] == 1.0  # counted, and the mean is over the finite ones
    assert metrics["reward_mean"] == pytest.approx(float(torch.cat([SCORES[:4], SCORES[5:]]).mean()))
    assert changed(before, actor) == 0.0
    assert not opt.state  # the optimizer never stepped
    rl.scorer = FixedScorer(SCORES)
    metrics = rl(PROMPTS, None, step=1, completions=completions)
    assert metrics["skipped"] == 0.0 and metrics["skipped_steps"] == 1.0
    assert changed(before, actor) > 1e-3


def test_a_step_with_no_finite_reward_logs_nan_as_numbers_not_a_made_up_0(tmp_path):
    """All rewards NaN: the step is skipped and counted; reward_mean/std have no value (NaN, not 0.0), and
    metrics.jsonl holds NaN as a JSON number (json.loads reads a float), not the string "nan"."""
    from fastrlhf.engine.metrics import MetricsLogger, read_metrics

    hp = make_config(GRPO)
    rl, actor, _ = guarded_step(hp)
    rl.scorer = FixedScorer(torch.full_like(SCORES, float("nan")))
    metrics = rl(PROMPTS, None, step=1, completions=fixed_completions(actor, hp.rollout.temperature))
    assert metrics["skipped"] == 1.0 and metrics["reward_nonfinite"] == float(SCORES.numel())
    logger = MetricsLogger(str(tmp_path), total_steps=1, enabled=True)
    logger.log(1, metrics)
    logger.close()
    (record,) = read_metrics(str(tmp_path / "metrics.jsonl"))
    for key in ("reward_mean", "reward_std", "advantage_mean"):
        assert isinstance(record[key], float) and math.isnan(record[key]), (key, record[key])
    assert '"reward_mean": NaN' in (tmp_path / "metrics.jsonl").read_text()


def test_truncated_completions_are_counted_and_can_get_their_own_reward():

    completions = fixed_completions(tiny_actor(), 1.0)
    for samples in completions:  # every other completion stopped at eos; the rest hit the cap
        for j, c in enumerate(samples):
            c.finish_reason = "stop" if j % 2 else "length"
    cut = torch.tensor([c.finish_reason == "length" for samples in completions for c in samples])
    seen = {}
    for truncated_reward in (None, -1.0):
        config = dataclasses.replace(make_config(GRPO), reward=RewardConfig(function="length",
                                                                          truncated_reward=truncated_reward))
        rl, _, _ = guarded_step(config)
        exp = build_experience(PROMPTS, completions, PAD)
        seen[truncated_reward] = rl.score(exp, PROMPTS, completions, [{}] * len(PROMPTS))
        metrics = rl(PROMPTS, None, step=0, completions=completions)
        assert metrics["truncated_fraction"] == pytest.approx(float(cut.float().mean()))
    assert torch.equal(seen[None], SCORES)
    assert torch.equal(seen[-1.0], torch.where(cut, -1.0, SCORES))


def test_a_failing_reward_function_fails_the_step_before_any_update():
    from fastrlhf.rl.rewards import RewardFunctionError

    class Failing(FixedScorer):
        def __call__(self, exp, prompts, completions, metas):
            raise RewardFunctionError("reward function 'f' raised KeyError on a batch of 12 completions: 'x'")

    rl, actor, opt = guarded_step(make_config(GRPO))
    before = copy.deepcopy(actor)
    rl.scorer = Failing(SCORES)
    with pytest.raises(RewardFunctionError, match="'f' raised KeyError") as info:
        rl(PROMPTS, None, step=0, completions=fixed_completions(actor, 1.0))
    assert info.value.local and changed(before, actor) == 0.0 and not opt.state


def test_nan_loss_skips_update_and_keeps_parameters(monkeypatch):
    import fastrlhf.rl.step as step_module

    hp = make_config(GRPO)
    rl, actor, opt = guarded_step(hp)
    before = copy.deepcopy(actor)
    completions = fixed_completions(actor, hp.rollout.temperature)
    real = step_module.policy_loss_from_model

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(step_module, "policy_loss_from_model", poisoned)
    metrics = rl(PROMPTS, None, step=0, completions=completions)
    assert metrics["skipped"] == 1.0 and metrics["skipped_steps"] == 1.0
    assert changed(before, actor) == 0.0
    assert all(p.grad is None for p in actor.parameters())
    monkeypatch.setattr(step_module, "policy_loss_from_model", real)
    metrics = rl(PROMPTS, None, step=1, completions=completions)
    assert metrics["skipped"] == 0.0 and changed(before, actor) > 1e-3


# ----------------------------------------------------------------------------------------------
# Pieces
# ----------------------------------------------------------------------------------------------


def test_reward_function_registry_and_module_path():
    from fastrlhf.rl.rewards import resolve_reward_function

    assert resolve_reward_function("target_token")([1], [3, 3, 4, 5], {}) == 0.5
    assert resolve_reward_function("fastrlhf.rl.rewards:length_reward")([1], [1, 2], {"max_len": 4}) == 0.5
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        resolve_reward_function("nope")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        resolve_reward_function("fastrlhf.rl.rewards:missing")


def test_reward_model_scores_at_last_real_token():
    from transformers import LlamaForSequenceClassification

    from fastrlhf.modeling.tiny import tiny_llama_config
    from fastrlhf.rl.forward import reward_model_scores

    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(tiny_llama_config(vocab_size=96, hidden_size=32, num_heads=1,
                                                          num_labels=2)).eval()
    rm.config.fastrlhf_score_position = "last_token"  # as fastrlhf rm exports it (else transformers' pooling)
    completions = [[Completion([20, 21, 22], [0.0] * 3, "length"), Completion([PAD], [0.0], "length")]]
    exp = build_experience([[5, 6]], completions, PAD)
    scores = reward_model_scores(rm, exp, label_index=1)
    with torch.no_grad():  # each sequence alone, unpadded
        alone = [rm(input_ids=torch.tensor([[5, 6, 20, 21, 22]])).logits[0, 1],
                 rm.model(input_ids=torch.tensor([[5, 6, PAD]])).last_hidden_state[0, -1] @ rm.score.weight[1]]
    assert torch.allclose(scores, torch.stack(alone).float(), atol=1e-5)


def test_experience_layout():
    completions = [[Completion([7, 8], [-1.0, -2.0], "stop")], [Completion([], [], "length")]]
    exp = build_experience([[1, 2, 3], [4]], completions, PAD)
    assert exp.input_ids.tolist() == [[1, 2, 3, 7, 8], [PAD, PAD, 4, PAD, PAD]]
    assert exp.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert exp.response_mask.tolist() == [[1, 1], [0, 0]]
    assert exp.engine_logprobs.tolist() == [[-1.0, -2.0], [0.0, 0.0]]
    assert exp.group_ids.tolist() == [0, 1]


def test_old_logprobs_are_recomputed_unless_the_update_is_on_policy():
    on = dict(algorithm="grpo", n=4, prompts_per_step=4, minibatch_size=16, ppo_epochs=1, grad_accum=2)
    assert skips_old_logprobs(make_config(on))
    for change in (dict(ppo_epochs=2), dict(minibatch_size=8), dict(tis_cap=2.0), dict(old_logprobs="recompute"),
                   dict(algorithm="ppo", kl_in_reward=True)):
        assert not skips_old_logprobs(make_config(on, **change)), change
    assert skips_old_logprobs(make_config(on, algorithm="ppo"))  # KL in the loss: no need


def test_loss_chunk_bytes_reaches_every_fused_head_call(monkeypatch):
    """trainer.loss_chunk_bytes sizes the chunks of the old/ref logprob passes and of the loss."""
    import fastrlhf.kernels.fused_linear as fused_linear

    budgets = []
    real = fused_linear.default_chunk_size

    def spy(num_tokens, vocab_size, budget_bytes=None, device=None):
        budgets.append(budget_bytes)
        return real(num_tokens, vocab_size, budget_bytes, device)

    monkeypatch.setattr(fused_linear, "default_chunk_size", spy)
    actor = tiny_actor()
    hp = make_config(algorithm="grpo", n=N, prompts_per_step=3, minibatch_size=12, kl_coef=0.1,
                     old_logprobs="recompute", loss_chunk_bytes=4 * 96 * 8)
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=tiny_actor().eval(),
                actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3), pad_token_id=PAD,
                rollout_shares_actor=True)
    rl(PROMPTS, None, 1, completions=fixed_completions(actor, 1.0))
    assert len(budgets) >= 3 and set(budgets) == {4 * 96 * 8}, budgets  # old, ref, loss


def test_fp32_logits_reach_every_fused_head_call(monkeypatch):
    """model.fp32_logits: the old and reference logprobs, the mismatch probe and the loss all take the head's fp32
    logits, so that the ratio and the KL compare logprobs of one kind."""
    import fastrlhf.kernels.fused_linear as fused_linear

    calls = []
    for name in ("fused_linear_logprob_entropy", "fused_linear_policy_loss"):
        real = getattr(fused_linear, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs.get("fp32_logits")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused_linear, name, spy)
        monkeypatch.setattr(f"fastrlhf.kernels.{name}", spy)
    actor = tiny_actor().to(torch.bfloat16)
    hp = make_config(algorithm="grpo", n=N, prompts_per_step=3, minibatch_size=12, kl_coef=0.1,
                     old_logprobs="recompute")
    hp = dataclasses.replace(hp, model=dataclasses.replace(hp.model, fp32_logits=True))
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=tiny_actor().to(torch.bfloat16).eval(),
                actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3), pad_token_id=PAD,
                rollout_shares_actor=True)
    metrics = rl(PROMPTS, None, 1, completions=fixed_completions(actor, 1.0))
    assert metrics["skipped"] == 0 and math.isfinite(metrics["policy_loss"]), metrics
    assert {name for name, _ in calls} == {"fused_linear_logprob_entropy", "fused_linear_policy_loss"}, calls
    assert all(fp32 is True for _, fp32 in calls), calls


def test_an_adapter_on_the_lm_head_is_refused_by_the_fused_kernels_not_skipped():
    """LoRA on lm_head: the unfused path applies the adapter; the fused kernels read the head's weight and would skip
    it (4.6 nats apart on this tiny model before they refused it), so they refuse it."""
    from fastrlhf.config import ModelConfig
    from fastrlhf.modeling.loading import apply_lora
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.rl.forward import sequence_logprobs

    actor = apply_lora(make_tiny_llama(seed=0, vocab_size=96, hidden_size=32, num_layers=2, num_heads=1,
                                       tie_word_embeddings=False),
                       ModelConfig(path="unused", lora_r=4, lora_targets=["q_proj", "lm_head"]))
    for name, p in actor.named_parameters():
        if "lora_B" in name:  # a trained adapter (PEFT starts B at zero)
            torch.nn.init.normal_(p, std=0.5)
    exp = build_experience([[5, 6, 7], [8, 9]], [[Completion([10, 11, 12], [0.0] * 3, "stop")],
                                                 [Completion([13, 14], [0.0] * 2, "stop")]], PAD)
    with torch.no_grad():
        base = actor.get_base_model().lm_head.base_layer(torch.ones(1, 32))
        assert not torch.allclose(actor.get_base_model().lm_head(torch.ones(1, 32)), base)  # the adapter counts
    unfused, _ = sequence_logprobs(actor, exp, fused=False)
    assert torch.isfinite(unfused).all()
    with pytest.raises(ValueError, match=r"^trainer.fused_loss: the LM head is a peft\..*, not a torch.nn.Linear"):
        sequence_logprobs(actor, exp, fused=True)


def test_lora_actor_uses_disabled_adapter_as_reference():
    from peft import LoraConfig, get_peft_model

    base = tiny_actor()
    plain = copy.deepcopy(base).eval()
    actor = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a non-zero adapter, so the adapted policy differs from the base
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    hp = make_config(GRPO, tis_cap=None)
    opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-2)
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=None, actor_optimizer=opt,
                pad_token_id=PAD, rollout_shares_actor=True)
    completions = fixed_completions(plain, hp.rollout.temperature)
    exp = build_experience(PROMPTS, completions, PAD)
    exp.scores = SCORES.clone()
    rl.logprobs_and_values(exp)
    with torch.no_grad():
        logits = plain(input_ids=exp.input_ids, attention_mask=exp.attention_mask,
                       position_ids=exp.position_ids).logits[:, exp.response_slice()]
    base_lp = logprobs_from_logits(logits, exp.labels, hp.rollout.temperature) * exp.response_mask
    assert torch.allclose(exp.ref_logprobs, base_lp, atol=1e-5)
    assert (exp.old_logprobs - base_lp).abs().max() > 1e-3  # the adapter is active for the actor
    frozen = {n: p.clone() for n, p in actor.named_parameters() if not p.requires_grad}
    metrics = rl(PROMPTS, None, step=0, completions=completions)
    assert metrics["skipped"] == 0.0
    assert all(torch.equal(p, frozen[n]) for n, p in actor.named_parameters() if not p.requires_grad)


def test_the_no_grad_passes_run_without_dropout():
    """LoRA dropout 0.3: the old logprobs are the adapted policy's without dropout (two passes in train mode
    differed by up to 0.36 nats), and the update trains with it on again."""
    actor = lora_dropout_actor(0.3)
    hp = make_config(GRPO, tis_cap=None)
    rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=None, pad_token_id=PAD,
                actor_optimizer=torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-2),
                rollout_shares_actor=True)
    exp = build_experience(PROMPTS, fixed_completions(tiny_actor().eval(), hp.rollout.temperature), PAD)
    exp.scores = SCORES.clone()
    actor.train()
    rl.logprobs_and_values(exp)
    first = exp.old_logprobs.clone()
    actor.train()
    rl.logprobs_and_values(exp)
    assert torch.equal(first, exp.old_logprobs)
    assert rl(PROMPTS, None, step=0, completions=fixed_completions(tiny_actor().eval(), 0.8))["skipped"] == 0.0
    assert actor.training


def test_lora_actor_syncs_merged_weights_into_a_separate_engine():
    from peft import LoraConfig, get_peft_model

    from fastrlhf.rollout import HFEngine

    actor = get_peft_model(tiny_actor(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    engine_model = tiny_actor().eval()
    hp = make_config(GRPO, tis_cap=None)
    opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-2)
    rl = RLStep(hp, actor, rollout=HFEngine(engine_model), scorer=FixedScorer(SCORES), reference=None,
                actor_optimizer=opt, pad_token_id=PAD, rollout_shares_actor=False)
    metrics = rl(PROMPTS, None, step=0, completions=fixed_completions(tiny_actor(), hp.rollout.temperature))
    assert metrics["skipped"] == 0.0 and metrics["sync_bytes"] > 0
    merged = copy.deepcopy(actor).merge_and_unload()
    assert changed(merged, tiny_actor()) > 1e-3  # the adapter learned something, so the merge matters
    for (name, p), (_, q) in zip(merged.named_parameters(), engine_model.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name


@pytest.mark.parametrize("policy_loss", ["cispo", "gspo"])
def test_a_registered_policy_loss_trains_the_same_fused_and_unfused(policy_loss):
    # cispo runs inside the fused loss kernel, gspo (sequence-level) on the fused logprob kernel's
    # output; trainer.fused_loss: false is the same math on materialised logits.
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        actor, ref = tiny_actor(), tiny_actor(seed=1).eval()
        hp = make_config(GRPO, policy_loss=policy_loss, fused_loss=fused, clip_low=0.1, clip_high=0.1)
        rl = RLStep(hp, actor, rollout=None, scorer=FixedScorer(SCORES), reference=ref,
                    actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=5e-3), pad_token_id=PAD,
                    rollout_shares_actor=True)
        results.append((rl(PROMPTS, None, step=3, completions=fixed_completions(actor, 0.8)), actor))
    (fused_metrics, fused_actor), (plain_metrics, plain_actor) = results
    assert fused_metrics["skipped"] == 0.0 and changed(tiny_actor(), fused_actor) > 1e-3
    assert math.isclose(fused_metrics["policy_loss"], plain_metrics["policy_loss"], rel_tol=1e-4, abs_tol=1e-6)
    assert_same_params(fused_actor, plain_actor)


def test_an_engine_that_dropped_its_weights_at_sleep_is_synced_even_after_a_skipped_update():
    """A CPU vLLM engine's ``sleep()`` releases its weights (``needs_sync``) until the next sync: the
    step must sync it even when the update was skipped, or the next generation would read zeros. An
    engine that kept its weights gets no sync for a skipped update (nothing changed)."""
    from fastrlhf.rollout import RolloutEngine

    class DroppingEngine(RolloutEngine):
        def __init__(self, completions, drops: bool):
            self.completions, self.drops, self.calls, self.needs_sync = completions, drops, [], False

        def generate(self, prompt_token_ids, sampling):
            assert not self.needs_sync, "generated from released weights"
            self.calls.append("generate")
            return copy.deepcopy(self.completions)

        def sleep(self):
            self.calls.append("sleep")
            self.needs_sync = self.drops

        def update_weights(self, named_tensors):
            self.calls.append("update_weights")
            list(named_tensors)
            self.needs_sync = False

    hp = make_config(GRPO)
    completions = fixed_completions(tiny_actor(), hp.rollout.temperature)
    bad = SCORES.clone()
    bad[4] = float("nan")
    for drops, calls in ((True, ["generate", "sleep", "update_weights"]), (False, ["generate", "sleep"])):
        actor = tiny_actor()
        engine = DroppingEngine(completions, drops)
        rl = RLStep(hp, actor, rollout=engine, scorer=FixedScorer(bad), reference=tiny_actor().eval(),
                    actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-2), pad_token_id=PAD)
        metrics = rl(PROMPTS, None, step=0)
        assert metrics["skipped"] == 1.0
        assert engine.calls == calls and not engine.needs_sync
        rl.scorer = FixedScorer(SCORES)
        rl(PROMPTS, None, step=1)  # the next step generates (the engine asserts it was synced)
        assert engine.calls[len(calls):] == ["generate", "sleep", "update_weights"]


def test_rank_prompts_deals_by_prompt_length_unless_switched_off():
    from fastrlhf.data import PromptExample
    from fastrlhf.rl.trainer import rank_prompts

    examples = [PromptExample(prompt_ids=[1] * n, meta={"i": i}) for i, n in enumerate([236, 233, 30, 39, 7])]
    step = [0, 1, 2, 3]  # the sampled order: a contiguous slice gives rank 0 both long prompts
    dealt = [[e.meta["i"] for e in rank_prompts(examples, step, True, r, 2)] for r in range(2)]
    assert dealt == [[0, 2], [1, 3]]
    sliced = [[e.meta["i"] for e in rank_prompts(examples, step, False, r, 2)] for r in range(2)]
    assert sliced == [[0, 1], [2, 3]]
