"""The learner reports the gradient norm at every ZeRO stage (DeepSpeed drops it at stage 0)."""

import math

import pytest
import torch

from fastrlhf import distributed as D
from fastrlhf.config import DeepSpeedConfig
from fastrlhf.engine.deepspeed import build_train_engine
from fastrlhf.rl.update import as_learner


def test_stage0_engine_reports_the_preclip_grad_norm():
    D.init_distributed(timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    engine = build_train_engine(model, DeepSpeedConfig(zero_stage=0), lr=1e-3, max_grad_norm=0.1)
    learner = as_learner(engine)
    x = torch.randn(8, 4)
    loss = (engine(x) ** 2).sum() * 10  # a large gradient, so clipping to 0.1 changes it
    learner.backward(loss)
    expected = math.sqrt(sum(float(p.grad.float().square().sum()) for p in model.parameters()))
    assert learner.step()
    assert expected > 0.1
    assert math.isclose(learner.grad_norm(), expected, rel_tol=1e-5)


def test_a_cpu_engine_trims_the_heap_when_its_backward_reaches_the_embeddings(monkeypatch):
    import fastrlhf.cpu.hostmem as hostmem
    from fastrlhf.modeling.tiny import make_tiny_llama

    if not hostmem.trim_heap():  # off glibc there is nothing to install (and trim_heap says so)
        pytest.skip("glibc's malloc_trim only")
    D.init_distributed(timeout_s=60)
    model = make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=1).train()
    engine = build_train_engine(model, DeepSpeedConfig(zero_stage=0), lr=1e-3)
    trims = []
    monkeypatch.setattr(hostmem, "trim_heap", lambda: trims.append(1) or True)
    ids = torch.randint(0, 64, (2, 5))
    as_learner(engine).backward(engine(input_ids=ids, labels=ids).loss)
    assert trims == [1]


