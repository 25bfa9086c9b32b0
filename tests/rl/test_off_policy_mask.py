"""``trainer.off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence masking, TRL's option of the same
name): the tokens kept are TRL's, the update drops the masked completions' policy term (and nothing else) on every
path, it reads the device no more often than without it, and the config checks name the key."""

import pytest
import torch
from helpers.model_folders import fake_train_raw
from helpers.rl_case import PAD, PROMPTS, fixed_completions, make_config, tiny_actor

from fastrlhf.algorithms import entropy_from_logits, logprobs_from_logits, off_policy_keep
from fastrlhf.config import ConfigError, parse_config
from fastrlhf.modeling import use_attention
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.forward import policy_loss_from_model
from fastrlhf.rl.update import Minibatch, TorchLearner, run_updates


def trl_get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    """TRL's ``GRPOTrainer.get_off_policy_mask`` (huggingface/trl, trl/trainer/grpo_trainer.py at commit
    f2cd57710ae345ea6428ae95363267fcf38a3dc8), written out. TRL calls it per micro-batch in ``_compute_loss`` with
    ``per_token_logps`` the current forward's (grad-carrying; detached here), ``sampling_per_token_logps`` vLLM's
    (else the old logprobs), ``mask = completion_mask (* tool_mask)`` and ``advantages`` ``(B, 1)`` (or ``(B, T)``),
    then multiplies the policy term by it (``per_token_loss = per_token_loss * off_policy_mask``) before adding the
    KL term and dividing by ``mask``."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)


def test_trls_own_cases():
    """TRL's tests ``test_get_off_policy_mask`` and ``test_get_off_policy_mask_padding``: the same keeps."""
    mask = torch.ones(3, 4)
    advantages = torch.tensor([1.0, -1.0, -1.0])[:, None]
    current = torch.zeros(3, 4)
    current[0], current[1], current[2] = -2.0, -0.5, -2.0  # positive + high KL, negative + low, negative + high
    keep = off_policy_keep(advantages.expand(3, 4), current, torch.zeros(3, 4), mask, 1.0)
    assert torch.equal(keep, torch.tensor([[1.0], [1.0], [0.0]]).expand(3, 4))
    padded = torch.tensor([[-2.0, -2.0, -10_000.0, 10_000.0]])  # padding values are ignored
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert off_policy_keep(-torch.ones(1, 4), padded, torch.zeros(1, 4), mask, 1.0).sum() == 0
    padded[0, :2] = -0.5
    assert off_policy_keep(-torch.ones(1, 4), padded, torch.zeros(1, 4), mask, 1.0).sum() == 4


def random_cases(count=300):
    g = torch.Generator().manual_seed(11)
    for case in range(count):
        rows, width = (int(torch.randint(1, 7, (1,), generator=g)) for _ in range(2))
        current = -3 * torch.rand(rows, width, generator=g)
        sampling = current + torch.randn(rows, width, generator=g)
        mask = (torch.rand(rows, width, generator=g) > 0.3).float()
        if case % 13 == 0:
            mask[0] = 0.0  # a completion without trained tokens: mean KL 0
        sign = torch.randint(-1, 2, (rows, 1), generator=g).float()  # negative, zero and positive advantages
        advantages = sign * torch.rand(rows, 1, generator=g)
        if case % 4 == 0:  # ties: KL exactly 0.5 or 1 on every token, the threshold one of them
            sampling = current + torch.randint(1, 3, (rows, 1), generator=g).float() / 2
        threshold = 0.5 if case % 4 == 0 else float(torch.rand(1, generator=g))
        yield advantages, current, sampling, mask, threshold


def test_the_kept_tokens_are_trls():
    """Random cases (ties at the threshold, empty completions, advantages of every sign): per completion, TRL's keep
    broadcast over its tokens; and with per-token advantages (GAE's), TRL's ``(B, T)`` broadcast."""
    kinds = {"dropped": 0, "tie": 0, "empty": 0}
    for advantages, current, sampling, mask, threshold in random_cases():
        expected = trl_get_off_policy_mask(advantages, current, sampling, mask, threshold)
        keep = off_policy_keep(advantages.expand_as(current), current, sampling, mask, threshold)
        assert torch.equal(keep, expected.expand_as(keep)), (advantages, current, sampling, mask, threshold)
        per_token = advantages * torch.randn(current.shape)
        expected = trl_get_off_policy_mask(per_token, current, sampling, mask, threshold)
        assert torch.equal(off_policy_keep(per_token, current, sampling, mask, threshold), expected)
        mean_kl = ((sampling - current) * mask).sum(1) / mask.sum(1).clamp(min=1)
        kinds["dropped"] += int((keep[:, 0] == 0).sum())
        kinds["tie"] += int(((mean_kl == threshold) & (advantages[:, 0] < 0) & (mask.sum(1) > 0)).sum())
        kinds["empty"] += int(((mask.sum(1) == 0) & (advantages[:, 0] < 0)).sum())
    assert min(kinds.values()) > 0, kinds  # every kind of case was seen


