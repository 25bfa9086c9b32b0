"""The peer settings a migrated config names, on CUDA where CUDA can break them (a host tensor reaching a model on the
device, a read of a device value, bf16), each beside its CPU half:

- ``rollout.repetition_penalty`` and ``rollout.min_p`` in the HF engine (``fastrlhf.rollout.hf_engine``: the penalty's
  per-row first prompt positions are built on the host and moved to the batch's device; the filters run on the
  device's fp32 logits): its logprobs against transformers' processors applied in vLLM's order
  (``helpers.processed_logprobs``), at the real vocabulary (151,936) on CUDA, in fp32 and in bf16; on the CPU the
  engine generates on the emulated second device;
- ``reward.normalize: stored`` with an OpenRLHF ``train_rm`` folder (``helpers.peer_reward_models``): the scorer's
  rewards against OpenRLHF's ``RewardModel`` with ``normalize_reward``, in the compute dtype the RL trainer loads it
  in, with no host read (under ``torch.cuda.set_sync_debug_mode("error")`` on CUDA; on the emulated second device of
  ``helpers.other_device`` on the CPU).

``trainer.off_policy_mask_threshold`` is in tests/gpu/test_update_syncs.py (the update's host reads), the held-out
evaluation of ``fastrlhf sft`` and ``rm`` (``data.eval_path``) in tests/gpu/test_commands.py (through the launcher).
"""

import copy

import pytest
import torch
from helpers.cuda_sync import sync_debug
from helpers.other_device import OtherDevice
from helpers.peer_reward_models import openrlhf_rewards, save_openrlhf_reward_model
from helpers.processed_logprobs import logprob_gaps

from fastrlhf.rollout import Completion, HFEngine, SamplingConfig

# Prompts of several lengths: the shorter ones are left-padded in the HF engine's batch, which the penalty skips.
LENGTHS = [3, 9, 20]
# A wide init gives peaked next-token distributions: min-p cuts many tokens, and the penalty moves large logits.
INIT = 0.2
SAMPLINGS = {
    # vLLM's order: min-p before top-p, whose cumulative mass then skips the tokens min-p dropped
    "all": SamplingConfig(n=3, temperature=1.2, min_p=0.05, top_p=0.8, repetition_penalty=1.3, max_new_tokens=16,
                          seed=6, ignore_eos=True),
    # a penalty below 1 rewards repeats: the other branch of the penalty's sign test
    "min_p-reward-repeats": SamplingConfig(n=3, temperature=0.8, min_p=0.1, repetition_penalty=0.7,
                                           max_new_tokens=16, seed=4, ignore_eos=True),
}
# Reported against recomputed logprobs: fp32, the worst token (the CPU's bound in
# tests/rollout/test_sampling_penalties.py; CUDA's kernels sum in another order between a cached decode step and a
# whole-sequence forward); bf16, the mean over tokens (the bound on the engine's mismatch with the actor in
# tests/gpu/test_commands.py, MISMATCH_MAX).
FP32_WORST = {"cuda": 1e-3, "cpu": 1e-4}
BF16_MEAN = 0.05


def sampling_model(where: str, dtype: torch.dtype):
    """A Qwen2 with a wide init on ``where``: on CUDA the real vocabulary (the filters' sort and threshold over
    151,936 logits), two small layers; on the CPU a vocabulary of 256."""
    from fastrlhf.modeling.tiny import make_qwen2_on

    shape = dict(vocab_size=151_936, hidden_size=256, num_heads=4) if where == "cuda" else \
        dict(vocab_size=256, hidden_size=64, num_heads=2)
    return make_qwen2_on(where, dtype, seed=1, num_layers=2, initializer_range=INIT, **shape)


def prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(SAMPLINGS))
def test_hf_engine_logprobs_are_of_the_penalised_min_p_distribution(where, case, dtype):
    sampling = SAMPLINGS[case]
    model = sampling_model(where, dtype)
    batch = prompts(model.config.vocab_size)
    if where == "cuda":
        results = HFEngine(model).generate(batch, sampling)
    else:  # on the emulated second device, where a host tensor reaching the batch's fails as on CUDA
        with OtherDevice() as dev:
            results = HFEngine(dev.move(copy.deepcopy(model))).generate(batch, sampling)
    assert all(len(c.token_ids) == sampling.max_new_tokens for samples in results for c in samples)
    gaps = logprob_gaps(model, batch, results, sampling)
    # Not the plain tempered distribution: the processing changed what was reported (the check has power).
    plain = SamplingConfig(n=sampling.n, temperature=sampling.temperature, max_new_tokens=sampling.max_new_tokens)
    plain_gaps = logprob_gaps(model, batch, results, plain)
    print(f"\n{case} {dtype} on {where}: reported vs processed, worst {gaps.max():.2e}, mean {gaps.mean():.2e}; "
          f"vs the plain distribution, mean {plain_gaps.mean():.3f}")
    if dtype == torch.float32:
        assert gaps.max() < FP32_WORST[where], gaps.max()
        assert plain_gaps.max() > 1e-2, plain_gaps.max()
    else:
        assert gaps.mean() < BF16_MEAN, gaps.mean()
        assert plain_gaps.mean() > 4 * BF16_MEAN, plain_gaps.mean()


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
COMPLETIONS = [[20, 21, 1], [22, 23, 24, 25], [26]]  # 1: the tiny architecture's eos; 2 is its pad id
MEAN, STD = 0.75, 2.5


@pytest.mark.slow
def test_stored_normalisation_scores_as_openrlhf_without_a_host_read(where, tmp_path):
    """The RL trainer's reward model (``fastrlhf.rl.trainer._reward_model``: bf16 on CUDA, as a run with
    ``model.dtype: bfloat16`` loads it) scoring the step's batch on the device, ``(r - mean) / std`` by the folder's
    config.json, against OpenRLHF's ``RewardModel(normalize_reward=True)`` in fp32 on the host."""
    from helpers.hf_architectures import architecture_config
    from helpers.model_folders import fake_train_raw

    from fastrlhf.config import parse_config
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.rewards import RewardScorer
    from fastrlhf.rl.trainer import _reward_model

    folder = save_openrlhf_reward_model(tmp_path / "rm", architecture_config("qwen2"), "value_head", mean=MEAN,
                                        std=STD)
    raw = fake_train_raw(tmp_path)
    raw["reward"] = {"model_path": folder, "model_kind": "value_head", "normalize": "stored"}
    raw["model"]["dtype"] = "bfloat16" if where == "cuda" else "float32"
    raw["data"]["max_prompt_len"], raw["rollout"]["max_new_tokens"] = 16, 16  # the tiny folder's 128 positions
    config = parse_config(raw)
    completions = [[Completion(c, [0.0] * len(c), "stop")] for c in COMPLETIONS]
    metas = [{} for _ in PROMPTS]
    host = build_experience(PROMPTS, completions, 2, "cpu")
    if where == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        model = _reward_model(config, device)
        scorer = RewardScorer(None, model, "value_head", config.reward.label_index, normalize="stored")
        exp = build_experience(PROMPTS, completions, 2, device)
        with sync_debug(device):
            got = scorer(exp, PROMPTS, COMPLETIONS, metas)
        assert got.device == device
        got = got.cpu()
    else:
        model = _reward_model(config, "cpu")
        with OtherDevice() as dev:
            scorer = RewardScorer(None, dev.move(model), "value_head", config.reward.label_index,
                                  normalize="stored")
            exp = build_experience(PROMPTS, completions, 2, dev.device)
            before = len(dev.reads)
            got = scorer(exp, PROMPTS, COMPLETIONS, metas)
            assert dev.reads[before:] == [], dev.reads[before:]
            got = got.data_.clone()
    expected = openrlhf_rewards(folder, host.input_ids, host.attention_mask, normalize=True)
    raw_scores = openrlhf_rewards(folder, host.input_ids, host.attention_mask, normalize=False)
    assert raw_scores.std() > 0.1  # the rows score apart: a wrong position would show
    torch.testing.assert_close(expected, (raw_scores - MEAN) / STD)
    # bf16: the backbone's rounding, relative to the scores' spread
    tolerance = 0.03 * float(expected.abs().max()) if where == "cuda" else 1e-4
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=tolerance)
