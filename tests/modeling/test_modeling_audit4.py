"""Fourth modeling audit: the CUDA branch of the tied embedding's gradient run on the CPU (a token's many lookups
summed in fp32 where CUDA's bf16 index_add_ rounds per lookup: tests/gpu/test_tied_gradient_on_cuda.py), and a
resume whose checkpoint trained other parameters than the run now trains (a PPO critic saved before its untied
lm_head was frozen) refused in one line naming them."""

import os

import pytest
import torch

from fastrlhf import distributed as D
from fastrlhf.config import DeepSpeedConfig, ModelConfig
from fastrlhf.engine.checkpoint import CheckpointError, load_latest, save_checkpoint
from fastrlhf.engine.deepspeed import build_train_engine
from fastrlhf.modeling.loading import base_model, load_value_model
from fastrlhf.modeling.tiny import save_tiny_llama

V, H = 16, 64  # the sorted-sum check's sizes


def _critic(folder: str, stage: int, lm_head_trains: bool):
    torch.manual_seed(0)
    critic = load_value_model(ModelConfig(path=folder, dtype="float32"))
    if lm_head_trains:  # as the critic was before its untied lm_head was frozen
        base_model(critic.lm).get_output_embeddings().requires_grad_(True)
    return build_train_engine(critic, DeepSpeedConfig(zero_stage=stage, bf16=False), lr=1e-2)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_critic_checkpoint_that_trained_its_lm_head_is_refused_in_one_line_naming_it(tmp_path, stage):
    """Before: ZeRO-2 raised a bare KeyError('lm.lm_head.weight') deep in DeepSpeed's load, ZeRO-0 torch's "a
    parameter group that doesn't match the size of optimizer's group"."""
    D.init_distributed(timeout_s=60)
    folder = str(tmp_path / "model")
    save_tiny_llama(folder, tie_word_embeddings=False, num_layers=1)
    old = _critic(folder, stage, lm_head_trains=True)
    loss = old(torch.randint(0, 200, (2, 8))).pow(2).sum()
    old.backward(loss)
    old.step()
    out = str(tmp_path / "run")
    save_checkpoint(out, 1, {"critic": old})

    with pytest.raises(CheckpointError) as caught:
        load_latest(out, {"critic": _critic(folder, stage, lm_head_trains=False)})
    said = str(caught.value)
    assert "\n" not in said and "engine 'critic'" in said and "--overwrite" in said
    assert os.path.join("checkpoints", "step-1") in said
    if stage:
        assert "trained lm.lm_head.weight, which this run freezes" in said
    else:
        assert "saved training 14 parameters, this run trains 13" in said


def test_the_sorted_sum_that_cuda_takes_adds_every_lookup(monkeypatch):
    """The CUDA branch (index_put_'s accumulate, unsafe) run on this CPU in fp32, against index_add_."""
    import fastrlhf.modeling.tied_gradient as T

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, V, (300,), generator=g)
    grad_rows, start = torch.randn(300, H, generator=g), torch.randn(V, H, generator=g)
    want = start.clone().index_add_(0, rows, grad_rows)
    monkeypatch.setattr(T, "INDEX_ADD_SUMS_IN_FP32", ())
    got = start.clone()
    T._add_rows(got, rows, grad_rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
