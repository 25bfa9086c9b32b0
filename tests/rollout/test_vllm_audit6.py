"""vLLM on CUDA, proven on CPU: what the trainer tells the user when it cannot give vLLM a share of the GPU."""

from types import SimpleNamespace

import pytest
import torch

GIB = 2**30


def _gpu(monkeypatch, free_gib: float, total_gib: float = 80):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free_gib * GIB), int(total_gib * GIB)))


def test_a_plan_that_leaves_vllm_no_room_is_named_not_the_free_memory(monkeypatch):
    """With 70 of 80 GiB free, the share is refused because the plan keeps all but 3% for the update's phases: the
    error said "only 70.0 of 80.0 GiB are free", blaming memory that is plentiful. It names the plan's share now."""
    from fastrlhf.config import ConfigError, RolloutConfig
    from fastrlhf.rl import rollout_setup

    _gpu(monkeypatch, 70)
    with pytest.raises(ConfigError) as err:
        rollout_setup.gpu_memory_utilization(RolloutConfig(), SimpleNamespace(gpu_memory_utilization=0.03))
    message = str(err.value)
    assert "memory plan leaves vLLM 0.03" in message and "2.4 GiB" in message and "70.0 GiB are free now" in message
    assert "only 70.0 of 80.0 GiB are free" not in message


def test_the_share_is_still_the_least_of_the_free_memory_and_the_plan(monkeypatch):
    from fastrlhf.config import ConfigError, RolloutConfig
    from fastrlhf.rl import rollout_setup

    _gpu(monkeypatch, 70)
    assert rollout_setup.gpu_memory_utilization(RolloutConfig(), SimpleNamespace(gpu_memory_utilization=0.4)) == 0.4
    assert rollout_setup.gpu_memory_utilization(RolloutConfig(), SimpleNamespace(gpu_memory_utilization=None)) == 0.77
    _gpu(monkeypatch, 30)
    assert rollout_setup.gpu_memory_utilization(RolloutConfig(), SimpleNamespace(gpu_memory_utilization=0.5)) == 0.27
    _gpu(monkeypatch, 10)  # the GPU itself is full: that is what the error says, plan or not
    with pytest.raises(ConfigError, match="only 10.0 of 80.0 GiB are free after the trainer's models"):
        rollout_setup.gpu_memory_utilization(RolloutConfig(), SimpleNamespace(gpu_memory_utilization=0.5))
