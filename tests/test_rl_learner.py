"""The learner reports the gradient norm at every ZeRO stage (DeepSpeed drops it at stage 0)."""

import math

import torch

from fastrlhf import distributed as D
from fastrlhf.config import DeepSpeedConfig
from fastrlhf.rl.update import as_learner


def test_stage0_engine_reports_the_preclip_grad_norm():
    D.init_distributed(timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    engine = D.build_train_engine(model, DeepSpeedConfig(zero_stage=0), lr=1e-3, max_grad_norm=0.1)
    learner = as_learner(engine)
    x = torch.randn(8, 4)
    loss = (engine(x) ** 2).sum() * 10  # a large gradient, so clipping to 0.1 changes it
    learner.backward(loss)
    expected = math.sqrt(sum(float(p.grad.float().square().sum()) for p in model.parameters()))
    assert learner.step()
    assert expected > 0.1
    assert math.isclose(learner.grad_norm(), expected, rel_tol=1e-5)


def test_a_cpu_engine_trims_the_heap_when_its_backward_reaches_the_embeddings(monkeypatch):
    import fastrlhf.hostmem as hostmem
    from fastrlhf.tiny_models import make_tiny_llama

    if not hostmem.trim_heap():  # off glibc there is nothing to install (and trim_heap says so)
        import pytest

        pytest.skip("glibc's malloc_trim only")
    D.init_distributed(timeout_s=60)
    model = make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=1).train()
    engine = D.build_train_engine(model, DeepSpeedConfig(zero_stage=0), lr=1e-3)
    trims = []
    monkeypatch.setattr(hostmem, "trim_heap", lambda: trims.append(1) or True)
    ids = torch.randint(0, 64, (2, 5))
    as_learner(engine).backward(engine(input_ids=ids, labels=ids).loss)
    assert trims == [1]
