"""Audit of the memory plan: what it counts as trained (gradients, optimizer states) equals the parameters the
loaded models train, for a PPO critic over an untied LM head (which takes no part in its values) and for LoRA."""

import dataclasses

import pytest
from helpers.plan_cases import QWEN25_7B, GiB, gpu_grpo, model_folder

from fastrlhf.config import CriticConfig, ModelConfig
from fastrlhf.memory import read_shape
from fastrlhf.memory.plan import plan_memory

TINY_LLAMA = dict(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=48)


def ppo(config, **model):
    return dataclasses.replace(config, algorithm="ppo", critic=CriticConfig(),
                               model=dataclasses.replace(config.model, **model))


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("lora", [{}, {"lora_r": 4, "lora_targets": ["all-linear"]},
                                  {"lora_r": 4, "lora_targets": ["q_proj", "lm_head"]}])
def test_the_critic_trains_what_the_plan_counts_and_not_its_untied_lm_head(tmp_path, lora):
    """The critic's untied lm_head got no gradient (its values read the decoder's hidden states) but was trained:
    a [V, h] gradient and its optimizer states (Qwen2.5-7B: 545M parameters, 780 MiB of Adam states per GPU
    over 8 at ZeRO-2)."""
    import torch

    from fastrlhf.modeling import load_value_model
    from fastrlhf.modeling.tiny import save_tiny_llama

    save_tiny_llama(tmp_path / "llama", **TINY_LLAMA)
    critic = load_value_model(ModelConfig(path=str(tmp_path / "llama"), dtype="float32", **lora))
    critic(torch.randint(0, 512, (2, 5))).sum().backward()
    assert [n for n, p in critic.named_parameters() if p.requires_grad and p.grad is None] == []
    plan = plan_memory(ppo(gpu_grpo(str(tmp_path / "llama"), 2), **lora), 8, 80 * GiB)
    # bf16 on the GPU: fp32 master and two moments per trained parameter, over 8 ranks
    assert plan.components["critic optimizer states"] == trainable(critic) * 12 // 8


def test_an_untied_7b_critic_holds_no_optimizer_states_for_its_lm_head(tmp_path):
    config = ppo(gpu_grpo(model_folder(tmp_path / "m", QWEN25_7B), 2))
    shape = read_shape(config.model.path)
    plan = plan_memory(config, 8, 80 * GiB)
    critic = shape.causal_lm_params() - 152064 * 3584 + 3584 + 1
    assert plan.components["critic weights"] == (shape.causal_lm_params() + 3584 + 1) * 2  # still held
    assert plan.components["critic optimizer states"] == critic * 12 // 8
    assert plan.components["actor optimizer states"] == shape.causal_lm_params() * 12 // 8


def _bytes(tensors, skip=frozenset()) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.untyped_storage().data_ptr() not in skip)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_states_are_what_deepspeed_holds_after_a_step(stage, dtype):
    """Adam's moments and the fp32 master partition DeepSpeed keeps (where it is not the weights' own memory),
    after one step on this CPU, against the plan's bytes per parameter. ZeRO-3 clones fp32 weights as well (the
    plan counted 8 bytes, DeepSpeed held 12)."""
    import torch

    from fastrlhf import distributed as D
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.deepspeed import build_train_engine
    from fastrlhf.memory.components import trained_engine
    from fastrlhf.modeling.tiny import make_tiny_llama

    D.init_distributed(timeout_s=60)
    ds = DeepSpeedConfig(zero_stage=stage, bf16=dtype == "bfloat16")
    model = make_tiny_llama(seed=0, dtype=getattr(torch, dtype), **TINY_LLAMA).train()
    params = sum(p.numel() for p in model.parameters())
    engine = build_train_engine(model, ds, lr=1e-3)
    ids = torch.randint(0, 512, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    opt = engine.optimizer
    moments = _bytes(t for state in opt.optimizer.state.values() for t in state.values() if t.dim() > 0)
    weights = [p.data for p in model.parameters()] + [getattr(p, "ds_tensor", p.data) for p in model.parameters()]
    weights += list(getattr(opt, "bit16_groups_flat", None) or getattr(opt, "fp16_partitioned_groups_flat", None))
    masters = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
    master = _bytes(masters, skip={t.untyped_storage().data_ptr() for t in weights})
    planned = {}
    trained_engine("actor", params, params, 2 if ds.bf16 else 4, ds, 1, "cpu", planned, {})
    assert moments + master == planned["actor optimizer states"]


def test_a_larger_critic_sizes_the_updates_activations_and_auto_checkpointing(tmp_path):
    """PPO with a 7B critic beside a 1.5B actor: the critic's update keeps its own activations (same micro-batch,
    same checkpointing); the plan counted the actor's alone (37.3 GiB, the critic's 81.7), so
    gradient_checkpointing auto turned it off at 141 GiB and the critic's update would not have fit."""
    from helpers.plan_cases import QWEN25_1_5B

    from fastrlhf.memory import components as C

    config = gpu_grpo(model_folder(tmp_path / "actor", QWEN25_1_5B), 2)
    critic = read_shape(model_folder(tmp_path / "critic", QWEN25_7B))
    config = dataclasses.replace(config, algorithm="ppo", critic=CriticConfig(path=str(tmp_path / "critic")))
    micro = C.micro_batch(config, 8)
    for checkpointing in (False, True):
        fixed = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                      gradient_checkpointing=checkpointing))
        assert plan_memory(fixed, 8, 141 * GiB).components["activations"] == C.activations(fixed, critic, micro, 2)
    auto = dataclasses.replace(config, model=dataclasses.replace(config.model, gradient_checkpointing="auto"))
    plan = plan_memory(auto, 8, 141 * GiB)
    assert plan.fits and plan.gradient_checkpointing
    without = dataclasses.replace(config, model=dataclasses.replace(config.model, gradient_checkpointing=False))
    assert not plan_memory(without, 8, 141 * GiB).fits
