"""DeepSpeed's ZeRO 1-2 optimizer step reads the device twice per parameter group (found on one H100 under
``torch.cuda.set_sync_debug_mode("error")``, tests/gpu/test_update_syncs.py); fastrlhf.engine.deepspeed_reads
replaces the two functions. Here, on the emulated second device (helpers.other_device, which records what
stalls a CUDA stream): DeepSpeed's own functions read, the replacements do not, and both give the same values,
for finite, non-finite and DeepSpeed's -1 sentinel norms. And the engine's throughput timer, which waits for the
whole device at every forward and step from the third optimizer step on, is off."""

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
