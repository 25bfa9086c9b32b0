"""Bucketing and naming of the weight stream, and HFEngine.update_weights; no vLLM, no launcher."""

import pytest
import torch

from fastrlhf.modeling.tiny import make_tiny_llama
from fastrlhf.rollout import HFEngine, SamplingConfig, iter_bucketed_weights, sync_weights
from fastrlhf.rollout.weight_sync import SyncStats


def test_buckets_respect_the_byte_limit_and_cover_every_parameter():
    model = make_tiny_llama(seed=0)
    stats = SyncStats()
    names = [n for n, _ in iter_bucketed_weights(model, bucket_bytes=40_000, dtype=torch.bfloat16, stats=stats)]
    assert names == [n for n, _ in model.named_parameters()]
    biggest = max(p.numel() * 2 for p in model.parameters())
    assert biggest <= 40_000, "the test needs every parameter to fit one bucket"
    assert all(size <= 40_000 for size in stats.bucket_sizes)
    assert stats.num_buckets == len(stats.bucket_sizes) > 2
    assert stats.bytes == sum(p.numel() * 2 for p in model.parameters())


def test_a_parameter_larger_than_the_bucket_is_a_bucket_of_its_own():
    model = make_tiny_llama(seed=0)
    stats = SyncStats()
    tensors = list(iter_bucketed_weights(model, bucket_bytes=1, stats=stats))
    assert stats.num_buckets == len(tensors) == len(list(model.parameters()))


def test_dtype_conversion_and_values():
    model = make_tiny_llama(seed=0)
    for (name, tensor), (ref_name, ref) in zip(
        iter_bucketed_weights(model, dtype=torch.bfloat16), model.named_parameters(), strict=True
    ):
        assert name == ref_name and tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ref.detach().to(torch.bfloat16))


def test_tied_embeddings_are_sent_once():
    model = make_tiny_llama(seed=0, tie_word_embeddings=True)
    names = [n for n, _ in iter_bucketed_weights(model)]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1


def test_hf_engine_update_weights_makes_it_generate_like_the_source():
    target, source = make_tiny_llama(seed=1, initializer_range=0.2), make_tiny_llama(seed=2, initializer_range=0.2)
    greedy = SamplingConfig(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    expected = HFEngine(source).generate(prompts, greedy)
    engine = HFEngine(target)
    assert engine.generate(prompts, greedy) != expected
    stats = sync_weights(source, engine, bucket_bytes=16_000)
    assert engine.generate(prompts, greedy) == expected
    assert stats.bytes == sum(p.numel() * 4 for p in source.parameters())
    assert stats.num_buckets > 1 and stats.seconds > 0


def test_hf_engine_update_weights_rejects_unknown_names_and_shapes():
    engine = HFEngine(make_tiny_llama(seed=0))
    with pytest.raises(ValueError, match="'model.nope.weight' is not a parameter"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(3,\), expected \(256, 64\)"):
        engine.update_weights([("lm_head.weight", torch.zeros(3))])


def test_bucket_bytes_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got 0"):
        list(iter_bucketed_weights(make_tiny_llama(), bucket_bytes=0))
