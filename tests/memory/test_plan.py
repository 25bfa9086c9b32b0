"""``fastrlhf plan``: the memory plan's figures, worked out by hand for three GPU runs; parameter counts
against the real transformers models; the command's output and exit codes; and the plan against the
peak RSS of real CPU runs."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from helpers.paths import ROOT
from helpers.plan_cases import QWEN25_1_5B, QWEN25_7B, GiB, gpu_grpo, model_folder

from fastrlhf.config import ConfigError, CriticConfig, RewardConfig
from fastrlhf.memory.plan import PlanError, kv_cache_bytes_for, parse_bytes, plan_memory

MARGIN = 0.05


def util(budget, trainer_bytes):
    """gpu_memory_utilization: what the trainer leaves of the budget, less the 5% margin, floored to 0.01."""
    return int((budget - trainer_bytes - int(budget * MARGIN)) * 100 // budget) / 100


# --------------------------------------------------------------------------------------------
# Three GPU runs worked out by hand
# --------------------------------------------------------------------------------------------

def qwen_1_5b_params():
    h, layers, d, inter, V = 1536, 28, 128, 8960, 151936
    q = h * 12 * d + 12 * d          # q_proj with bias
    kv = 2 * (h * 2 * d + 2 * d)      # k_proj, v_proj: 2 kv heads, with bias
    o = 12 * d * h                    # o_proj, no bias
    mlp = 3 * h * inter                   # gate, up, down
    layer = q + kv + o + mlp + 2 * h  # + two RMSNorms
    return V * h + layers * layer + h  # tied lm_head; final norm


def qwen_7b_params():
    h, layers, d, inter, V = 3584, 28, 128, 18944, 152064
    layer = (h * 28 * d + 28 * d) + 2 * (h * 4 * d + 4 * d) + 28 * d * h + 3 * h * inter + 2 * h
    return 2 * V * h + layers * layer + h  # embedding and an untied lm_head


def test_published_parameter_counts():
    assert qwen_1_5b_params() == 1_543_714_304
    assert qwen_7b_params() == 7_615_616_512


def test_qwen2_5_1_5b_zero2_on_8x80(tmp_path):
    P, h, inter, V = qwen_1_5b_params(), 1536, 8960, 151936
    budget = 80 * GiB
    plan = plan_memory(gpu_grpo(model_folder(tmp_path / "m", QWEN25_1_5B), zero_stage=2), 8, budget, "cuda")
    tokens = 8 * 1536  # micro-batch 256 / 8 ranks / grad_accum 4 = 8 sequences of 512 + 1024
    layer_act = 16 * h + 10 * 12 * 128 + 8 * inter  # bf16 bytes per token and layer
    # 1 GiB of fp32 logits, grown by the bf16 [V, h] scratch the head's gradient does without on CUDA (its GEMMs
    # sum in fp32), holds 2,496 tokens (a multiple of 64); the 8,192 completion tokens of a micro-batch then
    # take 4 chunks of 2,048 (without the growth: 5 of 1,664).
    chunk = 2048
    assert ((GiB + V * h * 2) // (4 * V)) // 64 * 64 == 2496 and -(-8192 // 2496) == 4 and 8192 // 4 == chunk
    expected = {
        "actor weights": P * 2,                  # bf16, whole on every rank
        # ZeRO-2 shards the gradients, summed in fp32 (fastrlhf.config.precision.fp32_grad_accumulation) from the
        # update's first backward to the step, which frees them: a part of the update, not held
        "actor gradients": P * 4 // 8,
        "actor optimizer states": P * 12 // 8,   # fp32 master + 2 Adam moments, sharded
        "reference weights": P * 2,
        "ZeRO buffers": 500_000_000 * 2,          # DeepSpeed's default reduce bucket, bf16
        "rollout weights": P * 2,                # vLLM's bf16 copy
        "rollout KV cache": 8 * GiB,             # rollout.kv_cache_bytes
        "rollout working memory": 16384 * (3 * inter + 4 * h) * 2 + 3 * 1024 * V * 4,
        "activations": tokens * (28 * 2 * h + 2 * layer_act + 12 * h) + 8 * 1536 * 1536,
        "fused loss": chunk * V * 2 + V * h * 4 + 8 * 1024 * h * 2,  # fp32 grad_W, no bf16 scratch
        # the reference's no-grad forward (its decoder's working set beats its head's chunk): embeddings, layer
        # input and RoPE's cos/sin, plus the MLP's residual, normed input and 3 I; and the mask
        "scoring activations": tokens * 2 * (2 * h + 2 * 128 + 2 * h + 3 * inter) + 8 * 1536 * 1536,
        "CUDA context": GiB,
    }
    # the step uses DeepSpeed's fp32 partition as it is (fused AdamW: no temporaries), so it holds the gradients
    update = expected["activations"] + expected["fused loss"] + expected["actor gradients"]
    not_at_the_peak = expected["scoring activations"]
    assert update > max(expected["actor gradients"], expected["scoring activations"])  # the peak phase
    rollout = sum(v for k, v in expected.items() if k.startswith("rollout"))
    # 9% over what the trainer's allocator holds at the peak: not vLLM's memory, not the context
    ours = sum(expected.values()) - rollout - not_at_the_peak - GiB
    expected["allocator slack"] = int(ours * 0.09)
    assert plan.components == expected
    held = sum(expected.values()) - update - not_at_the_peak
    assert plan.total == held + update and plan.peak_phase == "update"
    assert plan.fits and plan.largest == "rollout KV cache"
    assert plan.gpu_memory_utilization == util(budget, plan.total - rollout) == 0.73
    # 16 prompts x 8 completions per rank, 1536 tokens (a multiple of 16), K and V of 28 layers x 2 kv heads x 128
    assert plan.kv_cache_bytes == kv_cache_bytes_for(gpu_grpo(str(tmp_path / "m"), 2), 8, "cuda") == \
        128 * 1536 * 28 * 2 * 2 * 128 * 2
    plan.check()


def seven_b_expected(offload: bool):
    P, h, inter, V = qwen_7b_params(), 3584, 18944, 152064
    layer_act = 16 * h + 10 * 28 * 128 + 8 * inter
    # 8,192 completion tokens in 3 balanced chunks: 3,520 tokens fill 1 GiB of fp32 logits grown by the bf16
    # [V, h] scratch the head's gradient does without on CUDA (without it: 5 chunks of 1,664)
    chunk = 2752
    assert ((GiB + V * h * 2) // (4 * V)) // 64 * 64 == 3520 and -(-8192 // 3520) == 3
    device = {
        # the reduce bucket; stage3_max_live_parameters (1e9) + the prefetch bucket (5e7) gathered, by the
        # actor and by the reference
        "ZeRO buffers": 500_000_000 * 2 + 2 * (1_000_000_000 + 50_000_000) * 2,
        # gathered from the ZeRO-3 partitions: the embedding, larger than rollout.sync_bucket_bytes (256 MiB), is a
        # bucket of its own
        "weight sync bucket": V * h * 2,
        "rollout weights": P * 2,
        "rollout KV cache": 8 * GiB,
        "rollout working memory": 16384 * (3 * inter + 4 * h) * 2 + 3 * 1024 * V * 4,
        "activations": 8 * 1536 * (28 * 2 * h + 2 * layer_act + 12 * h) + 8 * 1536 * 1536,
        "fused loss": chunk * V * 2 + V * h * 4 + 8 * 1024 * h * 2,
        "scoring activations": 8 * 1536 * 2 * (2 * h + 2 * 128 + 2 * h + 3 * inter) + 8 * 1536 * 1536,
        "CUDA context": GiB,
    }
    sharded = {"actor weights": P * 2 // 8, "actor gradients": P * 2 // 8, "actor optimizer states": P * 12 // 8,
               "reference weights": P * 2 // 8, "optimizer step temporaries": P // 8 * 4}
    if not offload:
        return {**sharded, **device}, {}
    host = {"actor weights": P * 2 // 8, "actor optimizer states": P * 12 // 8, "actor gradients": P * 4 // 8,
            "reference weights": P * 2 // 8}
    return device, host


@pytest.mark.parametrize("offload", [False, True], ids=["zero3", "zero3-offload"])
def test_qwen2_5_7b_zero3_on_8x80(tmp_path, offload):
    budget = 80 * GiB
    plan = plan_memory(gpu_grpo(model_folder(tmp_path / "m", QWEN25_7B), 3, offload), 8, budget, "cuda")
    expected, host = seven_b_expected(offload)
    rollout = sum(v for k, v in expected.items() if k.startswith("rollout"))
    not_at_the_peak = (expected.get("optimizer step temporaries", 0) + expected["weight sync bucket"]
                       + expected["scoring activations"])
    expected["allocator slack"] = int((sum(expected.values()) - rollout - not_at_the_peak - GiB) * 0.09)
    assert plan.components == expected
    assert plan.host == host
    phases = {"update": expected["activations"] + expected["fused loss"],
              "optimizer step": expected.get("optimizer step temporaries", 0),
              "weight sync": expected["weight sync bucket"], "scoring": expected["scoring activations"]}
    held = sum(expected.values()) - sum(phases.values())
    assert plan.total == held + phases["update"] and plan.peak_phase == "update" and plan.fits
    rollout = sum(v for k, v in expected.items() if k.startswith("rollout"))
    assert plan.gpu_memory_utilization == util(budget, plan.total - rollout)
    # The trainer holds 21.80 GiB plus the update's 11.27 and 9% of the two as allocator slack (offloaded:
    # 5.84 + 11.27 + 9%): (80 - 35.96 - 4) / 80 = 0.5005 and (80 - 18.57 - 4) / 80 = 0.718.
    assert plan.gpu_memory_utilization == (0.71 if offload else 0.50)


# --------------------------------------------------------------------------------------------
# Parameter counts against the real transformers classes (built on the meta device: no memory)
# --------------------------------------------------------------------------------------------

SHAPES = {
    "llama": dict(model_type="llama", vocab_size=1000, hidden_size=256, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=700),
    "llama-biases": dict(model_type="llama", vocab_size=1000, hidden_size=256, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=512, attention_bias=True, mlp_bias=True),
    "qwen2-tied": dict(model_type="qwen2", vocab_size=1000, hidden_size=256, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, intermediate_size=700, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", vocab_size=1000, hidden_size=256, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, intermediate_size=700, head_dim=64),
    "qwen3": dict(model_type="qwen3", vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=700, head_dim=48),
    "qwen2.5-1.5b": QWEN25_1_5B,
    "qwen2.5-7b": QWEN25_7B,
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_count_equals_the_transformers_model(tmp_path, name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from fastrlhf.memory import read_shape

    folder = model_folder(tmp_path / name, SHAPES[name])
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
        classifier = AutoModelForSequenceClassification.from_config(config)
    shape = read_shape(folder)
    assert shape.causal_lm_params() == sum(p.numel() for p in lm.parameters())
    assert shape.classifier_params() == sum(p.numel() for p in classifier.parameters())


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "k_proj", "o_proj", "down_proj"], ["all-linear"]])
def test_lora_adapter_size_equals_peft(tmp_path, targets):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastrlhf.memory import read_shape

    folder = model_folder(tmp_path / "m", SHAPES["qwen2-tied"])
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)),
                               LoraConfig(r=8, target_modules=targets[0] if targets == ["all-linear"] else targets))
    assert read_shape(folder).lora_params(8, targets) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_unknown_architecture_is_a_one_line_config_error(tmp_path):
    folder = model_folder(tmp_path / "gpt2", {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "vocab_size": 100})
    with pytest.raises(ConfigError, match=r"^model.path: cannot count the parameters of model_type 'gpt2'"):
        plan_memory(gpu_grpo(folder, 2), 8, 80 * GiB)


# --------------------------------------------------------------------------------------------
# What the configuration changes
# --------------------------------------------------------------------------------------------

@pytest.fixture
def small(tmp_path):
    return model_folder(tmp_path / "small", SHAPES["qwen2-tied"])


def test_lora_trains_only_the_adapter_and_has_no_reference(small):
    import dataclasses

    from fastrlhf.memory import read_shape

    config = gpu_grpo(small, 2)
    lora = dataclasses.replace(config, model=dataclasses.replace(config.model, lora_r=8))
    shape = read_shape(small)
    adapter = shape.lora_params(8, ["q_proj", "v_proj"])
    plan = plan_memory(lora, 8, 80 * GiB)
    assert "reference weights" not in plan.components
    assert plan.components["actor weights"] == (shape.causal_lm_params() + adapter) * 2
    assert plan.components["actor gradients"] == adapter * 4 // 8  # summed in fp32 at ZeRO-2
    assert plan.components["actor optimizer states"] == adapter * 12 // 8
    no_kl = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, kl_coef=0.0))
    assert "reference weights" not in plan_memory(no_kl, 8, 80 * GiB).components


def test_rollout_engine_copies(small):
    from fastrlhf.memory import read_shape

    P = read_shape(small).causal_lm_params()
    assert "rollout weights" not in plan_memory(gpu_grpo(small, 2, engine="hf"), 8, 80 * GiB).components
    assert plan_memory(gpu_grpo(small, 3, engine="hf"), 8, 80 * GiB).components["rollout weights"] == P * 2
    assert plan_memory(gpu_grpo(small, 2, tensor_parallel_size=2), 8, 80 * GiB).components["rollout weights"] == P
    hf = plan_memory(gpu_grpo(small, 2, engine="hf"), 8, 80 * GiB)
    assert hf.gpu_memory_utilization is None
    assert hf.components["rollout KV cache"] == 128 * 1536 * 3 * 2 * 2 * 32 * 2  # the batch, unrounded
    assert "rollout KV cache" in hf.phases["generation"]  # HF allocates it per generate call


def test_vllm_on_a_cpu_holds_the_lm_head_pack_and_not_its_start_up_profile(small):
    # vLLM-CPU keeps a packed copy of the LM head's [V, h] weight for its logits GEMM (the unused one
    # of the input embedding is dropped at start-up); the profile's buffers leave the process after
    # start-up (fastrlhf.cpu.hostmem), so its working memory is the generation's own: 16 prompts x 8
    # completions per rank, their 512-token prompts prefilled 4096 tokens at a time, their logits.
    from fastrlhf.memory import components as C
    from fastrlhf.memory import read_shape
    from fastrlhf.memory.plan import CPU_VLLM_RUNTIME_BYTES

    shape, V, h, inter = read_shape(small), 1000, 256, 700
    cpu = plan_memory(gpu_grpo(small, 2), 8, 16 * GiB, "cpu")  # fp32 on a CPU
    assert cpu.engine == "vllm"
    # fp32 weights at ZeRO-2: Adam's two moments, sharded, and no master copy (fastrlhf.cpu.zero_master).
    assert cpu.components["actor optimizer states"] == shape.causal_lm_params() * 8 // 8
    # The lookup reads the actor's own embedding at ZeRO 0-2 (VLLMEngine.share_input_embedding): the
    # packed LM head is the only [V, h] matrix of its own; at ZeRO-3 it holds an embedding as well.
    assert cpu.components["rollout weights"] == shape.causal_lm_params() * 4
    zero3 = plan_memory(gpu_grpo(small, 3), 8, 16 * GiB, "cpu")
    assert zero3.components["rollout weights"] == (shape.causal_lm_params() + V * h) * 4
    assert cpu.components["vLLM runtime"] == CPU_VLLM_RUNTIME_BYTES == 260 << 20
    # Its packed weights and KV cache are released for the update (VLLMEngine.sleep) and are back from
    # the weight sync on: phases, not held; at ZeRO-3 (an embedding of its own) they stay held.
    assert cpu.phases["generation"] == ["rollout weights", "rollout KV cache", "rollout working memory"]
    assert cpu.phases["weight sync"] == ["rollout weights (synced)"]
    assert cpu.components["rollout weights (synced)"] == cpu.components["rollout weights"]
    assert "rollout weights" not in zero3.phases["generation"] and "rollout KV cache" not in zero3.phases["generation"]
    held = sum(v for k, v in cpu.components.items() if not any(k in p for p in cpu.phases.values()))
    assert cpu.total == held + max(sum(cpu.components[k] for k in p) for p in cpu.phases.values())
    assert cpu.components["rollout working memory"] == 4096 * (3 * inter + 4 * h) * 4 + 3 * 128 * V * 4
    assert C.rollout_working(gpu_grpo(small, 2), shape, "vllm", 4, 4, "cpu", 16 * GiB) == \
        4 * 512 * (3 * inter + 4 * h) * 4 + 3 * 4 * V * 4  # a batch whose prompts fit one forward
    # On CUDA: the bf16 copy alone, and the profile's working memory held (reserved by vLLM).
    cuda = plan_memory(gpu_grpo(small, 2), 8, 80 * GiB, "cuda")
    assert cuda.components["rollout weights"] == shape.causal_lm_params() * 2
    assert "rollout working memory" not in cuda.phases["generation"]


def test_sleep_holds_generation_and_update_one_at_a_time(tmp_path):
    folder = model_folder(tmp_path / "m", QWEN25_7B)
    awake = plan_memory(gpu_grpo(folder, 3), 8, 80 * GiB)
    asleep = plan_memory(gpu_grpo(folder, 3, sleep=True), 8, 80 * GiB)
    c = awake.components
    engine = sum(v for k, v in c.items() if k.startswith("rollout"))  # weights, KV cache, working memory
    update = c["activations"] + c["fused loss"]
    assert awake.peak_phase == "update" and asleep.peak_phase == "generation" and engine > update
    # Asleep, the update is not at the peak, nor its allocator slack.
    slack = c["allocator slack"] - asleep.components["allocator slack"]
    assert abs(slack - update * 0.09) <= 1
    assert asleep.total == awake.total - engine - update - slack + engine
    assert asleep.phases["generation"] == ["rollout weights", "rollout KV cache", "rollout working memory"]
    assert not any(k.startswith("rollout") for k in asleep.host)  # dropped at sleep, rewritten by the sync
    assert asleep.gpu_memory_utilization > awake.gpu_memory_utilization


def test_critic_and_reward_model(tmp_path, small):
    import dataclasses

    from fastrlhf.memory import read_shape

    rm = model_folder(tmp_path / "rm", {**SHAPES["llama"], "id2label": {"0": "a", "1": "b", "2": "c"}})
    config = gpu_grpo(small, 2)
    ppo = dataclasses.replace(config, algorithm="ppo", critic=CriticConfig(),
                              reward=RewardConfig(model_path=rm))
    plan = plan_memory(ppo, 8, 80 * GiB)
    shape = read_shape(small)
    critic = shape.causal_lm_params() + 256 + 1  # + the value head
    assert plan.components["critic weights"] == critic * 2
    assert plan.components["critic optimizer states"] == critic * 12 // 8
    llama = SHAPES["llama"]
    backbone = read_shape(rm).backbone_params()
    assert plan.components["reward model weights"] == (backbone + llama["hidden_size"] * 3) * 2
    # two trained engines, two reduce buckets
    assert plan.components["ZeRO buffers"] == 2 * 500_000_000 * 2


def test_kv_cache_bytes_for_rounds_to_vllms_block(small):
    config = gpu_grpo(small, 2)
    import dataclasses

    short = dataclasses.replace(config, data=dataclasses.replace(config.data, max_prompt_len=30),
                                rollout=dataclasses.replace(config.rollout, max_new_tokens=10))
    per_token = 3 * 2 * 2 * 32  # layers x (K, V) x kv heads x head_dim
    assert kv_cache_bytes_for(short, 8, "cpu") == 128 * 128 * per_token * 4  # fp32 on a CPU, blocks of 128
    assert kv_cache_bytes_for(short, 8, "cuda") == 128 * 48 * per_token * 2  # bf16 on CUDA, blocks of 16


def test_check_names_the_largest_component_and_a_remedy(tmp_path):
    # One GPU: bf16 at stage 0 trains as ZeRO-1 (trained_zero_stage), whose optimizer states one rank holds whole.
    plan = plan_memory(gpu_grpo(model_folder(tmp_path / "m", QWEN25_7B), 0), 1, 80 * GiB)
    assert not plan.fits and plan.largest == "actor optimizer states"
    with pytest.raises(PlanError) as info:
        plan.check()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"plan: needs {plan.total / GiB:.1f} GiB per GPU, over the 80.0 GiB budget")
    assert f"largest: actor optimizer states {7_615_616_512 * 12 / GiB:.1f} GiB (try deepspeed.zero_stage 3 or " \
           "deepspeed.offload_optimizer)" in message


def test_bf16_at_stage_0_is_planned_as_the_zero_1_it_trains_as(tmp_path):
    folder = model_folder(tmp_path / "m", QWEN25_1_5B)
    stage0, stage1 = (plan_memory(gpu_grpo(folder, stage), 8, 80 * GiB, "cuda") for stage in (0, 1))
    assert stage0.components == stage1.components
    assert stage0.components["actor optimizer states"] == qwen_1_5b_params() * 12 // 8


def test_parse_bytes():
    assert parse_bytes("80GiB") == parse_bytes("80G") == 80 * GiB
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1536MiB") == 1536 << 20
    assert parse_bytes("12345") == 12345
    with pytest.raises(ValueError, match="expected a size such as 80 \\(GiB\\).*got 'eighty'"):
        parse_bytes("eighty")


# --------------------------------------------------------------------------------------------
# Mirrors of torch-importing modules' rules stay equal to them
# --------------------------------------------------------------------------------------------

def test_mirrored_constants_and_rules_match_their_sources(small):
    import dataclasses

    import torch
    from fastrlhf.kernels import _backend
    from fastrlhf.kernels.fused_linear import call_chunk_size, default_chunk_size

    from fastrlhf.memory import components as plan
    from fastrlhf.rl.step import micro_batch_size
    from fastrlhf.rollout import engine_choice, vllm_adapter

    assert plan.CPU_VLLM_CROSSOVER_PARAMS == engine_choice.CPU_VLLM_CROSSOVER_PARAMS
    assert plan.CPU_SUPPORTED_HEAD_SIZES == vllm_adapter.CPU_SUPPORTED_HEAD_SIZES
    assert (plan.CPU_CHUNK_BYTES, plan.GPU_CHUNK_BYTES, plan.GPU_FREE_MEMORY_FRACTION) == \
        (_backend.CPU_CHUNK_BYTES, _backend.GPU_CHUNK_BYTES, _backend.GPU_FREE_MEMORY_FRACTION)
    config = gpu_grpo(small, 2)
    for tokens in (1, 100, 5000, 100_000):
        for vocab in (256, 32000, 151936):
            for budget in (None, 1 << 20, 64 << 20, 3 << 30):
                c = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, loss_chunk_bytes=budget))
                for device in ("cpu", "cuda"):
                    assert plan.chunk_tokens(c, tokens, vocab, device, None) == \
                        default_chunk_size(tokens, vocab, budget or (_backend.CPU_CHUNK_BYTES if device == "cpu"
                                                                     else _backend.GPU_CHUNK_BYTES), device)
    # A bf16 head trained on CUDA: the budget grows by the scratch its GEMMs spare (meta stands for CUDA).
    for vocab, hidden in ((32000, 4096), (151936, 1536), (152064, 3584)):
        weight = torch.empty(vocab, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
        for tokens in (100, 5000, 16384, 100_000):
            assert plan.chunk_tokens(config, tokens, vocab, "cuda", None, vocab * hidden * 2) == \
                call_chunk_size(tokens, weight)
    for world in (1, 2, 8):
        assert plan.micro_batch(config, world) == micro_batch_size(config, world)


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

def plan_yaml(tmp_path, dims, **deepspeed):
    model = model_folder(tmp_path / "model", dims)
    raw = yaml.safe_load(open(os.path.join(ROOT, "examples/gpu/grpo_qwen2.5_1.5b.yaml")))
    raw["model"]["path"] = model
    raw["deepspeed"].update(deepspeed)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def run_plan(*args):
    code = ("import sys; from fastrlhf.cli import main; rc = main(sys.argv[1:]); "
            "print('heavy:', [m for m in ('torch', 'deepspeed', 'vllm', 'transformers') if m in sys.modules]); "
            "sys.exit(rc)")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code, "plan", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    return result, time.monotonic() - started


def test_plan_command_prints_the_table_and_the_utilization(tmp_path):
    # The GPU example as it is: model weights and prompt data need not exist for a plan.
    result, _ = run_plan("--config", plan_yaml(tmp_path, QWEN25_1_5B), "--gpus", "8", "--gpu-memory", "80GiB")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "actor optimizer states" in out and "rollout KV cache" in out and "fits" in out
    assert "rollout.gpu_memory_utilization: 0.73" in out
    assert "heavy: []" in out  # no torch, deepspeed, vllm or transformers imported


def test_plan_command_that_does_not_fit_exits_2_with_one_line(tmp_path):
    result, _ = run_plan("--config", plan_yaml(tmp_path, QWEN25_7B), "--gpus", "1", "--gpu-memory", "80GiB",
                         "--set", "deepspeed.zero_stage=0")  # one rank holds the optimizer states whole
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("plan: needs ") and "largest: actor optimizer states" in lines[0]


def test_plan_command_reads_a_bare_gpu_memory_as_gib(tmp_path):
    """``--gpu-memory 80`` is 80 GiB, as the GPU's size is said (it was 80 bytes: a budget of 0.00 GiB)."""
    results = [run_plan("--config", plan_yaml(tmp_path, QWEN25_1_5B), "--gpus", "8", "--gpu-memory", size)[0]
               for size in ("80", "80GiB", "80.0")]
    assert [r.returncode for r in results] == [0, 0, 0], results[0].stderr
    assert results[0].stdout == results[1].stdout == results[2].stdout
    assert "rollout.gpu_memory_utilization: 0.73" in results[0].stdout
    assert parse_bytes("80", unit=GiB) == 80 * GiB and parse_bytes("80B", unit=GiB) == 80