def test_a_tie_zero_advantage_and_empty_completion_are_kept():
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    current = torch.full((4, 2), -1.0)
    sampling = torch.tensor([[0.0, 0.0], [0.5, 0.5], [5.0, 5.0], [0.0, 9.0]])  # mean KL 1, 1.5, (none), 1
    advantages = torch.tensor([-1.0, 0.0, -1.0, -2.0])[:, None].expand(4, 2)
    keep = off_policy_keep(advantages, current, sampling, mask, 1.0)
    assert keep.tolist() == [[1.0, 1.0]] * 4
    assert off_policy_keep(advantages, current, sampling, mask, 0.999)[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]


# ------------------------------------------------------------------------------------------------ the update


THRESHOLD = 1.0
# Per row: the engine's logprobs are the actor's plus this (mean KL = it), and the row's advantage.
OFFSETS = [2.0, 0.0, 2.0, 0.0, 2.0, 0.5, 1.5, 0.0, 2.0, 0.0, 3.0, 0.9]
ADVANTAGES = [-1.0, -0.5, 0.7, 0.3, -0.2, -1.2, -0.4, 0.9, 0.0, 1.1, -0.8, -0.6]
DROPPED = [a < 0 and o > THRESHOLD for a, o in zip(ADVANTAGES, OFFSETS, strict=True)]


def _case(**trainer):
    """A batch of the fixed completions whose engine logprobs are the actor's + OFFSETS, with ADVANTAGES, a
    reference for a k3 KL term and an entropy bonus; the config with ``trainer``'s keys."""
    actor, reference = tiny_actor().eval(), tiny_actor(seed=4).eval()
    exp = build_experience(PROMPTS, fixed_completions(tiny_actor().eval(), 1.0), PAD)
    with torch.no_grad():
        lp = logprobs_from_logits(_logits(actor, exp), exp.labels)
        exp.ref_logprobs = logprobs_from_logits(_logits(reference, exp), exp.labels)
    exp.engine_logprobs = torch.where(exp.response_mask > 0, lp + torch.tensor(OFFSETS)[:, None], 0.0)
    exp.advantages = torch.tensor(ADVANTAGES)[:, None] * exp.response_mask
    config = make_config(dict(algorithm="grpo", n=4, prompts_per_step=3, temperature=1.0, minibatch_size=12,
                              grad_accum=2, kl_coef=0.5, kl_kind="k3", entropy_coef=0.01, loss_chunk_size=8,
                              **{"off_policy_mask_threshold": THRESHOLD, **trainer}))
    use_attention(actor, config.trainer.packing, config.trainer.share_prompts, "sdpa")
    return actor, exp, config


def _logits(model, exp):
    return model(input_ids=exp.input_ids, attention_mask=exp.attention_mask,
                 position_ids=exp.position_ids).logits[:, exp.response_slice()]


def _by_hand(actor, exp, agg, dropped):
    """The GRPO loss of the step's one on-policy minibatch as TRL writes it, from the materialised logits: the clipped
    policy term (ratio 1 on-policy: ``-A x ratio``) times the rows kept, + 0.5 x k3 KL - 0.01 x entropy on every
    token, aggregated over every trained token (``token-mean``) or per completion (``seq-mean-token-mean``)."""
    logits = _logits(actor, exp)
    lp, ent = logprobs_from_logits(logits, exp.labels), entropy_from_logits(logits)
    mask = exp.response_mask
    ratio = torch.exp(lp - lp.detach())
    keep = 1.0 - torch.tensor(dropped, dtype=torch.float32)[:, None]
    log_ratio = exp.ref_logprobs - lp
    per_token = -exp.advantages * ratio * keep + 0.5 * (torch.exp(log_ratio) - log_ratio - 1) - 0.01 * ent
    per_token = torch.where(mask > 0, per_token, 0.0)
    if agg == "token-mean":
        return per_token.sum() / mask.sum()
    return (per_token.sum(1) / mask.sum(1).clamp(min=1)).mean()


def _update_grads(actor, exp, config):
    """Each parameter's gradient from the update (one minibatch of two micro-batches, SGD at lr 1: the step is
    minus the gradient), and its metrics."""
    before = [p.detach().clone() for p in actor.parameters()]
    learner = TorchLearner(actor, torch.optim.SGD(actor.parameters(), lr=1.0))
    half = exp.batch_size // 2
    order = [Minibatch(torch.arange(exp.batch_size), [list(range(half)), list(range(half, exp.batch_size))])]
    result = run_updates(learner, exp, lambda module, mb: policy_loss_from_model(module, mb, config), order,
                         config.trainer.agg, config.rollout.max_new_tokens)
    assert result["optimizer_steps"] == 1.0
    return [b - p.detach() for b, p in zip(before, actor.parameters(), strict=True)], result


