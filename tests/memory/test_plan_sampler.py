"""The memory plan's count of the HF engine's sampler (``fastrlhf.memory.components.hf_sampler_extra_copies``)
against what a sampling step allocates on a CPU: it counted plain sampling's three ``[sequences, V]`` fp32 copies
whatever the settings, while top-p's sort and scatter take three more and combined settings more again."""

import pytest
import torch
from helpers.allocations import allocated_peak
from helpers.rl_case import make_config

from fastrlhf.memory.components import hf_sampler_extra_copies
from fastrlhf.rollout.hf_engine import _SampledTokenLogprobs
from fastrlhf.rollout.sampling import SamplingConfig

S, V = 32, 16000
SETTINGS = {
    "plain": {},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "min_p": {"min_p": 0.05},
    "top_k": {"top_k": 50},
    "top_p": {"top_p": 0.9},
    "penalty_and_min_p": {"repetition_penalty": 1.2, "min_p": 0.05},
    "everything": {"top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.2},
}


def _sampling_step_copies(settings: dict) -> float:
    """Peak bytes of one HF sampling step in ``[S, V]`` fp32 copies: generate's fp32 copy of the last logits, the
    recorder's filters and logprobs (its previous step's held), and generate's softmax and draw."""
    torch.manual_seed(0)
    logits, ids = torch.randn(S, V, dtype=torch.bfloat16), torch.randint(0, V, (S, 24))
    recorder = _SampledTokenLogprobs(SamplingConfig(temperature=0.7, **settings), torch.zeros(S, dtype=torch.long))
    recorder(ids, logits.float())

    def step():
        x = logits.to(copy=True, dtype=torch.float32)
        z = recorder(ids, x)
        probs = torch.softmax(z, -1)
        return x, z, probs, torch.multinomial(probs, 1)

    return allocated_peak(step) / (S * V * 4)


def test_the_plan_counts_what_each_setting_adds_to_the_hf_sampler():
    plain = _sampling_step_copies({})
    for name, settings in SETTINGS.items():
        measured = _sampling_step_copies(settings) - plain
        planned = hf_sampler_extra_copies(make_config(**settings).rollout)
        assert measured - 0.05 <= planned <= measured + 1.5, (name, measured, planned)
    assert hf_sampler_extra_copies(make_config(top_p=0.9).rollout) == pytest.approx(3.0)  # was 0: counted none
