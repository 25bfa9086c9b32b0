"""A GPU run's ZeRO-2 engine (bf16 compute, fp32 master weights) sums its micro-batches' gradients in fp32
(``fastrlhf.config.precision.fp32_grad_accumulation``), on a CPU with gloo exactly as on CUDA: the sum DeepSpeed
steps is the fp32 sum of each micro-batch's bf16 gradient, and its step makes no flattened bf16 copy and no fp32
cast of the gradients (8.6 GiB at the peak of a 1.5B GRPO run on one H100 when it summed in bf16)."""

from __future__ import annotations

import pytest
import torch

GRAD_ACCUM = 4


def _engine(extra=None):
    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.deepspeed import build_train_engine
    from fastrlhf.modeling.tiny import make_tiny_llama

    D.init_distributed(timeout_s=60)
    model = make_tiny_llama(vocab_size=96, hidden_size=64, num_layers=2, dtype=torch.bfloat16).train()
    reference = make_tiny_llama(vocab_size=96, hidden_size=64, num_layers=2, dtype=torch.bfloat16).train()
    ds = DeepSpeedConfig(zero_stage=2, bf16=True, extra=extra or {})
    return build_train_engine(model, ds, lr=1e-3, grad_accum=GRAD_ACCUM), reference


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 96, (1, 24), generator=g) for _ in range(GRAD_ACCUM)]


def _micro_batches(engine, reference, batches) -> dict:
    """``GRAD_ACCUM`` micro-batches through the engine (the last one's ``engine.step()`` left to the caller) and
    the reference; the reference's bf16 gradients summed in fp32 by hand, by parameter name."""
    expected = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in reference.named_parameters()}
    for i, ids in enumerate(batches):
        (reference(input_ids=ids, labels=ids).loss / GRAD_ACCUM).backward()
        for n, p in reference.named_parameters():
            expected[n] += p.grad.float()
            p.grad = None
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        if i < GRAD_ACCUM - 1:
            engine.step()  # counts the micro-batch; DeepSpeed steps at the last one (the caller's)
    return expected


def _accumulate(engine, reference):
    """The gradient partition DeepSpeed holds for its step after ``GRAD_ACCUM`` micro-batches, by parameter name,
    and the fp32 sum of the same micro-batches' bf16 gradients."""
    expected = _micro_batches(engine, reference, _batches())
    opt = engine.optimizer
    names = {p: n for n, p in engine.module.named_parameters()}
    pairs = zip(opt.params_in_partition[0], opt.averaged_gradients[0], strict=True)
    held = {names[p]: g.detach().clone().view(p.shape) for p, g in pairs}
    return held, expected


def test_zero2_bf16_sums_the_micro_batches_in_fp32_and_steps_without_copying_them():
    engine, reference = _engine()
    opt = engine.optimizer
    assert engine.config["data_types"] == {"grad_accum_dtype": "fp32"}
    held, expected = _accumulate(engine, reference)
    assert {g.dtype for g in held.values()} == {torch.float32}
    assert held.keys() == expected.keys()
    assert all(torch.equal(held[n], expected[n]) for n in expected), \
        max((held[n] - expected[n]).abs().max().item() for n in expected)

    flattened = []
    for name in ("flatten", "flatten_dense_tensors_aligned"):
        original = getattr(opt, name)
        setattr(opt, name, lambda *a, _f=original, **k: flattened.append(a) or _f(*a, **k))
    partition = opt.averaged_gradients[0].flat_partition
    stepped, inner_step = [], opt.optimizer.step
    fp32_partition = opt.single_partition_of_fp32_groups[0]
    opt.optimizer.step = lambda *a, **k: stepped.append(fp32_partition.grad) or inner_step(*a, **k)
    before = opt.single_partition_of_fp32_groups[0].detach().clone()
    engine.step()
    assert engine.global_steps == 1 and flattened == []
    # the step's gradient is the accumulated fp32 partition itself (no cast), and it is freed after the step
    assert len(stepped) == 1 and stepped[0].data_ptr() == partition.data_ptr()
    assert opt.averaged_gradients[0] is None and opt.single_partition_of_fp32_groups[0].grad is None
    assert not torch.equal(before, opt.single_partition_of_fp32_groups[0])


