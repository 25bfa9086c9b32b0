"""Weight sync audit: what a LoRA actor's merged stream carries into an engine of its own; no vLLM, no launcher."""

import copy

import pytest
import torch

from fastrlhf.modeling.tiny import make_tiny_llama
from fastrlhf.rl.lora_sync import merged_lora_weights, sync_lora_weights
from fastrlhf.rollout import HFEngine, SamplingConfig, iter_bucketed_weights

TINY = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=1, tie_word_embeddings=False)


def _lora_actor(targets, seed=0):
    """A PEFT actor whose adapters are not zero, as after training (PEFT starts a Linear's B and an embedding's A at
    zero)."""
    from peft import LoraConfig, get_peft_model

    actor = get_peft_model(make_tiny_llama(seed=seed, **TINY), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.2)
    return actor


@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["embed_tokens", "lm_head", "v_proj"]])
def test_an_adapted_embedding_reaches_the_engine_merged(targets):
    """``model.lora_targets`` may name embed_tokens (an untied model: the config check allows it), whose PEFT factors
    are ``lora_embedding_A/B.<adapter>`` ([r, V] and [H, r], no ``.weight``). Before, the stream passed them on under
    those names and the engine refused the first one ("'model.embed_tokens.lora_embedding_A.default' is not a
    parameter of LlamaForCausalLM"): every sync into vLLM or a ZeRO-3 HF engine failed. Now the engine holds
    exactly what PEFT's own merge gives, embedding included ((B @ A).T, scaled)."""
    actor = _lora_actor(targets)
    engine = HFEngine(make_tiny_llama(seed=0, **TINY).eval())
    stats = sync_lora_weights(actor, engine, bucket_bytes=4096)
    assert stats.num_buckets > 1
    merged = copy.deepcopy(actor).merge_and_unload()
    base = make_tiny_llama(seed=0, **TINY)
    assert (merged.model.embed_tokens.weight - base.model.embed_tokens.weight).abs().max() > 1e-2  # the delta counts
    for (name, want), (engine_name, got) in zip(
        merged.named_parameters(), engine.model.named_parameters(), strict=True
    ):
        assert name == engine_name
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    greedy = SamplingConfig(temperature=0, max_new_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in engine.generate([[5, 6, 7]], greedy)[0]] == [
        c.token_ids for c in HFEngine(merged.eval()).generate([[5, 6, 7]], greedy)[0]
    ]


def test_the_merged_stream_carries_each_hf_parameter_once_under_its_hf_name():
    """What a vLLM loader gets: the plain model's names, each once, nothing of PEFT's."""
    actor = _lora_actor(["q_proj", "embed_tokens"])
    names = [n for n, _ in merged_lora_weights(actor, iter_bucketed_weights(actor, bucket_bytes=4096))]
    assert sorted(names) == sorted(n for n, _ in make_tiny_llama(seed=0, **TINY).named_parameters())
    assert len(names) == len(set(names))


def test_repeated_bf16_syncs_leave_the_trainers_weights_bitwise_as_they_were():
    """The merge happens on the stream's copies, never in the trainer's base weights (TRL merges the adapter into
    the model and unmerges it after, which in bf16 leaves W + d - d != W): after several syncs every parameter of
    the actor, base and adapter, is bitwise what it was."""
    actor = _lora_actor(["q_proj", "v_proj", "lm_head"]).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    engine = HFEngine(make_tiny_llama(seed=0, dtype=torch.bfloat16, **TINY).eval())
    for _ in range(3):
        sync_lora_weights(actor, engine, bucket_bytes=4096)
    assert all(torch.equal(p, before[n]) for n, p in actor.named_parameters())
    assert engine.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_a_lora_syncs_stats_count_what_the_engine_got():
    """``sync_bytes`` (the step's metric) is what the engine received, as for a plain actor: the merged weights in the
    engine's dtype. Before, it was the gathered PEFT stream, adapter factors included, in the trainer's dtype: an
    fp32 actor with all-linear r=8 adapters syncing a bf16 engine reported 1,446,400 bytes and 54 tensors for the
    657,664 bytes and 26 tensors the engine holds."""
    from peft import LoraConfig, get_peft_model

    from fastrlhf.modeling.tiny import make_tiny_qwen2

    actor = get_peft_model(make_tiny_qwen2(seed=0), LoraConfig(r=8, lora_alpha=8, target_modules="all-linear"))
    engine = HFEngine(make_tiny_qwen2(seed=5, dtype=torch.bfloat16).eval())
    stats = sync_lora_weights(actor, engine, bucket_bytes=1 << 20)
    params = list(engine.model.parameters())
    assert stats.bytes == sum(p.numel() * p.element_size() for p in params)
    assert stats.num_tensors == len(params)
    assert stats.num_buckets >= 1 and stats.gather_seconds > 0
