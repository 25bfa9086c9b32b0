"""SamplingConfig validation, engine choice, and the import-cost rule; fast, no engine started."""

import subprocess
import sys

import pytest

from fastrlhf.rollout import CPU_VLLM_CROSSOVER_PARAMS, Completion, SamplingConfig, choose_engine_kind


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(n=0), "SamplingConfig.n must be an int >= 1, got 0"),
        (dict(n=1.5), "SamplingConfig.n must be an int >= 1"),
        (dict(temperature=-0.1), "SamplingConfig.temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "SamplingConfig.temperature"),
        (dict(top_p=0.0), r"SamplingConfig.top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.01), r"SamplingConfig.top_p must be in \(0, 1\]"),
        (dict(top_k=0), "SamplingConfig.top_k must be -1 \\(off\\) or an int >= 1, got 0"),
        (dict(max_new_tokens=0), "SamplingConfig.max_new_tokens must be an int >= 1"),
        (dict(stop_token_ids=(3, -1)), "SamplingConfig.stop_token_ids must be a sequence of ints >= 0"),
        (dict(stop_token_ids=5), "SamplingConfig.stop_token_ids must be a sequence"),
        (dict(seed="1"), "SamplingConfig.seed must be an int or None"),
    ],
)
def test_sampling_config_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_sampling_config_normalises():
    s = SamplingConfig(temperature=0, stop_token_ids=[4, 5])
    assert s.greedy and s.logprob_temperature == 1.0 and s.stop_token_ids == (4, 5)
    assert SamplingConfig(temperature=0.5).logprob_temperature == 0.5


def test_completion_checks_lengths_and_finish_reason():
    with pytest.raises(ValueError, match="2 token_ids but 1 logprobs"):
        Completion([1, 2], [0.0], "stop")
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        Completion([1], [0.0], "abort")


def test_choose_engine_kind_follows_the_measured_crossover(monkeypatch):
    from fastrlhf.rollout import engine_choice

    monkeypatch.setattr(engine_choice, "_vllm_installed", lambda: True)
    assert choose_engine_kind(CPU_VLLM_CROSSOVER_PARAMS - 1, "cpu") == "hf"
    assert choose_engine_kind(CPU_VLLM_CROSSOVER_PARAMS, "cpu") == "vllm"
    assert choose_engine_kind(1000, "cuda:0") == "vllm"
    monkeypatch.setattr(engine_choice, "_vllm_installed", lambda: False)
    assert choose_engine_kind(10**9, "cuda") == "hf"
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        choose_engine_kind(10, "tpu")
    with pytest.raises(ValueError, match="num_params must be a positive int"):
        choose_engine_kind(0, "cpu")


def test_importing_rollout_imports_no_heavy_engine():
    code = (
        "import sys, fastrlhf.rollout, fastrlhf.modeling.tiny; "
        "print(sorted(m for m in ('vllm', 'deepspeed', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
