"""ZeRO 1-2 without a second copy of weights that already are the master weights.

DeepSpeed's ZeRO 1-2 optimizer steps an "fp32 master" partition of the weights and copies it back
into the model's flat weights afterwards. It makes that partition by cloning the rank's slice of the
model's flat weights, even when they are fp32 on the same device already, so an fp32 run holds its
rank's partition twice: 4 bytes per parameter / ranks (workload C: 97 MiB per rank of 2, at the
update's peak). ZeRO-3 clones one too (DeepSpeed 0.19.8 compares a ``torch.device`` with a device
name, never equal), which this module leaves alone.

:func:`share_master_weights` points the master partition at the model's own slice instead. Adam
then updates the model's weights in place, and the copy back, ``slice.copy_(master)``, finds the
same memory and returns (torch's ``copy_`` returns early when source and destination are the same
view). Nothing else changes: the optimizer keeps the same ``Parameter`` objects (so its state and
checkpoints are keyed and shaped as before), the all-gather reads the same slice, and DeepSpeed's
links from each weight to its master fragment are rebuilt on the shared memory. Checkpoints save a
copy of the partition, as ``torch.save`` would otherwise write the whole flat weights it is a view of.

Left alone: CPU offload (the master lives on the host and the weights on the device), bf16 or fp16
weights with fp32 masters, ZeRO-0, which has no such copy, and ZeRO-3.
"""

from __future__ import annotations

__all__ = ["share_master_weights"]


def share_master_weights(optimizer) -> int:
    """Make a ZeRO 1-2 optimizer's master partitions views of the model's flat weights wherever the
    two have the same dtype, device and shape. Returns the bytes no longer held (0 if none)."""
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None)
    slices = getattr(optimizer, "parallel_partitioned_bit16_groups", None)
    if masters is None or slices is None or getattr(optimizer, "cpu_offload", False):
        return 0
    import torch
    import torch.distributed as dist

    freed = 0
    for i, master in enumerate(masters):
        own = slices[i][dist.get_rank(group=optimizer.real_dp_process_group[i])]
        if (own.dtype, own.device, own.shape) != (master.dtype, master.device, master.shape):
            continue
        if own.untyped_storage().data_ptr() == master.untyped_storage().data_ptr():
            continue  # already shared
        with torch.no_grad():
            own.copy_(master)  # the master is the truth if a checkpoint was loaded into it
        freed += master.numel() * master.element_size()
        master.data = own
    if freed and hasattr(optimizer, "_link_all_hp_params"):
        # Each weight's _hp_mapping holds a view of the old master (safe_get_full_fp32_param,
        # universal checkpoints); rebuilt, they point into the shared memory and the old one is freed.
        optimizer._link_all_hp_params()
    if freed and hasattr(optimizer, "state_dict"):
        _save_masters_alone(optimizer)
    return freed


def _save_masters_alone(optimizer) -> None:
    """The optimizer's state dict gets copies of the master partitions: ``torch.save`` writes a view's
    whole storage, so the shared views would put all ranks' weights in every rank's optimizer file."""
    from deepspeed.checkpoint.constants import SINGLE_PARTITION_OF_FP32_GROUPS

    state_dict = optimizer.state_dict

    def state_dict_with_own_masters():
        out = state_dict()
        if SINGLE_PARTITION_OF_FP32_GROUPS in out:
            out[SINGLE_PARTITION_OF_FP32_GROUPS] = [t.clone() for t in out[SINGLE_PARTITION_OF_FP32_GROUPS]]
        return out

    optimizer.state_dict = state_dict_with_own_masters