@pytest.mark.parametrize("args, expected", [
    (("--set", "trainer.grad_accum=3"), "config error: trainer.grad_accum: 3 does not divide"),
    (("--gpus", "3"), "config error: trainer.prompts_per_step: 128 does not split over 3 ranks"),
    (("--gpu-memory", "lots"), "plan: --gpu-memory: expected a size"),
])
def test_plan_command_bad_input_is_one_line_exit_2(tmp_path, args, expected):
    result, _ = run_plan("--config", plan_yaml(tmp_path, QWEN25_1_5B), "--gpus", "8", "--gpu-memory", "80GiB", *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(expected)


# --------------------------------------------------------------------------------------------
# The plan against real CPU runs: peak RSS of `python -m fastrlhf train`, single process
# --------------------------------------------------------------------------------------------

# Runs the trainer as its only child and prints that child's peak RSS (KiB on Linux).
WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
           "print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 27M-parameter Llama (vocab 8192, hidden 512, 6 layers, head size 64) and 64 prompts."""
    import random

    from fastrlhf.modeling.tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("plan-cpu")
    save_tiny_llama(root / "model", vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8,
                    intermediate_size=1376)
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"prompt_ids": [rng.randrange(3, 8192) for _ in range(rng.randint(8, 32))]}) + "\n")
    return root


