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
