"""rollout.min_p and rollout.repetition_penalty (TRL's GRPOConfig ``min_p`` / ``repetition_penalty``): their checks,
the HF engine's logprobs against transformers' own processors applied in vLLM's order, min-p's threshold on what is
sampled, the vLLM arguments, and the places that treat them as top-k/top-p are treated (the logprob-mismatch watch,
the tis_cap refusal, greedy validation)."""

import os
from types import SimpleNamespace

import pytest
import torch
from helpers.model_folders import fake_train_raw
from helpers.processed_logprobs import logprob_gaps
from helpers.rl_case import GRPO, PAD, make_config, tiny_actor
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
)

from fastrlhf.config import ConfigError, parse_config
from fastrlhf.config.rollout_checks import reshaping_settings
from fastrlhf.engine.guards import StepFailed
from fastrlhf.modeling.tiny import save_tiny_llama
from fastrlhf.rl.step import RLStep
from fastrlhf.rollout import HFEngine, SamplingConfig
from fastrlhf.rollout.hf_engine import seen_tokens
from fastrlhf.rollout.sampling import rollout_sampling
from fastrlhf.rollout.vllm_adapter import sampling_params_kwargs

# A wide init gives peaked next-token distributions: min-p cuts many tokens, and the penalty moves large logits.
MODEL_KW = dict(initializer_range=0.2, vocab_size=256, hidden_size=64, num_heads=2)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


# Of several lengths: the shorter ones are left-padded in the HF engine's batch.
PROMPTS = _prompts([3, 9, 20])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("penalties_model")
    return root, save_tiny_llama(root, seed=1, **MODEL_KW)


def _worst_gap(model, results, sampling):
    return logprob_gaps(model, PROMPTS, results, sampling).max().item()


def test_sampling_config_checks_min_p_and_repetition_penalty():
    for bad in (-0.1, 1.0, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match=r"SamplingConfig.min_p must be in \[0, 1\)"):
            SamplingConfig(min_p=bad)
    for bad in (0.0, -1.0, float("inf"), float("nan"), False, None):
        with pytest.raises(ValueError, match="SamplingConfig.repetition_penalty must be a finite number > 0"):
            SamplingConfig(repetition_penalty=bad)
    s = SamplingConfig(min_p=0, repetition_penalty=2)
    assert (s.min_p, s.repetition_penalty) == (0.0, 2.0) and isinstance(s.repetition_penalty, float)
    assert SamplingConfig().min_p == 0.0 and SamplingConfig().repetition_penalty == 1.0  # off by default


@pytest.mark.parametrize("rollout, key, said", [
    (dict(min_p=-0.1), "rollout.min_p", "must be in [0, 1) (0: off), got -0.1"),
    (dict(min_p=1.0), "rollout.min_p", "must be in [0, 1)"),
    (dict(repetition_penalty=0.0), "rollout.repetition_penalty", "must be > 0 (1: off), got 0.0"),
    (dict(repetition_penalty=-1.2), "rollout.repetition_penalty", "must be > 0"),
    (dict(repetition_penalty=float("inf")), "rollout.repetition_penalty", "expected a finite number"),
])
def test_bad_values_are_one_line_config_errors_naming_the_key(tmp_path, rollout, key, said):
    raw = fake_train_raw(tmp_path)
    raw["rollout"].update(rollout)
    with pytest.raises(ConfigError) as info:
        parse_config(raw, "train")
    assert info.value.key == key and said in str(info.value) and "\n" not in str(info.value), info.value


def test_trl_values_parse_and_tis_cap_is_refused_with_them_as_with_top_p(tmp_path):
    raw = fake_train_raw(tmp_path)
    raw["rollout"].update(min_p=0.05, repetition_penalty=1.1)
    config = parse_config(raw, "train")
    assert (config.rollout.min_p, config.rollout.repetition_penalty) == (0.05, 1.1)
    for rollout, named in ((dict(min_p=0.05), "rollout.min_p 0.05"),
                           (dict(repetition_penalty=1.1), "rollout.repetition_penalty 1.1"),
                           (dict(top_p=0.9), "rollout.top_p 0.9")):
        raw = fake_train_raw(tmp_path, tis_cap=2.0)
        raw["rollout"].update(rollout)
        with pytest.raises(ConfigError) as info:
            parse_config(raw, "train")
        assert info.value.key == "trainer.tis_cap" and named in str(info.value), info.value
    parse_config(fake_train_raw(tmp_path, tis_cap=2.0))  # neither set: tis_cap runs
    # Switching tis_cap off leaves them allowed.
    raw = fake_train_raw(tmp_path, tis_cap=None)
    raw["rollout"].update(min_p=0.05, repetition_penalty=1.1)
    parse_config(raw, "train")


