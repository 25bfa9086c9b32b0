"""DeepSpeed's ZeRO optimizer steps read the device beside the guard's one read (found on one H100 under
``torch.cuda.set_sync_debug_mode("error")``, tests/gpu/test_update_syncs.py, and by the CPU recorders here);
fastrlhf.engine.deepspeed_reads replaces what reads. On the emulated second device (helpers.other_device, which
records what stalls a CUDA stream): DeepSpeed's own functions read, the replacements do not, and both give the
same values, for finite, non-finite and DeepSpeed's -1 sentinel norms. A whole guarded step (ZeRO-2 and 3 in
bf16 and fp32, ZeRO-0 in bf16) reads once (helpers.other_device.scalar_reads) and drops a NaN gradient
wherever it is. And the engine's throughput timer, which waits for the whole device at every forward and step
from the third optimizer step on, is off."""

from types import SimpleNamespace

import pytest
import torch
from helpers.other_device import OtherDevice, accelerator_syncs

from fastrlhf.engine import deepspeed_reads as R

NORMS = [0.5, 3.0, float("inf"), float("-inf"), float("nan"), -1.0]


@pytest.fixture(scope="module")
def originals():
    R.remove_zero_step_reads()
    return R.ORIGINALS


def test_installed_where_deepspeed_calls_them(originals):
    from deepspeed.runtime import utils
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    assert stage_1_and_2.mask_nan_or_inf_with_val_inplace is R.mask_nan_or_inf_with_val_inplace
    assert stage3.mask_nan_or_inf_with_val_inplace is R.mask_nan_or_inf_with_val_inplace
    assert utils.mask_nan_or_inf_with_val_inplace is R.mask_nan_or_inf_with_val_inplace
    assert stage_1_and_2.DeepSpeedZeroOptimizer.unscale_and_clip_grads is R.unscale_and_clip_grads
    assert originals["unscale_and_clip_grads"] is not R.unscale_and_clip_grads


def _mask(fn, norm):
    with OtherDevice() as dev:
        x = torch.tensor([norm, 2.0]).to(dev.device, non_blocking=True)
        fn(x, device=dev.device)
        out = x.data_.clone()
    return out, [op for _, op, _ in dev.reads]


@pytest.mark.parametrize("norm", NORMS)
def test_mask_nan_or_inf(originals, norm):
    theirs, their_reads = _mask(originals["mask_nan_or_inf_with_val_inplace"], norm)
    ours, our_reads = _mask(R.mask_nan_or_inf_with_val_inplace, norm)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    assert any("host-to-device" in op for op in their_reads), their_reads  # what the GPU run stalled on
    assert our_reads == []


def _clip(fn, norm, clip_grad, loss_scale):
    owner = SimpleNamespace(clip_grad=clip_grad, loss_scale=loss_scale, device=None)
    with OtherDevice() as dev:
        owner.device = dev.device
        grads = [torch.full((3,), 4.0).to(dev.device, non_blocking=True),
                 [torch.full((2,), -2.0).to(dev.device, non_blocking=True)]]
        total = torch.tensor(norm).to(dev.device, non_blocking=True)
        fn(owner, grads, total)
        out = torch.cat([grads[0].data_, grads[1][0].data_])
    return out, [op for _, op, _ in dev.reads]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("clip_grad,loss_scale", [(1.0, 1.0), (0.5, 4.0), (0.0, 2.0)])
def test_unscale_and_clip_grads(originals, norm, clip_grad, loss_scale):
    theirs, their_reads = _clip(originals["unscale_and_clip_grads"], norm, clip_grad, loss_scale)
    ours, our_reads = _clip(R.unscale_and_clip_grads, norm, clip_grad, loss_scale)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    assert our_reads == []
    if clip_grad > 0:  # DeepSpeed branches on the norm's validity: bool() of a device tensor
        assert their_reads, their_reads


def test_a_trained_engine_never_synchronizes_the_device():
    """DeepSpeed's throughput timer (on by default) calls ``get_accelerator().synchronize()`` around every
    ``engine(...)`` forward and step once two optimizer steps are done: on CUDA a wait for the whole device,
    on the CPU a no-op, so it is recorded here."""
    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.deepspeed import build_train_engine
    from fastrlhf.modeling.tiny import make_tiny_llama

    D.init_distributed(timeout_s=60)
    model = make_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1).train()
    engine = build_train_engine(model, DeepSpeedConfig(zero_stage=2), lr=1e-3, max_grad_norm=1.0)
    ids = torch.tensor([[3, 4, 5, 6]])
    with accelerator_syncs() as calls:
        for _ in range(4):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    assert engine.global_steps == 4 and calls == []


