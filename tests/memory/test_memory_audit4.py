"""Audit of the memory plan against what the code allocates on a CPU: packed rows hold no dense attention mask,
the unfused loss's fp32 tensors, and a ``value_head`` reward model's LM head."""

import dataclasses
import pathlib

import pytest
import torch
from helpers.allocations import allocated_peak
from helpers.plan_cases import GiB, gpu_grpo, model_folder

from fastrlhf.config import ModelConfig, RewardConfig
from fastrlhf.memory import components as C
from fastrlhf.memory import read_shape
from fastrlhf.memory.plan import plan_memory

QWEN_TINY = dict(
    model_type="qwen2",
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
)


def with_trainer(config, **changes):
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, **changes))


def run_of(tmp_path, dims, prompt: int, completion: int, **trainer):
    """A GRPO config of ``dims`` with ``prompt + completion`` token sequences, one per update micro-batch."""
    config = gpu_grpo(model_folder(tmp_path / "m", dims), 2)
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, max_prompt_len=prompt),
        rollout=dataclasses.replace(config.rollout, max_new_tokens=completion),
    )
    return with_trainer(config, **{"prompts_per_step": 8, "minibatch_size": 8, "grad_accum": 8, **trainer})


def test_a_packed_row_holds_no_dense_attention_mask(tmp_path):
    """Packed rows pass a (lazy) block mask and their bounds to fastrlhf_packed, whose backends need no [N, N]
    mask. The plan counted one (N^2 bytes): a packed no-grad forward of 4,096 tokens allocated 11.0 MB, the plan
    27.8 MB; Qwen2.5-1.5B packed in 32k-token micro-batches: 1 GiB per pass that never exists."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastrlhf.modeling.loading import use_attention
    from fastrlhf.sequences.packing import PackedLayout

    hf_config = AutoConfig.for_model(**QWEN_TINY, vocab_size=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").eval()
    assert use_attention(model, True, backend="auto") == "sdpa"  # a CPU's backend
    layout = PackedLayout.build([128] * 8, [384] * 8)
    ids = torch.randint(1, 128, (1, layout.num_tokens))
    kwargs = layout.model_kwargs()
    with torch.no_grad():
        measured = allocated_peak(lambda: model.model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state)

    config = run_of(
        tmp_path, {**QWEN_TINY, "vocab_size": 128}, 128, 384, packing=True, max_tokens_per_microbatch=layout.num_tokens
    )
    shape = read_shape(config.model.path)
    assert C.update_micro_batch(config, 8)[:2] == (layout.num_tokens, 0)
    planned = C.forward_activations(config, shape, 8, 4)
    assert abs(planned / measured - 1) < 0.01, (planned, measured)
    # by count as well: a packed micro-batch is one row, no [B, 1, T, T] mask either
    by_count = with_trainer(config, max_tokens_per_microbatch=None, grad_accum=1)
    assert C.update_micro_batch(by_count, 8) == (8 * 512, 0, 8 * 384)


def test_packed_update_activations_count_no_mask_at_gpu_scale(tmp_path):
    """Qwen2.5-1.5B in micro-batches of 32 sequences: the phantom [N, N] mask (N = 49,152 tokens: 2.25 GiB, in
    each of the update and the scoring passes) also made trainer.max_tokens_per_microbatch auto pick smaller
    micro-batches."""
    from helpers.plan_cases import QWEN25_1_5B

    config = gpu_grpo(model_folder(tmp_path / "m", QWEN25_1_5B), 2)
    packed = with_trainer(config, packing=True, grad_accum=1, max_tokens_per_microbatch=32 * 1536)
    padded = with_trainer(packed, packing=False)
    plans = {name: plan_memory(c, 8, 80 * GiB) for name, c in (("packed", packed), ("padded", padded))}
    # padded: the mask of 32 rows of 1,536 tokens; packed: none
    gap = plans["padded"].components["activations"] - plans["packed"].components["activations"]
    assert gap == 32 * 1536**2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unfused_logits_hold_what_the_plan_counts(tmp_path, dtype):
    """trainer.fused_loss false: the micro-batch's [M, V] logits, then logprobs_from_logits and entropy_from_logits
    in fp32. The plan counted 8 bytes per logit over the logits' own (a log-softmax and a softmax); the trained
    pass allocated 33 over them (w + 33: 35 bytes per logit in bf16 against the plan's 10), the no-grad pass 16."""
    from fastrlhf.algorithms.logprobs import entropy_from_logits, logprobs_from_logits

    M, V, H = 2048, 4096, 4  # a narrow head: its [V, H] weight and gradient are 0.2% of one [M, V] tensor
    config = run_of(
        tmp_path,
        {**QWEN_TINY, "vocab_size": V, "hidden_size": H, "num_attention_heads": 1, "num_key_value_heads": 1},
        16,
        M,
        fused_loss=False,
        kl_coef=0.0,
    )
    shape = read_shape(config.model.path)
    torch.manual_seed(0)
    head = torch.randn(V, H, dtype=dtype, requires_grad=True)
    hidden = torch.randn(M, H, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (M,))

    def trained():
        logits = hidden @ head.t()
        lp, ent = logprobs_from_logits(logits, labels), entropy_from_logits(logits)
        (lp.sum() + 0.01 * ent.sum()).backward()

    def scored():
        with torch.no_grad():
            logits = hidden @ head.t()
            return logprobs_from_logits(logits, labels), entropy_from_logits(logits)

    w = dtype.itemsize
    planned = C.fused_loss(config, shape, 1, w, "cpu", None)
    measured = allocated_peak(trained)
    assert abs(planned / measured - 1) < 0.01, (planned, measured)
    planned = C.logprob_forward(config, shape, 1, w, "cpu", None)
    measured = allocated_peak(scored)
    assert abs(planned / measured - 1) < 0.01, (planned, measured)


def test_a_value_head_reward_model_holds_its_lm_head(tmp_path):
    """reward.model_kind value_head loads the folder as a causal LM with a value head: an untied [V, h] LM head
    comes with it (unread). The plan counted the classifier's parameters: 64,128 bytes for a tiny untied Qwen2
    whose loaded reward model held 96,898 (Qwen2.5-7B: 1.09 GB per GPU uncounted)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from fastrlhf.modeling import load_value_model

    folder = str(tmp_path / "rm")
    hf = Qwen2Config(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=48,
        tie_word_embeddings=False,
        num_labels=1,
        architectures=["Qwen2ForSequenceClassification"],
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(hf).save_pretrained(folder)
    base = gpu_grpo(model_folder(pathlib.Path(tmp_path / "actor"), hf.to_dict()), 2)  # bf16 on a GPU
    for kind in ("classifier", "value_head"):
        config = dataclasses.replace(base, reward=RewardConfig(model_path=folder, model_kind=kind))
        planned = plan_memory(config, 8, 80 * GiB).components["reward model weights"]
        if kind == "value_head":
            model = load_value_model(ModelConfig(path=folder, dtype="bfloat16"), folder, trainable=False)
        else:
            model = Qwen2ForSequenceClassification.from_pretrained(folder, dtype=torch.bfloat16)
        assert planned == sum(p.numel() * p.element_size() for p in model.parameters()), kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lora_sync_holds_the_merge_of_its_largest_adapted_weight(tmp_path, dtype):
    """A LoRA actor syncs merged weights (fastrlhf.rl.lora_sync): each adapted weight's W + scaling * B @ A in fp32.
    The plan counted no sync memory at ZeRO 0-2 in the engine's dtype (no bucket copy); the merge of a bf16 MLP
    weight of 2048 x 512 beside the previous merged one allocated 18.9 MB (18 bytes per element; Qwen2.5-7B's
    down_proj: 1.22 GB)."""
    from peft import LoraConfig, get_peft_model

    from fastrlhf.modeling.tiny import save_tiny_llama
    from fastrlhf.rl.lora_sync import merged_lora_weights
    from fastrlhf.rollout.weight_sync import iter_bucketed_weights

    dims = dict(vocab_size=64, hidden_size=512, num_heads=4, num_layers=1, intermediate_size=2048)
    model = save_tiny_llama(tmp_path / "m", dtype=dtype, **dims)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))

    def sync():
        return sum(t.numel() for _, t in merged_lora_weights(peft, iter_bucketed_weights(peft, 1 << 30), dtype))

    measured = allocated_peak(sync)
    shape = read_shape(str(tmp_path / "m"))
    assert abs(C.lora_merge_bytes(shape, ["all-linear"], dtype.itemsize, dtype.itemsize) / measured - 1) < 0.01
    if dtype == torch.bfloat16:  # the plan of a GPU run (vLLM in bf16, ZeRO-2) counts it in the sync phase
        config = gpu_grpo(str(tmp_path / "m"), 2)
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, lora_r=4, lora_targets=["all-linear"])
        )
        plan = plan_memory(config, 8, 80 * GiB)
        planned = sum(plan.components[name] for name in plan.phases["weight sync"])
        assert abs(planned / measured - 1) < 0.01, (planned, measured)
