"""ZeRO 1-2 engines of fp32 weights step the weights themselves, with the results of DeepSpeed's copy."""

import gc

import pytest
import torch

from fastrlhf import distributed as D
from fastrlhf.config import DeepSpeedConfig
from fastrlhf.cpu import zero_master
from fastrlhf.engine.checkpoint import load_latest, save_checkpoint
from fastrlhf.engine.deepspeed import build_train_engine
from fastrlhf.modeling.tiny import make_tiny_llama

IDS = torch.tensor([[3, 4, 5, 6, 7], [9, 8, 7, 6, 5]])


def _engine(stage: int, share: bool, monkeypatch):
    D.init_distributed(timeout_s=60)
    if not share:
        monkeypatch.setattr(zero_master, "share_master_weights", lambda optimizer: 0)
    model = make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=2, num_layers=2).train()
    engine = build_train_engine(model, DeepSpeedConfig(zero_stage=stage), lr=1e-2, weight_decay=0.1,
                                  max_grad_norm=0.5)
    monkeypatch.undo()
    return engine


def _train(engine, steps: int = 3) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=IDS, labels=IDS).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _weights(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _live_storages() -> set[int]:
    out = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                out.add(o.untyped_storage().data_ptr())
            except RuntimeError:  # fake and meta tensors other tests left to the collector have no data
                pass
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_the_master_partition_is_the_models_own_slice_and_training_is_unchanged(stage, monkeypatch):
    cloned = []
    share = zero_master.share_master_weights
    monkeypatch.setattr(zero_master, "share_master_weights", lambda optimizer: cloned.append(
        optimizer.single_partition_of_fp32_groups[0].untyped_storage().data_ptr()) or share(optimizer))
    shared = _engine(stage, True, monkeypatch)
    gc.collect()
    assert cloned and cloned[0] not in _live_storages()  # DeepSpeed's clone is freed, not just unused
    opt = shared.optimizer
    own = opt.parallel_partitioned_bit16_groups[0][0]
    master = opt.single_partition_of_fp32_groups[0]
    assert master.data_ptr() == own.data_ptr() and master.shape == own.shape
    assert opt.optimizer.param_groups[0]["params"][0] is master  # same Parameter: state and checkpoints as before

    copied = _engine(stage, False, monkeypatch)
    assert copied.optimizer.single_partition_of_fp32_groups[0].data_ptr() != \
        copied.optimizer.parallel_partitioned_bit16_groups[0][0].data_ptr()

    start = _weights(shared)
    assert _train(shared) == _train(copied)
    a, b = _weights(shared), _weights(copied)
    assert all(not torch.equal(a[n], start[n]) for n in a)  # every weight was stepped
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # DeepSpeed's links from each weight to its master fragment point into the shared memory.
    from deepspeed.utils import safe_get_full_fp32_param

    for name, p in shared.module.named_parameters():
        assert torch.equal(safe_get_full_fp32_param(p), p.detach()), name


def test_a_checkpoint_round_trip_resumes_to_the_same_weights(tmp_path, monkeypatch):
    first = _engine(2, True, monkeypatch)
    _train(first, 2)
    save_checkpoint(str(tmp_path), 2, {"actor": first})
    _train(first, 2)
    resumed = _engine(2, True, monkeypatch)
    load_latest(str(tmp_path), {"actor": resumed})
    assert resumed.optimizer.single_partition_of_fp32_groups[0].data_ptr() == \
        resumed.optimizer.parallel_partitioned_bit16_groups[0][0].data_ptr()
    _train(resumed, 2)
    a, b = _weights(first), _weights(resumed)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_checkpoint_holds_the_ranks_partition_not_the_whole_flat_weights():
    from deepspeed.checkpoint.constants import SINGLE_PARTITION_OF_FP32_GROUPS as KEY

    D.init_distributed(timeout_s=60)
    flat = torch.arange(16, dtype=torch.float32)

    class Optimizer:  # the layout of DeepSpeed's ZeRO-2 optimizer, as rank 0 of 2 sees it
        single_partition_of_fp32_groups = [torch.nn.Parameter(flat[:8].clone())]
        parallel_partitioned_bit16_groups = [[flat[:8], flat[8:]]]
        real_dp_process_group = [None]

        def state_dict(self):  # as DeepSpeed's: views of the masters, without their padding
            return {KEY: [m[:7] for m in self.single_partition_of_fp32_groups], "other": 1}

    optimizer = Optimizer()
    assert zero_master.share_master_weights(optimizer) == 8 * 4
    saved = optimizer.state_dict()
    assert saved["other"] == 1 and torch.equal(saved[KEY][0], flat[:7])
    assert saved[KEY][0].untyped_storage().nbytes() == 7 * 4  # not the 16 values torch.save would write


def test_other_dtypes_and_offload_keep_their_master_copy():
    D.init_distributed(timeout_s=60)
    flat = torch.zeros(8, dtype=torch.bfloat16)
    master = torch.nn.Parameter(torch.ones(8))

    class Optimizer:
        single_partition_of_fp32_groups = [master]
        parallel_partitioned_bit16_groups = [[flat]]
        real_dp_process_group = [None]
        cpu_offload = False

    assert zero_master.share_master_weights(Optimizer()) == 0
    assert master.data_ptr() != flat.data_ptr() and torch.equal(master.detach(), torch.ones(8))

    Optimizer.parallel_partitioned_bit16_groups = [[torch.zeros(8)]]
    Optimizer.cpu_offload = True
    assert zero_master.share_master_weights(Optimizer()) == 0
    Optimizer.cpu_offload = False
    assert zero_master.share_master_weights(Optimizer()) == 8 * 4
    assert master.data_ptr() == Optimizer.parallel_partitioned_bit16_groups[0][0].data_ptr()
    assert torch.equal(Optimizer.parallel_partitioned_bit16_groups[0][0], torch.ones(8))  # the master's values