def test_reshaping_settings_name_every_setting_that_reshapes_the_distribution():
    assert reshaping_settings(SamplingConfig()) == []
    assert reshaping_settings(SamplingConfig(top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=0.8)) == [
        "top_k 5", "top_p 0.9", "min_p 0.1", "repetition_penalty 0.8"]
    assert reshaping_settings(make_config(GRPO, repetition_penalty=1.3).rollout) == ["repetition_penalty 1.3"]


def test_seen_tokens_are_the_prompt_and_generated_ones_past_the_left_padding():
    """HF's RepetitionPenaltyLogitsProcessor penalises every id in input_ids, the left padding included (the pad
    token of a short prompt is penalised for it alone, by its place in the batch); vLLM's reads the prompt only."""
    ids = torch.tensor([[PAD, PAD, 5, 6, 5], [7, 8, 9, 4, 7]])
    seen = seen_tokens(ids, torch.tensor([2, 0]), vocab_size=12)
    assert seen[0].nonzero().flatten().tolist() == [5, 6]
    assert seen[1].nonzero().flatten().tolist() == [4, 7, 8, 9]
    logits = torch.randn(2, 12)
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.5)
    from fastrlhf.rollout.hf_engine import apply_sampling_filters

    ours = apply_sampling_filters(logits, SamplingConfig(repetition_penalty=1.5), seen)
    for row, first in ((0, 2), (1, 0)):
        assert torch.equal(ours[row], hf(ids[row : row + 1, first:], logits[row : row + 1].clone())[0])


@pytest.mark.parametrize("sampling", [
    SamplingConfig(n=3, temperature=0.8, repetition_penalty=1.8, max_new_tokens=16, seed=3, ignore_eos=True),
    SamplingConfig(n=3, temperature=0.8, repetition_penalty=0.7, max_new_tokens=16, seed=4, ignore_eos=True),
    SamplingConfig(n=3, temperature=0.8, min_p=0.1, max_new_tokens=16, seed=5, ignore_eos=True),
    # vLLM's order: min-p before top-p, whose cumulative mass then skips the tokens min-p dropped
    SamplingConfig(n=3, temperature=1.2, min_p=0.05, top_p=0.8, repetition_penalty=1.3, max_new_tokens=16, seed=6,
                   ignore_eos=True),
], ids=["penalty", "reward-repeats", "min_p", "all"])
def test_hf_engine_logprobs_are_of_transformers_processed_distribution(tiny, sampling):
    model = tiny[1]
    results = HFEngine(model).generate(PROMPTS, sampling)
    assert _worst_gap(model, results, sampling) < 1e-4
    # Not the plain tempered distribution: the processing changed what was reported.
    plain = SamplingConfig(n=sampling.n, temperature=sampling.temperature, max_new_tokens=16)
    assert _worst_gap(model, results, plain) > 1e-2