def measure(root, name, raw):
    from fastrlhf.memory.plan_command import load_plan_config

    raw = {"output_dir": str(root / name), "model": {"path": str(root / "model"), "dtype": "float32"},
           "reward": {"function": "length"},
           "data": {"prompts": str(root / "prompts.jsonl"), "prompt_field": "prompt_ids", "max_prompt_len": 32},
           **raw}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_plan_config(str(path), device="cpu")
    if config.rollout.engine == "vllm":  # the engine allocates what the plan says the batch needs
        raw["rollout"]["kv_cache_bytes"] = kv_cache_bytes_for(config, 1, "cpu")
        path.write_text(yaml.safe_dump(raw))
        config = load_plan_config(str(path), device="cpu")
    plan = plan_memory(config, 1, 16 * GiB, "cpu")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                             "LOCAL_RANK")}
    env.update(FASTRLHF_NO_PROGRESS="1", FASTRLHF_DIST_TIMEOUT="120")
    result = subprocess.run([sys.executable, "-c", WRAPPER, sys.executable, "-m", "fastrlhf", "train", "--config",
                             str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    peak = int(result.stdout.split("maxrss_kib")[-1].split()[0]) * 1024
    ratio = plan.total / peak
    print(f"{name}: plan {plan.total / GiB:.3f} GiB, measured peak RSS {peak / GiB:.3f} GiB, plan/measured {ratio:.2f}")
    return plan, ratio


RUN = {"rollout": {"n": 4, "max_new_tokens": 32},
       "trainer": {"max_steps": 2, "prompts_per_step": 4, "minibatch_size": 16, "kl_coef": 0.01},
       "deepspeed": {"zero_stage": 2}}


@pytest.mark.slow
def test_plan_matches_a_ppo_run_with_the_hf_engine(tiny_run):
    # actor, reference and critic (ZeRO-2), HF generate on the actor's own weights
    raw = {**RUN, "algorithm": "ppo", "critic": {"path": None}, "rollout": {**RUN["rollout"], "engine": "hf"}}
    plan, ratio = measure(tiny_run, "ppo-hf", raw)
    assert {"critic optimizer states", "reference weights", "activations"} <= set(plan.components)
    assert 0.75 <= ratio <= 1.25


@pytest.mark.slow
def test_plan_matches_a_grpo_run_with_vllm(tiny_run):
    raw = {**RUN, "algorithm": "grpo", "rollout": {**RUN["rollout"], "engine": "vllm"}}
    plan, ratio = measure(tiny_run, "grpo-vllm", raw)
    assert plan.engine == "vllm" and "vLLM runtime" in plan.components
    assert 0.75 <= ratio <= 1.25


@pytest.mark.parametrize("local", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])  # torchrun's, DeepSpeed's launcher's
def test_plan_for_launch_on_a_cpu_host(small, monkeypatch, local):
    from fastrlhf.memory.plan import plan_for_launch

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv(local, "4")
    plan = plan_for_launch(gpu_grpo(small, 2, engine="hf"))
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert plan.device == "cpu" and plan.gpus == 8
    assert abs(plan.budget - available // 4) < 256 << 20  # MemAvailable moves a little between the two reads


def test_engine_auto_follows_the_trainers_choice(tmp_path):
    import importlib.util

    from fastrlhf.memory import components, read_shape

    small = model_folder(tmp_path / "s", SHAPES["llama"])  # 2.6M parameters, head size 32
    big_head16 = model_folder(tmp_path / "h", {**SHAPES["llama"], "hidden_size": 128, "num_key_value_heads": 8})
    config = gpu_grpo(small, 2, engine="auto")
    vllm = importlib.util.find_spec("vllm") is not None
    assert components.engine_kind(config, read_shape(small), "cuda") == ("vllm" if vllm else "hf")
    assert components.engine_kind(config, read_shape(small), "cpu") == ("vllm" if vllm else "hf")
    assert components.engine_kind(config, read_shape(big_head16), "cpu") == "hf"  # head size 16: no vLLM-CPU
    tiny = model_folder(tmp_path / "t", {**SHAPES["llama"], "vocab_size": 100, "num_hidden_layers": 1})
    assert components.engine_kind(config, read_shape(tiny), "cpu") == "hf"  # below CPU_VLLM_CROSSOVER_PARAMS


def test_token_budget_sizes_the_update_micro_batch(tmp_path):
    # trainer.max_tokens_per_microbatch: the update's activations and head tokens are those of the
    # budget (grad_accum 1, so by count it would be the whole 32-sequence share); no dense mask for packed rows
    # (a lazy block mask and their bounds), padded at most N x T.
    import dataclasses

    from fastrlhf.memory import components as C
    from fastrlhf.memory import read_shape

    config = gpu_grpo(model_folder(tmp_path / "m", QWEN25_1_5B), zero_stage=2)
    shape, length = read_shape(str(tmp_path / "m")), 512 + 1024
    by_count = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, grad_accum=1))
    assert C.update_micro_batch(by_count, 32) == (32 * length, 32 * length ** 2, 32 * 1024)
    for packing in (True, False):
        budget = dataclasses.replace(by_count, trainer=dataclasses.replace(
            by_count.trainer, max_tokens_per_microbatch=16384, packing=packing))
        tokens, mask, completion = C.update_micro_batch(budget, 32)
        assert (tokens, completion) == (16384, 16384)
        assert mask == (0 if packing else 16384 * length)
        plan = plan_memory(budget, 8, 80 * GiB, "cuda")
        assert plan.components["activations"] == C.activations(budget, shape, 32, 2) < \
            plan_memory(by_count, 8, 80 * GiB, "cuda").components["activations"]
    # A budget below one longest sequence: that sequence's micro-batch is what the update holds.
    small_budget = dataclasses.replace(by_count, trainer=dataclasses.replace(
        by_count.trainer, max_tokens_per_microbatch=100, packing=True))
    assert C.update_micro_batch(small_budget, 32)[0] == length


def test_fp32_logits_count_their_chunk_in_fp32_and_the_gradients_bf16_copy(tmp_path):
    """``model.fp32_logits``: the fused loss's chunk holds fp32 logits (4 bytes, not bf16's 2) and, trained, their
    gradient's bf16 copy for the head's GEMMs; the same chunks (the budget counts fp32 logits either way)."""
    from dataclasses import replace

    h, V, chunk = 1536, 151936, 2048  # as in test_qwen2_5_1_5b_zero2_on_8x80
    config = gpu_grpo(model_folder(tmp_path / "m", QWEN25_1_5B), zero_stage=2)
    plain = plan_memory(config, 8, 80 * GiB, "cuda").components
    fp32 = plan_memory(replace(config, model=replace(config.model, fp32_logits=True)), 8, 80 * GiB, "cuda").components
    assert fp32["fused loss"] - plain["fused loss"] == chunk * V * (4 + 2 - 2)
    assert plain["fused loss"] == chunk * V * 2 + V * h * 4 + 8 * 1024 * h * 2