def test_guarded_adamw_takes_the_fused_step_where_torch_has_one_and_updates_as_the_default():
    from fastrlhf.engine.guards import GuardedAdamW

    torch.manual_seed(0)
    weights = [torch.randn(33, 7), torch.randn(5)]
    fused_params = [torch.nn.Parameter(w.clone()) for w in weights]
    plain_params = [torch.nn.Parameter(w.clone()) for w in weights]
    fused = GuardedAdamW(fused_params, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(plain_params, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True and not plain.defaults.get("fused")
    for _ in range(4):
        grads = [torch.randn_like(w) for w in weights]
        for p, q, g in zip(fused_params, plain_params, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        plain.step()
    for p, q in zip(fused_params, plain_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # No fused kernel for meta tensors (torch would only fail at the first step): the default step.
    assert GuardedAdamW([torch.nn.Parameter(torch.empty(3, device="meta"))], lr=1e-3).defaults["fused"] is False
    assert GuardedAdamW(fused_params, lr=1e-3, foreach=True).defaults["fused"] is None


def test_zero2_engine_steps_with_the_fused_adamw():
    from fastrlhf.engine.guards import GuardedAdamW

    D.init_distributed(timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    engine = build_train_engine(model, DeepSpeedConfig(zero_stage=2), lr=1e-3)
    inner = engine.optimizer.optimizer
    assert isinstance(inner, GuardedAdamW) and inner.defaults["fused"] is True
    before = [p.detach().clone() for p in model.parameters()]
    learner = as_learner(engine)
    learner.backward((engine(torch.randn(8, 4)) ** 2).sum())
    assert learner.step()
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True))


def test_bf16_zero2_decides_a_step_in_one_named_read():
    """bf16 ZeRO-2 as on a GPU: DeepSpeed's own overflow check is off (deepspeed_config), so the guard's
    decision (its one host read per optimizer step, which brings the gradient norm) skips a NaN step."""
    from fastrlhf.engine.device import watch_host_reads
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.rl.update import DeepSpeedLearner

    D.init_distributed(timeout_s=60)
    guard = StepGuard(3)
    model = make_tiny_llama(vocab_size=64, hidden_size=64, num_layers=1, dtype=torch.bfloat16).train()
    engine = build_train_engine(model, DeepSpeedConfig(zero_stage=2, bf16=True), lr=1e-2, max_grad_norm=1.0,
                                  guard=guard)
    learner = DeepSpeedLearner(engine, guard)
    ids = torch.tensor([[3, 4, 5, 6]])
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for poison in (float("nan"), 1.0):
        with watch_host_reads() as reads:
            loss = engine(input_ids=ids, labels=ids).loss * poison
            guard.note_loss(loss)
            learner.backward(loss)
            stepped = learner.step()
            norm = learner.grad_norm()
        assert reads == ["the optimizer step's skip decision and metrics"], reads
        assert guard.end_step() is not stepped
        unchanged = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
        assert unchanged is not stepped and (norm > 0 if stepped else True), (poison, norm)


def test_zero3_sub_groups_share_one_decision_and_its_metrics():
    """ZeRO-3 runs optimizer.step() once per sub-group of ``sub_group_size`` parameters (1e9 by default: a
    1.5B model has two, a tiny CPU model one). On the 1.5B PPO run on an H100 the second sub-group's
    step asked the guard again: a second host read, and the step's carried metrics (policy and value
    losses) replaced by the second read's, logged as NaN. Here a tiny model is split into sub-groups."""
    from fastrlhf.engine.device import watch_host_reads
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.rl.update import DeepSpeedLearner

    D.init_distributed(timeout_s=60)
    guard = StepGuard(3)
    model = make_tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, dtype=torch.bfloat16).train()
    ds = DeepSpeedConfig(zero_stage=3, bf16=True, extra={"zero_optimization": {"sub_group_size": 10_000}})
    engine = build_train_engine(model, ds, lr=1e-2, max_grad_norm=1.0, guard=guard)
    assert len(engine.optimizer.fp32_partitioned_groups_flat) > 2  # several sub-groups, as at 1.5B
    learner = DeepSpeedLearner(engine, guard)
    ids = torch.tensor([[3, 4, 5, 6]])
    for poison in (1.0, float("nan")):
        with watch_host_reads() as reads:
            loss = engine(input_ids=ids, labels=ids).loss * poison
            guard.note_loss(loss)
            guard.carry({"policy_loss": loss.detach()})
            learner.backward(loss)
            stepped = learner.step()
            carried = guard.carried()
        assert reads == ["the optimizer step's skip decision and metrics"], reads
        assert stepped is (poison == 1.0) and guard.end_step() is not stepped
        # the NaN step reaches our optimizer too (ZeRO-3's own check of the norm is the guard's), which drops it
        assert "policy_loss" in carried and (carried["grad_norm"] < float("inf")) is stepped, carried
        assert (carried["policy_loss"] == carried["policy_loss"]) is stepped, carried  # NaN only when poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_all_finite_sees_every_non_finite_value(dtype, bad):
    from fastrlhf.engine.guards import all_finite

    t = torch.randn(1000).to(dtype)
    if bad is not None:
        t[617] = bad
    ok = all_finite(torch.zeros(0), torch.arange(3), t, torch.ones(2, 3))
    assert ok.dim() == 0 and bool(ok) is (bad is None)
    assert bool(all_finite(torch.arange(3))) and bool(all_finite())


@pytest.mark.parametrize("stage", [2, 3])
def test_a_step_that_trains_no_token_moves_no_weight_in_a_zero_engine(stage):
    """A minibatch with no trained token (``guard.note_trained``) has zero gradients, on which AdamW would still
    move every weight by its momentum and weight decay: the engine's step leaves them, every ZeRO-3 sub-group
    included, in the same one read, and the guard does not count it as a skipped (bad) step."""
    from fastrlhf.engine.device import watch_host_reads
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.rl.update import DeepSpeedLearner

    D.init_distributed(timeout_s=60)
    guard = StepGuard(3)
    model = make_tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, dtype=torch.bfloat16).train()
    extra = {"zero_optimization": {"sub_group_size": 10_000}} if stage == 3 else None
    ds = DeepSpeedConfig(zero_stage=stage, bf16=True, extra=extra)
    engine = build_train_engine(model, ds, lr=1e-2, max_grad_norm=1.0, weight_decay=0.1, guard=guard)
    learner = DeepSpeedLearner(engine, guard)
    ids = torch.tensor([[3, 4, 5, 6]])
    for tokens in (3, 0):
        state = [p.detach().clone() for p in _full_parameters(engine)]
        with watch_host_reads() as reads:
            loss = engine(input_ids=ids, labels=ids).loss * float(tokens > 0)  # no token: zero gradients
            guard.note_trained(torch.tensor(float(tokens)))
            learner.backward(loss)
            stepped = learner.step()
        assert reads == ["the optimizer step's skip decision and metrics"], reads
        assert stepped is (tokens > 0) and guard.step_empty is (tokens == 0) and not guard.end_step()
        unchanged = all(torch.equal(a, b) for a, b in zip(state, _full_parameters(engine), strict=True))
        assert unchanged is (tokens == 0), tokens
    assert guard.skipped_total == 0


def _full_parameters(engine):
    """The parameters as the forward sees them (gathered under ZeRO-3)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]