def test_summing_in_bf16_instead_would_round_the_sum():
    """What the check above tells apart: the bf16 sum that DeepSpeed makes unless told (a user can still ask for
    it through ``deepspeed.extra``, and the plan then counts its step's copies)."""
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.config.precision import fp32_grad_accumulation

    bf16_sum = {"data_types": {"grad_accum_dtype": "bf16"}}
    assert not fp32_grad_accumulation(DeepSpeedConfig(zero_stage=2, bf16=True, extra=bf16_sum))
    engine, reference = _engine(bf16_sum)
    held, expected = _accumulate(engine, reference)
    assert {g.dtype for g in held.values()} == {torch.bfloat16}
    assert not all(torch.equal(held[n].float(), expected[n]) for n in expected)


@pytest.mark.parametrize("changes,fp32", [
    (dict(zero_stage=2, bf16=True), True),
    (dict(zero_stage=1, bf16=True), False),  # DeepSpeed would swap in its BF16_Optimizer
    (dict(zero_stage=0, bf16=True), False),  # trains as ZeRO-1
    (dict(zero_stage=3, bf16=True), False),
    (dict(zero_stage=2, bf16=False), False),  # fp32 weights: their gradients are fp32 already
    (dict(zero_stage=2, bf16=True, offload_optimizer=True), False),  # ZeRO-Offload sums on the host in fp32
    (dict(zero_stage=2, bf16=True, extra={"data_types": {"grad_accum_dtype": "fp32"}}), True),
])
def test_where_gradients_are_summed_in_fp32(changes, fp32):
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.config.precision import fp32_grad_accumulation
    from fastrlhf.engine.deepspeed import deepspeed_config

    ds = DeepSpeedConfig(**changes)
    assert fp32_grad_accumulation(ds) is fp32
    config = deepspeed_config(ds)
    assert (config.get("data_types") == {"grad_accum_dtype": "fp32"}) is fp32
    if not ds.extra:  # deepspeed.extra goes verbatim into every engine's config
        assert "data_types" not in deepspeed_config(ds, trainable=False)


def _two_ranks(rank, port, out):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from deepspeed.utils import safe_get_full_grad

    engine, reference = _engine()
    try:
        batches = _batches()
        out[f"expected{rank}"] = _micro_batches(engine, reference, batches[rank::2] * 2)  # each rank its own
        out[f"full{rank}"] = {n: safe_get_full_grad(p).float().clone() for n, p in engine.module.named_parameters()}
        out[f"dtypes{rank}"] = sorted({str(g.dtype) for g in engine.optimizer.averaged_gradients[0]})
        engine.step()
        out[f"steps{rank}"] = engine.global_steps
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_sum_their_partitions_in_fp32():
    """With data parallelism each rank holds its partition of the ranks' mean gradient; each micro-batch is
    reduced in bf16 (DeepSpeed's communication dtype) before its fp32 sum, so it equals the fp32 sum of the
    ranks' mean within bf16's rounding of the 4 micro-batches; a misplaced partition would be off by whole
    gradients."""
    from helpers.launch import spawn_ranks

    out = spawn_ranks(_two_ranks)
    assert out["steps0"] == out["steps1"] == 1 and out["dtypes0"] == out["dtypes1"] == ["torch.float32"]
    for n, full in out["full0"].items():
        mean = (out["expected0"][n] + out["expected1"][n]) / 2
        torch.testing.assert_close(full, out["full1"][n], rtol=0, atol=0)
        torch.testing.assert_close(full, mean, rtol=2e-2, atol=2e-2 * mean.abs().max().item())