@pytest.mark.parametrize(
    "trainer",
    [
        {},
        {"fused_loss": False},
        {"agg": "seq-mean-token-mean"},
        {"packing": True},
        {"packing": True, "share_prompts": True, "agg": "seq-mean-token-mean"},
        {"policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4},
    ],
    ids=["fused", "unfused", "seq-mean", "packed", "shared", "gspo"],
)
def test_the_update_drops_the_masked_completions_policy_term_alone(trainer):
    """The update's gradient (on-policy, as ``old_logprobs: auto`` runs it: the ratio from its own logprobs) is
    that of TRL's loss with the masked completions' policy term left out: their KL and entropy terms stay, and so
    does their place in the denominator. Without the mask (the old code: the key had no effect) it differs."""
    actor, exp, config = _case(**trainer)
    keep = off_policy_keep(exp.advantages, exp.engine_logprobs - torch.tensor(OFFSETS)[:, None], exp.engine_logprobs,
                           exp.response_mask, THRESHOLD)
    assert (keep[:, 0] == 0).tolist() == DROPPED and sum(DROPPED) == 4
    grads, result = _update_grads(actor, exp, config)
    reference = tiny_actor().eval()
    reference_loss = _by_hand(reference, exp, config.trainer.agg, DROPPED)
    reference_loss.backward()
    for got, p in zip(grads, reference.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=2e-4, atol=1e-6)
    unmasked = tiny_actor().eval()
    _by_hand(unmasked, exp, config.trainer.agg, [False] * len(DROPPED)).backward()
    assert max(float((g - p.grad).abs().max()) for g, p in zip(grads, unmasked.parameters(), strict=True)) > 1e-4
    tokens = exp.response_mask.sum(1)
    expected = float((tokens * torch.tensor(DROPPED)).sum() / tokens.sum())
    assert result["off_policy_masked_fraction"] == pytest.approx(expected, rel=1e-6)


def test_the_mask_reads_the_current_logprobs_not_the_old_ones():
    """With recomputed old logprobs (several optimizer steps): the KL is the engine's against the micro-batch's own
    logprobs, as TRL's, not against the old ones. Old logprobs shifted down by 5 nats change the ratio, not the
    mask: the fraction dropped is the same as on-policy."""
    actor, exp, config = _case()
    on_policy = policy_loss_from_model(actor, exp, config)[1]["off_policy_masked_fraction"]
    with torch.no_grad():
        exp.old_logprobs = torch.where(exp.response_mask > 0, logprobs_from_logits(_logits(actor, exp), exp.labels)
                                       - 5.0, 0.0)
    recomputed = policy_loss_from_model(actor, exp, config)[1]["off_policy_masked_fraction"]
    assert float(recomputed) == float(on_policy) > 0


def test_with_a_critics_per_token_advantages_only_the_negative_tokens_of_a_drifted_completion_drop():
    """GAE's advantages differ per token: the mask is TRL's broadcast, per token (the paper's ``M_{i,t}``)."""
    actor, exp, config = _case()
    g = torch.Generator().manual_seed(2)
    exp.advantages = torch.randn(exp.response_mask.shape, generator=g) * exp.response_mask
    metrics = policy_loss_from_model(actor, exp, config)[1]
    with torch.no_grad():
        lp = logprobs_from_logits(_logits(actor, exp), exp.labels)
    expected = trl_get_off_policy_mask(exp.advantages, lp, exp.engine_logprobs, exp.response_mask, THRESHOLD)
    dropped = (1 - expected) * exp.response_mask
    drifted = torch.tensor(OFFSETS)[:, None] > THRESHOLD
    assert 0 < dropped.sum() < (exp.response_mask * drifted).sum()
    assert float(metrics["off_policy_masked_fraction"]) == pytest.approx(float(dropped.sum() / exp.response_mask.sum()))


@pytest.mark.parametrize(
    "trainer",
    [
        {"ppo_epochs": 1, "minibatch_size": 12, "grad_accum": 2},  # on-policy: no old-logprob pass
        {"packing": True, "share_prompts": True, "tis_cap": 2.0},
        {"fused_loss": False, "top_entropy_quantile": 0.5},
    ],
    ids=["on-policy", "shared-tis", "unfused-entropy"],
)
def test_the_mask_reads_the_device_no_more_than_the_update_did(trainer):
    """On the emulated second device: the update reads the device once per optimizer step (the guard's decision),
    and the step twice outside it, as without the mask (a ``.item()`` or a host-sized op in the mask would show)."""
    from helpers.new_settings_device import rl_config, step_reads

    from fastrlhf.engine.guards import INPUTS_READ
    from fastrlhf.rl.step_metrics import METRICS_READ

    metrics, update_reads, other_reads = step_reads(rl_config(off_policy_mask_threshold=0.01, **trainer))
    assert metrics["skipped"] == 0 and metrics["optimizer_steps"] > 0, metrics
    assert update_reads == ["the optimizer step's skip decision and metrics"] * int(metrics["optimizer_steps"])
    assert other_reads == [INPUTS_READ, METRICS_READ]


# ------------------------------------------------------------------------------------------------ the config


@pytest.fixture
def raw_config(tmp_path):
    def raw(algorithm="grpo", **trainer):
        config = fake_train_raw(tmp_path, **{"max_steps": 10, "minibatch_size": 8, **trainer})
        config["algorithm"] = algorithm
        return {**config, "critic": {"path": None}} if algorithm == "ppo" else config

    return raw


@pytest.mark.parametrize("threshold", [0.0, -0.5])
def test_a_threshold_not_above_0_names_the_key(raw_config, threshold):
    with pytest.raises(ConfigError) as info:
        parse_config(raw_config(off_policy_mask_threshold=threshold))
    message = str(info.value)
    assert info.value.key == "trainer.off_policy_mask_threshold" and "\n" not in message
    assert message.startswith("trainer.off_policy_mask_threshold: must be > 0"), message


def test_a_nan_threshold_is_refused_by_the_check_too():
    """The loader refuses a NaN in a file; a config built in Python meets the check, which NaN does not pass."""
    from fastrlhf.config import TrainerConfig
    from fastrlhf.config.algorithm_checks import check_off_policy_mask

    with pytest.raises(ConfigError, match="must be > 0"):
        check_off_policy_mask(TrainerConfig(max_steps=1, off_policy_mask_threshold=float("nan")))
    check_off_policy_mask(TrainerConfig(max_steps=1, off_policy_mask_threshold=float("inf")))  # never masks


def test_the_combinations_that_cannot_apply_are_refused_and_allowed_when_off(raw_config):
    """The KL in the rewards (the mask would zero it with the advantage; TRL keeps it) and a policy loss that does not
    scale with its advantages are refused; with the mask off (null) each is allowed. PPO (a critic, GAE) and the
    fused loss are allowed."""
    refused = [dict(algorithm="ppo", kl_in_reward=True, kl_coef=0.05), dict(policy_loss="kl_cov"),
               dict(policy_loss="clip_cov")]
    for settings in refused:
        with pytest.raises(ConfigError) as info:
            parse_config(raw_config(off_policy_mask_threshold=0.5, **settings))
        assert info.value.key == "trainer.off_policy_mask_threshold", settings
        assert "\n" not in str(info.value)
        parse_config(raw_config(off_policy_mask_threshold=None, **settings))
    for settings in (dict(algorithm="ppo"), dict(fused_loss=True), dict(policy_loss="gspo"),
                     dict(top_entropy_quantile=0.2, tis_cap=2.0)):
        config = parse_config(raw_config(off_policy_mask_threshold=0.5, **settings))
        assert config.trainer.off_policy_mask_threshold == 0.5


@pytest.mark.parametrize("threshold", [None, 1e-6])
def test_a_grpo_step_logs_the_masked_fraction_when_the_mask_is_on(threshold):
    """The step's metrics carry ``off_policy_masked_fraction`` (the update computes it; the step used to drop it)
    with the mask on, and leave it out with the mask off."""
    from helpers.rl_case import SCORES, FixedScorer

    from fastrlhf.rl.step import RLStep

    config = make_config(dict(n=4, prompts_per_step=3, minibatch_size=12, temperature=1.0),
                         kl_coef=0.0, off_policy_mask_threshold=threshold)
    actor = tiny_actor()
    rl = RLStep(config, actor, rollout=None, scorer=FixedScorer(SCORES), pad_token_id=PAD,
                rollout_shares_actor=True, actor_optimizer=torch.optim.SGD(actor.parameters(), lr=0.0))
    metrics = rl(PROMPTS, None, step=1, completions=fixed_completions(tiny_actor().eval(), 1.0))
    assert metrics["optimizer_steps"] == 1.0
    if threshold is None:
        assert "off_policy_masked_fraction" not in metrics
    else:  # the engine's noisy logprobs put some negative-advantage completions past a tiny threshold
        assert 0.0 < metrics["off_policy_masked_fraction"] < 1.0