def test_greedy_takes_the_penalty_as_vllm_does(tiny):
    """vLLM applies penalties before its greedy pick: a repetition penalty changes a greedy completion."""
    model, engine = tiny[1], HFEngine(tiny[1])
    greedy = SamplingConfig(temperature=0, max_new_tokens=24, ignore_eos=True)
    penalised = SamplingConfig(temperature=0, max_new_tokens=24, ignore_eos=True, repetition_penalty=3.0)
    plain, pen = engine.generate(PROMPTS, greedy), engine.generate(PROMPTS, penalised)
    assert [c.token_ids for s in plain for c in s] != [c.token_ids for s in pen for c in s]
    for prompt, (c,) in zip(PROMPTS, pen, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        for t, token in enumerate(c.token_ids):
            z = RepetitionPenaltyLogitsProcessor(penalty=3.0)(torch.tensor([prompt + c.token_ids[:t]]), logits[t:t + 1])
            assert token == int(z.argmax())
            assert abs(torch.log_softmax(z, -1)[0, token].item() - c.logprobs[t]) < 1e-4


def test_no_token_below_the_min_p_threshold_is_ever_sampled(tiny):
    """Over many seeds: each sampled token's probability (after temperature) is at least min_p times the top
    token's (HF's MinPLogitsWarper threshold). Without min-p the same seeds sample such tokens."""
    model, engine, min_p = tiny[1], HFEngine(tiny[1]), 0.2

    def below(results, temperature):
        count = cut = 0
        for prompt, samples in zip(PROMPTS, results, strict=True):
            for c in samples:
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
                probs = (logits.float() / temperature).softmax(-1)
                threshold = min_p * probs.amax(-1)
                sampled = probs.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                count += int((sampled < threshold * (1 - 1e-4)).sum())  # a margin for the batch's other numerics
                cut += int((probs < threshold[:, None]).sum())
        return count, cut

    seen_below = 0
    for seed in range(6):
        sampling = SamplingConfig(n=4, temperature=1.5, min_p=min_p, max_new_tokens=16, seed=seed, ignore_eos=True)
        count, cut = below(engine.generate(PROMPTS, sampling), 1.5)
        assert count == 0 and cut > 0, (seed, count, cut)
        off = SamplingConfig(n=4, temperature=1.5, max_new_tokens=16, seed=seed, ignore_eos=True)
        seen_below += below(engine.generate(PROMPTS, off), 1.5)[0]
    assert seen_below > 0  # the check above can fail


def test_vllm_sampling_params_carry_min_p_and_the_penalty():
    sampling = SamplingConfig(n=2, temperature=0.7, min_p=0.05, repetition_penalty=1.15, max_new_tokens=8, seed=1)
    kwargs = sampling_params_kwargs(sampling, 8, [2])
    assert (kwargs["min_p"], kwargs["repetition_penalty"]) == (0.05, 1.15)
    assert sampling_params_kwargs(SamplingConfig(), 8, [2])["min_p"] == 0.0  # off: vLLM's own defaults
    assert sampling_params_kwargs(SamplingConfig(), 8, [2])["repetition_penalty"] == 1.0
    pytest.importorskip("vllm")
    from fastrlhf.rollout.vllm_adapter import make_sampling_params

    params = make_sampling_params(sampling, 8, [2])
    assert (params.min_p, params.repetition_penalty) == (0.05, 1.15)


@pytest.mark.slow
def test_vllm_reports_logprobs_of_the_same_processed_distribution(tiny):
    """vLLM's processed_logprobs with a repetition penalty and min-p, against transformers' processors in vLLM's
    order (the tolerance of the engines' other logprob tests)."""
    pytest.importorskip("vllm")
    saved = os.environ.pop("TRITON_INTERPRET", None)  # conftest's Triton interpreter must not reach vLLM's start-up
    from fastrlhf.rollout import VLLMEngine

    engine = VLLMEngine(str(tiny[0]), dtype="float32", max_model_len=128, kv_cache_bytes=16 << 20)
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
    try:
        sampling = SamplingConfig(n=2, temperature=0.8, repetition_penalty=1.5, min_p=0.05, max_new_tokens=12,
                                  seed=3, ignore_eos=True)
        assert _worst_gap(tiny[1], engine.generate(PROMPTS, sampling), sampling) < 1e-4
    finally:
        engine.close()


def _rl_step(**rollout):
    actor = tiny_actor()
    config = make_config(GRPO, tis_cap=None, kl_coef=0.0, max_logprob_mismatch=0.5, **rollout)
    return RLStep(config, actor, rollout=HFEngine(actor), scorer=lambda exp, p, c, m: torch.rand(exp.batch_size),
                  actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-2), pad_token_id=PAD)


@pytest.mark.parametrize("rollout", [dict(min_p=0.1), dict(repetition_penalty=1.2), dict(top_p=0.9)])
def test_mismatch_watch_only_logs_under_them_as_under_top_p(rollout):
    """The engine's logprobs are of the reshaped distribution: a large mismatch with the actor's is expected there,
    and must not stop the run as a stale engine's does."""
    exp = SimpleNamespace(scores=torch.zeros(4), advantages=None, old_logprobs=None, ref_logprobs=None, values=None,
                          returns=None, is_weights=None)
    metrics = {"logprob_mismatch_mean": torch.tensor(2.0)}
    with pytest.raises(StepFailed, match="rollout.max_logprob_mismatch 0.5"):
        _rl_step().check_scored(exp, metrics)
    rl = _rl_step(**rollout)
    assert rl.check_scored(exp, metrics) is True
    sampling = rl.sampling(step=1)  # and the step's engine samples with them
    assert (sampling.top_p, sampling.min_p, sampling.repetition_penalty) == (
        rollout.get("top_p", 1.0), rollout.get("min_p", 0.0), rollout.get("repetition_penalty", 1.0))


def test_greedy_validation_keeps_the_penalty_and_drops_min_p():
    """Validation at eval.temperature 0 drops what cannot change an argmax (top-k, top-p, min-p) and keeps the
    repetition penalty, which can (and which vLLM applies to greedy requests too)."""
    ro = make_config(GRPO, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2).rollout
    greedy = rollout_sampling(ro, 7, n=1, temperature=0.0, max_new_tokens=None)
    assert (greedy.top_p, greedy.top_k, greedy.min_p, greedy.repetition_penalty) == (1.0, -1, 0.0, 1.2)
    assert greedy.max_new_tokens == ro.max_new_tokens and greedy.seed == 7
    sampled = rollout_sampling(ro, 7, n=4, temperature=0.6, max_new_tokens=9)
    assert (sampled.n, sampled.temperature, sampled.top_p, sampled.top_k, sampled.min_p,
            sampled.repetition_penalty, sampled.max_new_tokens) == (4, 0.6, 0.9, 5, 0.1, 1.2, 9)