def _tiny_engine(stage: int, dtype: torch.dtype, guard):
    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.deepspeed import build_train_engine
    from fastrlhf.modeling.tiny import make_tiny_llama

    D.init_distributed(timeout_s=60)
    torch.manual_seed(0)
    model = make_tiny_llama(vocab_size=64, hidden_size=64, num_layers=2, dtype=dtype).train()
    # ZeRO-3 in sub-groups, as a model over 1e9 parameters is at the default sub_group_size.
    extra = {"zero_optimization": {"sub_group_size": 10_000}} if stage == 3 else None
    ds = DeepSpeedConfig(zero_stage=stage, bf16=dtype == torch.bfloat16, extra=extra)
    engine = build_train_engine(model, ds, lr=1e-2, max_grad_norm=1.0, guard=guard)
    if stage == 3:
        assert len(engine.optimizer.fp32_partitioned_groups_flat) > 2
    return engine


def _weights(engine) -> dict[str, torch.Tensor]:
    """The full weights (gathered at ZeRO-3, where each rank holds a partition), copied."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=hasattr(params[0][1], "ds_id")):
        return {n: p.detach().clone() for n, p in params}


def _poisoned_step(engine, learner, where: str | None) -> bool:
    """One optimizer step whose loss is finite and whose gradient is NaN in the first or the last parameter
    (at ZeRO-3 the first or the last sub-group) or nowhere; whether it stepped."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    hooks = [] if where is None else [(params[0] if where == "first" else params[-1]).register_hook(
        lambda g: torch.full_like(g, float("nan")))]
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    try:
        loss = engine(input_ids=ids, labels=ids).loss
        learner.guard.note_loss(loss)
        learner.backward(loss)
        return learner.step()
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("stage,dtype", [(3, torch.bfloat16), (3, torch.float32), (2, torch.float32),
                                         (2, torch.bfloat16), (0, torch.bfloat16)],
                         ids=["zero3-bf16", "zero3-fp32", "zero2-fp32", "zero2-bf16", "zero0-bf16"])
@pytest.mark.parametrize("poison", [None, "first", "last"])
def test_a_guarded_zero_step_reads_the_device_once(stage, dtype, poison):
    """ZeRO-3's step (any dtype) and ZeRO 1-2's in fp32 decide on DeepSpeed's ``is_invalid_grad_norm`` of the
    global norm whether to step at all: ``bool()`` of a device tensor, a second read beside the guard's. With
    a guard the global norm's validity is part of the guard's decision, and DeepSpeed's check is off in that
    step: one read, and a NaN gradient confined to the last ZeRO-3 sub-group (finite in the first, where
    the guard is asked) still drops the whole step. ZeRO-0 in bf16 trains as ZeRO-1
    (``fastrlhf.config.precision.trained_zero_stage``): DeepSpeed's own stage-0 wrapper reads every parameter's
    gradient."""
    from helpers.other_device import scalar_reads

    from fastrlhf.engine.device import watch_host_reads
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.rl.update import DeepSpeedLearner

    guard = StepGuard(3)
    engine = _tiny_engine(stage, dtype, guard)
    learner = DeepSpeedLearner(engine, guard)
    for _ in range(2):  # ZeRO-3 checks its recorded module order across ranks (a read) until the trace is complete
        assert _poisoned_step(engine, learner, None) and not guard.end_step()
    before = _weights(engine)
    with watch_host_reads() as named, scalar_reads() as reads:
        stepped = _poisoned_step(engine, learner, poison)
    assert [r for r in reads if r[0] is None] == [], reads  # DeepSpeed's own check: utils.py is_invalid_grad_norm
    assert named == ["the optimizer step's skip decision and metrics"], named
    assert stepped is (poison is None) and guard.end_step() is (poison is not None)
    norm = guard.carried()["grad_norm"]
    assert (norm == norm and 0 < norm < float("inf")) is (poison is None), norm
    after = _weights(engine)
    assert all(after[n].numel() > 0 for n in after)
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    assert unchanged is (poison is not None)


def test_without_a_guard_deepspeed_checks_the_norm_itself():
    """An engine built without a guard keeps DeepSpeed's own check (and its read): a NaN gradient in the last
    ZeRO-3 sub-group skips the step there."""
    from helpers.other_device import scalar_reads

    engine = _tiny_engine(3, torch.float32, None)
    with scalar_reads() as reads:
        engine.backward(engine(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss)
        engine.step()
    assert any("utils.py" in where for _, _, where in reads), reads
    assert not engine.optimizer.overflow
    hook = list(engine.module.parameters())[-1].register_hook(lambda g: torch.full_like(g, float("nan")))
    engine.backward(engine(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss)
    engine.step()
    hook.remove()
    assert engine.optimizer.overflow
