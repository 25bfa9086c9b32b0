"""The memory plan's scoring phase: the step's no-grad forwards (old and reference logprobs, values, the reward
model's scores). The working set of one forward (``ModelShape.forward_bytes_per_token``) against what HF's
layers allocate on a CPU (torch.profiler's allocation events), and the phase worked out by hand for GPU runs
where it is, and is not, the peak."""

import dataclasses

import pytest
import torch
from helpers.allocations import allocated_peak
from helpers.plan_cases import QWEN25_1_5B, QWEN25_7B, GiB, gpu_grpo, model_folder

from fastrlhf.config import CriticConfig, RewardConfig, TrainConfig
from fastrlhf.memory import components as C
from fastrlhf.memory import read_shape
from fastrlhf.memory.plan import plan_memory


def forward_peak(dims: dict, dtype: torch.dtype, padded: bool, batch: int = 2, length: int = 256) -> tuple[int, int]:
    """``(measured, planned)`` bytes of one no-grad forward of a 2-layer ``*ForSequenceClassification`` body of
    ``dims``, as ``fastrlhf.rl.forward`` runs it (SDPA, ``use_cache=False``)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(**dims, num_hidden_layers=2, vocab_size=128, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").to(dtype).eval()
    ids = torch.randint(1, 128, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        mask[0, : length // 4] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        measured = allocated_peak(lambda: model.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                                      use_cache=False).last_hidden_state)
    shape = read_shape_of(config)
    planned = batch * length * shape.forward_bytes_per_token(dtype.itemsize) + (batch * length**2 if padded else 0)
    return measured, planned


def read_shape_of(config):
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        return read_shape(model_folder(pathlib.Path(folder), config.to_dict()))


# The widths of Qwen2.5-0.5B, of a GQA Llama (Llama-3's head size, a quarter of its width) and of Qwen3-1.7B
# (per-head q/k norms, q wider than h): the MLP's peak is the layer's.
MLP_PEAKED = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2),
    "llama-gqa": dict(model_type="llama", hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                      num_key_value_heads=2),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MLP_PEAKED))
def test_a_forward_holds_what_the_plan_counts(name, dtype, padded):
    measured, planned = forward_peak(MLP_PEAKED[name], dtype, padded)
    # Equal but for small tensors (the mask's bool expansion, RoPE's inverse frequencies, the norms' fp32 rows).
    assert abs(planned / measured - 1) < 0.01, (planned, measured)


def test_where_attention_peaks_the_plan_bounds_it():
    """Qwen3-0.6B (q twice as wide as h, I = 3h): attention's q/k norms and RoPE peak over the MLP; the plan
    counts attention's largest set of tensors. Padded on a CPU the flash kernel's own buffers come on top (16%
    over the plan in bf16 on 2 threads, and they scale with the threads), so the unpadded forward is checked."""
    dims = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128)
    for dtype in (torch.float32, torch.bfloat16):
        measured, planned = forward_peak(dims, dtype, padded=False)
        assert 1.0 <= planned / measured <= 1.2, (dtype, planned, measured)


# --------------------------------------------------------------------------------------------
# The phase in GPU plans, by hand
# --------------------------------------------------------------------------------------------

def per_token(h, inter, d, a=2):
    """A Qwen2.5 layer's no-grad working set per token (its MLP peaks): embeddings, the layer's input, RoPE's
    cos and sin, then the residual, its normed copy and SiLU(gate), up and their product."""
    return a * (2 * h + 2 * d + 2 * h + 3 * inter)


@pytest.fixture
def folders(tmp_path):
    rm_dims = {**QWEN25_7B, "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}
    return model_folder(tmp_path / "actor", QWEN25_1_5B), model_folder(tmp_path / "rm", rm_dims)


def with_trainer(config: TrainConfig, **changes) -> TrainConfig:
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, **changes))


def test_a_reward_model_larger_than_the_actor_sets_the_phase(folders):
    """GRPO on Qwen2.5-1.5B (ZeRO-2, 8 x 80 GiB) scored by a Qwen2.5-7B reward model: the reward model's forward
    is the phase. With 32 sequences per forward instead of the update's 8 it is the run's peak."""
    actor, rm = folders
    config = dataclasses.replace(gpu_grpo(actor, 2), reward=RewardConfig(model_path=rm))
    tokens, mask = 8 * 1536, 8 * 1536 * 1536  # 8 sequences of 512 + 1024, and their [B, 1, T, T] bool mask
    plan = plan_memory(config, 8, 80 * GiB)
    assert plan.components["scoring activations"] == tokens * per_token(3584, 18944, 128) + mask
    assert plan.peak_phase == "update"

    wide = plan_memory(with_trainer(config, forward_micro_batch=32), 8, 80 * GiB)
    scoring = 4 * tokens * per_token(3584, 18944, 128) + 4 * mask
    assert wide.components["scoring activations"] == scoring  # 6.6 GiB, over the update's 5.1
    assert wide.peak_phase == "scoring" and wide.phases["scoring"] == ["scoring activations"]
    update = sum(wide.components[k] for k in wide.phases["update"])  # with the gradients (ZeRO-2: freed by the step)
    # the difference of the two phases, and 9% of it as allocator slack (each plan's slack rounded down)
    assert abs(wide.total - plan.total - (scoring - update) * 1.09) <= 1
    assert wide.gpu_memory_utilization < plan.gpu_memory_utilization  # vLLM gets less beside the larger phase
    # its remedy, not the update activations' (gradient checkpointing is already on)
    assert wide.hints["scoring activations"].startswith("a smaller trainer.forward_micro_batch")


def test_the_actor_and_reference_and_critic_passes(folders):
    actor, _ = folders
    config = gpu_grpo(actor, 2)
    forward = 8 * 1536 * per_token(1536, 8960, 128) + 8 * 1536 * 1536
    assert plan_memory(config, 8, 80 * GiB).components["scoring activations"] == forward  # the reference's
    # On-policy without a reference: only the actor's probe of the engine (rollout.mismatch_probe: 2 sequences),
    # whose head outweighs its decoder: the last hidden states, those of the 2,048 completion tokens, and one
    # chunk of bf16 logits (1 GiB of fp32 logits holds 1,728 rows: two balanced chunks of 1,024).
    on_policy = with_trainer(config, kl_coef=0.0, minibatch_size=1024, grad_accum=16)
    decoder = 2 * 1536 * per_token(1536, 8960, 128) + 2 * 1536 * 1536
    head = (2 * 1536 + 2 * 1024) * 1536 * 2 + 1024 * 151936 * 2
    assert head > decoder
    assert plan_memory(on_policy, 8, 80 * GiB).components["scoring activations"] == head
    # PPO: the critic's values too, the same decoder: the same pass.
    ppo = dataclasses.replace(config, algorithm="ppo", critic=CriticConfig())
    assert plan_memory(ppo, 8, 80 * GiB).components["scoring activations"] == forward


def test_an_engine_awake_while_the_reward_model_scores(folders):
    """vLLM asleep through the step is awake while dynamic sampling's rounds (or validation) score: the reward
    model's forward is in the generation phase beside the engine's memory."""
    actor, rm = folders
    config = dataclasses.replace(gpu_grpo(actor, 2, sleep=True), reward=RewardConfig(model_path=rm))
    rm_forward = 8 * 1536 * per_token(3584, 18944, 128) + 8 * 1536 * 1536
    assert "reward model activations" not in plan_memory(config, 8, 80 * GiB).components
    sampled = plan_memory(with_trainer(config, filter_groups=True), 8, 80 * GiB)
    assert sampled.components["reward model activations"] == rm_forward
    assert "reward model activations" in sampled.phases["generation"]


def test_the_mirrors_agree_with_the_step(folders):
    from fastrlhf.rl.step import forward_micro_batch_size, skips_old_logprobs

    actor, _ = folders
    base = gpu_grpo(actor, 2)
    single = dict(minibatch_size=1024, grad_accum=16)
    cases = [{}, single, {**single, "kl_coef": 0.0}, {**single, "tis_cap": 2.0},
             {**single, "old_logprobs": "recompute"}, {**single, "ppo_epochs": 2}, {"forward_micro_batch": 3},
             {**single, "top_entropy_quantile": 0.2}]
    for changes in cases:
        for algorithm in ("grpo", "ppo"):
            config = dataclasses.replace(with_trainer(base, **changes), algorithm=algorithm,
                                         critic=CriticConfig() if algorithm == "ppo" else None)
            assert C.recomputes_old_logprobs(config) == (not skips_old_logprobs(config)), (changes, algorithm)
            for world in (1, 2, 8):
                assert C.forward_micro(config, C.micro_batch(config, world)) == \
                    forward_micro_batch_size(config, world)
    # PPO with the KL in its rewards needs the old logprobs first; the plan counts them wherever it is set.
    ppo_kl = dataclasses.replace(with_trainer(base, kl_in_reward=True, **single), algorithm="ppo",
                                 critic=CriticConfig())
    assert C.recomputes_old_logprobs(ppo_kl) and not skips_old_logprobs(ppo_kl)
