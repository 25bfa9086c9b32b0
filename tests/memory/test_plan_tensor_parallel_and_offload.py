"""Audit of the memory plan against vLLM's tensor parallelism (a rank holds at least one KV head: vLLM replicates
them where there are fewer than ranks), the CUDA graphs it cannot count, DeepSpeed's device buffer for offloaded
gradients at ZeRO 1-2, and a hand computation of Qwen2-1.5B (the shape of Qwen2.5-1.5B) on 8 GPUs at ZeRO-3."""

import dataclasses

import pytest
from helpers.plan_cases import QWEN25_1_5B, QWEN25_7B, GiB, gpu_grpo, model_folder

from fastrlhf.config import CriticConfig
from fastrlhf.memory import ModelShape
from fastrlhf.memory.plan import kv_cache_bytes_for, plan_memory

H, LAYERS, HEADS, KV_HEADS, D, INTER, V = 1536, 28, 12, 2, 128, 8960, 151936


def params_1_5b() -> int:
    layer = (H * HEADS * D + HEADS * D) + 2 * (H * KV_HEADS * D + KV_HEADS * D) + HEADS * D * H + 3 * H * INTER + 2 * H
    return V * H + LAYERS * layer + H  # tied lm_head, counted once; the final norm


def test_kv_heads_per_rank_are_vllms():
    # vllm/config/model.py (0.26), ModelConfig.get_num_kv_heads: max(1, total_num_kv_heads // tensor_parallel_size)
    two = ModelShape("qwen2", V, H, LAYERS, HEADS, KV_HEADS, D, INTER, True)
    assert [two.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    eight = dataclasses.replace(two, heads=32, kv_heads=8)
    assert [eight.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [8, 4, 2, 1]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_tensor_parallel_rank_caches_its_groups_sequences_with_its_own_kv_heads(tmp_path, tp):
    folder = model_folder(tmp_path / "m", QWEN25_1_5B)
    plan = plan_memory(gpu_grpo(folder, 2, tensor_parallel_size=tp, kv_cache_bytes="auto"), 8, 80 * GiB)
    # 128 prompts x 8 completions over 8 ranks: 128 sequences per rank, the group's tp x 128 generated at once;
    # 512 + 1024 tokens (a multiple of 16); each rank holds max(1, 2 // tp) of the 2 KV heads in all 28 layers.
    need = tp * 128 * 1536 * LAYERS * 2 * max(1, KV_HEADS // tp) * D * 2
    assert plan.kv_cache_bytes == need == plan.components["rollout KV cache"]
    assert kv_cache_bytes_for(gpu_grpo(folder, 2, tensor_parallel_size=tp), 8, "cuda") == need
    # At tp 4 each rank still holds 1 of the 2 heads: twice what a quarter of them would be (5.25 -> 10.5 GiB)
    assert need == {1: 5637144576, 2: 5637144576, 4: 2 * 5637144576, 8: 4 * 5637144576}[tp]


def test_a_kv_cache_under_tensor_parallelism_says_how_much_of_the_batch_it_holds(tmp_path):
    folder = model_folder(tmp_path / "m", QWEN25_7B)  # 4 KV heads: at tp 8 every rank holds 1
    plan = plan_memory(gpu_grpo(folder, 3, tensor_parallel_size=8), 8, 80 * GiB)  # 8 GiB of KV cache per rank
    need = 8 * 128 * 1536 * 28 * 2 * 1 * 128 * 2
    assert plan.kv_cache_bytes == need
    assert any(
        n.startswith("rollout.kv_cache_bytes (8.00 GiB) holds 38% of the batch's KV cache (21.00 GiB)")
        for n in plan.notes
    )
    at_tp_4 = plan_memory(gpu_grpo(folder, 3, tensor_parallel_size=4), 8, 80 * GiB)
    assert at_tp_4.kv_cache_bytes == need // 2  # 4 ranks x 1 head each: the same bytes as one rank's 4 heads


def test_tensor_parallel_rollout_weights_replicate_the_kv_heads(tmp_path):
    folder = model_folder(tmp_path / "m", QWEN25_1_5B)
    P = params_1_5b()
    kv = LAYERS * 2 * (H * KV_HEADS * D + KV_HEADS * D)  # k_proj and v_proj, with their biases
    for tp, kv_per_rank in ((2, kv // 2), (4, kv // 2), (8, kv // 2)):  # 1 of the 2 heads on every rank
        plan = plan_memory(gpu_grpo(folder, 2, tensor_parallel_size=tp), 8, 80 * GiB)
        assert plan.components["rollout weights"] == ((P - kv) // tp + kv_per_rank) * 2
    assert plan_memory(gpu_grpo(folder, 2), 8, 80 * GiB).components["rollout weights"] == P * 2


def test_cuda_graphs_are_named_as_not_counted(tmp_path):
    folder = model_folder(tmp_path / "m", QWEN25_1_5B)
    said = "vLLM's CUDA graphs are not counted"
    assert any(n.startswith(said) for n in plan_memory(gpu_grpo(folder, 2), 8, 80 * GiB).notes)
    assert any(n.startswith(said) for n in plan_memory(gpu_grpo(folder, 2, sleep=True), 8, 80 * GiB).notes)
    eager = plan_memory(gpu_grpo(folder, 2, enforce_eager=True), 8, 80 * GiB)
    hf = plan_memory(gpu_grpo(folder, 2, engine="hf"), 8, 80 * GiB)
    assert not any(n.startswith(said) for n in eager.notes + hf.notes)
    assert eager.components == plan_memory(gpu_grpo(folder, 2), 8, 80 * GiB).components


def test_qwen2_1_5b_zero3_on_8x80_by_hand(tmp_path):
    P = params_1_5b()
    assert P == 1_543_714_304
    plan = plan_memory(gpu_grpo(model_folder(tmp_path / "m", QWEN25_1_5B), 3), 8, 80 * GiB, "cuda")
    tokens = 8 * 1536  # 256 / 8 ranks / grad_accum 4 = 8 sequences of 512 + 1024 tokens
    layer_act = 16 * H + 10 * HEADS * D + 8 * INTER
    expected = {
        "actor weights": P * 2 // 8,  # bf16, sharded
        "actor gradients": P * 2 // 8,  # ZeRO-3: a bf16 partition, held between steps
        "actor optimizer states": P * 12 // 8,  # fp32 master and Adam's two moments, sharded
        "reference weights": P * 2 // 8,  # a ZeRO-3 frozen engine
        # one reduce bucket (overlap_comm does not double it at ZeRO-3), and for the actor and the reference the
        # 1e9 live parameters plus the 5e7 prefetch bucket that stay gathered (the model is larger than that)
        "ZeRO buffers": 500_000_000 * 2 + 2 * 1_050_000_000 * 2,
        "rollout weights": P * 2,
        "rollout KV cache": 8 * GiB,
        "rollout working memory": 16384 * (3 * INTER + 4 * H) * 2 + 3 * 1024 * V * 4,
        "activations": tokens * (LAYERS * 2 * H + 2 * layer_act + 12 * H) + 8 * 1536 * 1536,
        "fused loss": 2048 * V * 2 + V * H * 4 + 8 * 1024 * H * 2,  # 4 chunks of 2,048 completion tokens
        "scoring activations": tokens * 2 * (2 * H + 2 * D + 2 * H + 3 * INTER) + 8 * 1536 * 1536,
        "optimizer step temporaries": P // 8 * 4,  # the fp32 partition, under sub_group_size (1e9)
        "weight sync bucket": V * H * 2,  # gathered: the embedding (467 MB) is larger than the 256 MiB bucket
        "CUDA context": GiB,
    }
    rollout = sum(v for k, v in expected.items() if k.startswith("rollout"))
    not_at_peak = (
        expected["scoring activations"] + expected["optimizer step temporaries"] + expected["weight sync bucket"]
    )
    expected["allocator slack"] = int((sum(expected.values()) - rollout - not_at_peak - GiB) * 0.09)
    assert plan.components == expected
    assert plan.peak_phase == "update" and plan.fits
    assert plan.total == sum(expected.values()) - not_at_peak


def with_deepspeed(config, **changes):
    return dataclasses.replace(config, deepspeed=dataclasses.replace(config.deepspeed, **changes))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_2_offload_keeps_a_device_buffer_of_the_largest_gradient(tmp_path, stage):
    # DeepSpeedZeroOptimizer with cpu_offload copies each gradient to the host through temp_grad_buffer_for_gpu_offload,
    # a device tensor of the largest trained weight's elements in the compute dtype, made at start-up: for the 1.5B
    # model its tied embedding, 151,936 x 1,536 in bf16 (0.43 GiB), beside the reduce bucket.
    folder = model_folder(tmp_path / "m", QWEN25_1_5B)
    offload = with_deepspeed(gpu_grpo(folder, stage), offload_optimizer=True)
    plan = plan_memory(offload, 8, 80 * GiB)
    assert plan.components["ZeRO buffers"] == 500_000_000 * 2 + V * H * 2
    on_device = plan_memory(gpu_grpo(folder, stage), 8, 80 * GiB)
    assert on_device.components["ZeRO buffers"] == 500_000_000 * 2
    ppo = dataclasses.replace(offload, algorithm="ppo", critic=CriticConfig())  # two trained engines
    assert plan_memory(ppo, 8, 80 * GiB).components["ZeRO buffers"] == 2 * (500_000_000 * 2 + V * H * 2)
    lora = dataclasses.replace(offload, model=dataclasses.replace(offload.model, lora_r=8))
    adapter = ModelShape("qwen2", V, H, LAYERS, HEADS, KV_HEADS, D, INTER, True, qkv_bias=True).lora_params(
        8, ["q_proj", "v_proj"]
    )
    assert 0 < plan_memory(lora, 8, 80 * GiB).components["ZeRO buffers"] - 500_000_000 * 2 <= adapter * 2
    # ZeRO-3 offload moves its gradient partitions to the host itself: nothing added
    zero3 = with_deepspeed(gpu_grpo(folder, 3), offload_optimizer=True)
    assert plan_memory(zero3, 8, 80 * GiB).components["ZeRO buffers"] == 500_000_000 * 2 + 2 * 1_050_000_000 * 2
