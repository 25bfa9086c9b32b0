"""VLLMEngine against HFEngine on the same tiny Llama (head size 32): greedy equality before and after
a weight update (including prompts longer than one 128-token cache block, which a stale prefix cache
would serve from the old weights), logprobs against the trainer's recomputation, seeds, grouping,
and bad input. One vLLM engine per module: start-up costs seconds.
"""

import os

import pytest
import torch

from fastrlhf.algorithms import logprobs_from_logits
from fastrlhf.modeling.tiny import save_tiny_llama
from fastrlhf.rollout import HFEngine, SamplingConfig, sync_weights

pytestmark = pytest.mark.slow

# A wide init gives peaked next-token distributions, so greedy argmax never hinges on fp32 noise.
MODEL_KW = dict(initializer_range=0.2, vocab_size=256, hidden_size=64, num_heads=2)
MAX_MODEL_LEN = 512


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts([5, 17, 140, 300])  # 140 and 300 span full 128-token prefix-cache blocks


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_models")
    first = save_tiny_llama(root / "first", seed=1, **MODEL_KW)
    second = save_tiny_llama(root / "second", seed=2, **MODEL_KW)
    return {"first": (root / "first", first), "second": (root / "second", second)}


@pytest.fixture(scope="module")
def vllm_engine(models):
    pytest.importorskip("vllm")
    # The Triton interpreter (set by conftest for kernel tests) must not leak into vLLM's start-up.
    saved = os.environ.pop("TRITON_INTERPRET", None)
    from fastrlhf.rollout import VLLMEngine

    engine = VLLMEngine(str(models["first"][0]), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=32 << 20)
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
    yield engine
    engine.close()


def _tokens(results):
    return [[c.token_ids for c in samples] for samples in results]


GREEDY = SamplingConfig(temperature=0, max_new_tokens=24, ignore_eos=True)


def test_vllm_greedy_equals_hf_greedy_before_and_after_update(models, vllm_engine):
    first, second = models["first"][1], models["second"][1]
    assert _tokens(vllm_engine.generate(PROMPTS, GREEDY)) == _tokens(HFEngine(first).generate(PROMPTS, GREEDY))

    stats = sync_weights(second, vllm_engine, bucket_bytes=32 << 10)
    assert stats.num_buckets > 1 and stats.bytes == sum(p.numel() * 4 for p in second.parameters())

    expected = _tokens(HFEngine(second).generate(PROMPTS, GREEDY))
    assert expected != _tokens(HFEngine(first).generate(PROMPTS, GREEDY))  # the update is visible
    assert _tokens(vllm_engine.generate(PROMPTS, GREEDY)) == expected

    # And back, so the other tests of this module see the first model again.
    sync_weights(first, vllm_engine)
    assert _tokens(vllm_engine.generate(PROMPTS, GREEDY)) == _tokens(HFEngine(first).generate(PROMPTS, GREEDY))


def test_skipping_the_prefix_cache_reset_would_serve_stale_kv(models, vllm_engine, monkeypatch):
    """Guards the test above: without the reset, long prompts keep the old weights' KV."""
    from fastrlhf.rollout import vllm_adapter

    first, second = models["first"][1], models["second"][1]
    long_prompts = PROMPTS[2:]
    vllm_engine.generate(long_prompts, GREEDY)  # fill the cache with the first model's blocks
    monkeypatch.setattr(vllm_adapter, "reset_prefix_cache", lambda llm: None)
    sync_weights(second, vllm_engine)
    stale = _tokens(vllm_engine.generate(long_prompts, GREEDY))
    monkeypatch.undo()
    sync_weights(first, vllm_engine)
    assert stale != _tokens(HFEngine(second).generate(long_prompts, GREEDY))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_sampled_logprobs_match_trainer_recomputation(models, vllm_engine, temperature, monkeypatch):
    from vllm.logprobs import FlatLogprobs

    from fastrlhf.rollout import vllm_adapter

    containers, read = [], vllm_adapter.sampled_logprobs
    monkeypatch.setattr(vllm_adapter, "sampled_logprobs",
                        lambda ids, lps: containers.append(type(lps)) or read(ids, lps))
    first = models["first"][1]
    sampling = SamplingConfig(n=2, temperature=temperature, max_new_tokens=16, seed=3)
    results = vllm_engine.generate(PROMPTS[:3], sampling)
    assert containers == [FlatLogprobs] * 6  # one flat list per sample, no dict or Logprob object per token
    worst = 0.0
    for prompt, samples in zip(PROMPTS[:3], results, strict=True):
        for c in samples:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = first(ids).logits[0, len(prompt) - 1 : -1]
            recomputed = logprobs_from_logits(logits, torch.tensor(c.token_ids), temperature)
            worst = max(worst, (recomputed - torch.tensor(c.logprobs)).abs().max().item())
    assert worst <= 1e-4


def test_sampled_logprobs_read_the_flat_container_and_the_dicts_alike():
    from vllm.logprobs import FlatLogprobs, Logprob

    from fastrlhf.rollout.vllm_adapter import sampled_logprobs

    ids = [5, 9, 5]
    dicts = [{t: Logprob(logprob=-0.5 * (i + 1), rank=1)} for i, t in enumerate(ids)]
    flat = FlatLogprobs()
    flat.extend(dicts)
    assert sampled_logprobs(ids, flat) == sampled_logprobs(ids, dicts) == [-0.5, -1.0, -1.5]
    top2 = [{t: Logprob(-0.5, 2), 7: Logprob(-0.1, 1)} for t in ids]  # logprobs=1: the top token beside it
    wide = FlatLogprobs()
    wide.extend(top2)
    assert sampled_logprobs(ids, wide) == sampled_logprobs(ids, top2) == [-0.5] * 3


def test_hf_sampled_logprobs_match_trainer_recomputation(models):
    first = models["first"][1]
    sampling = SamplingConfig(n=2, temperature=0.7, max_new_tokens=16, seed=3)
    results = HFEngine(first).generate(PROMPTS[:3], sampling)
    for prompt, samples in zip(PROMPTS[:3], results, strict=True):
        for c in samples:
            with torch.no_grad():
                logits = first(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            recomputed = logprobs_from_logits(logits, torch.tensor(c.token_ids), 0.7)
            assert torch.allclose(recomputed, torch.tensor(c.logprobs), atol=1e-4)


@pytest.mark.parametrize("engine_kind", ["vllm", "hf"])
def test_seeded_sampling_is_reproducible_and_grouped(models, vllm_engine, engine_kind):
    engine = vllm_engine if engine_kind == "vllm" else HFEngine(models["first"][1])
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=12, seed=7, ignore_eos=True)
    a = engine.generate(PROMPTS[:2], sampling)
    b = engine.generate(PROMPTS[:2], sampling)
    assert _tokens(a) == _tokens(b)
    assert [len(samples) for samples in a] == [3, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for samples in a for c in samples)
    assert len({tuple(c.token_ids) for c in a[0]}) == 3  # n samples, not one sample repeated
    other = engine.generate(PROMPTS[:2], SamplingConfig(n=3, temperature=1.0, max_new_tokens=12, seed=8))
    assert _tokens(other) != _tokens(a)
    if engine_kind == "vllm":
        # vLLM seeds each request: prompt i's samples do not depend on the rest of the batch.
        # (HF draws from one batch-wide stream, so there only the whole batch is reproducible.)
        alone = engine.generate([PROMPTS[1]], sampling)
        assert _tokens(alone)[0] == _tokens(a)[1]


def test_vllm_seeds_each_prompt_apart_and_a_prompt_the_same_wherever_it_stands(vllm_engine, monkeypatch):
    """vLLM seeds each request. With one seed for all, sample k of every prompt drew the same random numbers
    (on a flat head, 8 different prompts gave 1 distinct first token per sample index): each prompt gets its own,
    from the config's seed and the prompt, so a prompt alone and in a batch still sample the same."""
    from fastrlhf.rollout import vllm_adapter

    sent = []
    original = vllm_adapter.run_generate
    monkeypatch.setattr(vllm_adapter, "run_generate",
                        lambda llm, prompts, params, *a: sent.append(params) or original(llm, prompts, params, *a))
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=2, seed=7)
    batch = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]]  # a prompt twice: two draws, not one repeated
    out = vllm_engine.generate(batch, sampling)
    vllm_engine.generate([PROMPTS[1]], sampling)
    seeds = [p.seed for p in sent[0]]
    assert len(set(seeds)) == 4 and sent[1][0].seed == seeds[1], seeds
    assert all(abs(a - b) > sampling.n for i, a in enumerate(seeds) for b in seeds[:i])  # seed + k stay apart
    assert _tokens(out)[0] != _tokens(out)[2]


@pytest.mark.parametrize("engine_kind", ["vllm", "hf"])
def test_stop_tokens_end_completions_with_finish_reason_stop(models, vllm_engine, engine_kind):
    engine = vllm_engine if engine_kind == "vllm" else HFEngine(models["first"][1])
    free = engine.generate(PROMPTS[:2], GREEDY)
    # Stop on the 4th greedy token of the first prompt: the completion ends there, stop token kept.
    stop = free[0][0].token_ids[3]
    first_hit = free[0][0].token_ids.index(stop)
    stopped = engine.generate(PROMPTS[:2], SamplingConfig(temperature=0, max_new_tokens=24, stop_token_ids=(stop,)))
    c = stopped[0][0]
    assert c.finish_reason == "stop" and c.token_ids == free[0][0].token_ids[: first_hit + 1]
    assert len(c.logprobs) == len(c.token_ids)
    other = stopped[1][0]
    if stop not in free[1][0].token_ids:
        assert other.finish_reason == "length" and len(other.token_ids) == 24


def test_engines_agree_on_stop_and_length(models, vllm_engine):
    stop = _tokens(HFEngine(models["first"][1]).generate(PROMPTS, GREEDY))[2][0][5]
    sampling = SamplingConfig(temperature=0, max_new_tokens=20, stop_token_ids=(stop,))
    hf = HFEngine(models["first"][1]).generate(PROMPTS, sampling)
    vl = vllm_engine.generate(PROMPTS, sampling)
    assert [(c.token_ids, c.finish_reason) for s in hf for c in s] == [
        (c.token_ids, c.finish_reason) for s in vl for c in s
    ]


BAD_INPUTS = [
    ([], "prompt_token_ids is empty"),
    ([[3, 4], []], r"prompt_token_ids\[1\] is empty"),
    ([[3, 256]], r"token id 256 outside the vocabulary \[0, 256\)"),
    ([[3, -1]], "token id -1 outside"),
    ([[3] * MAX_MODEL_LEN], f"has {MAX_MODEL_LEN} tokens: expected fewer than max_model_len={MAX_MODEL_LEN}"),
]


@pytest.mark.parametrize("prompts,message", BAD_INPUTS)
@pytest.mark.parametrize("engine_kind", ["vllm", "hf"])
def test_bad_prompts_fail_before_generation(models, vllm_engine, engine_kind, prompts, message, monkeypatch):
    if engine_kind == "vllm":
        from fastrlhf.rollout import vllm_adapter

        engine = vllm_engine
        monkeypatch.setattr(vllm_adapter, "run_generate", lambda *a: pytest.fail("generation started"))
    else:
        engine = HFEngine(models["first"][1], max_model_len=MAX_MODEL_LEN)
        monkeypatch.setattr(engine.model, "generate", lambda *a, **k: pytest.fail("generation started"))
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, GREEDY)


def test_unsupported_head_size_fails_before_startup(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from fastrlhf.rollout import VLLMEngine, vllm_adapter

    save_tiny_llama(tmp_path, hidden_size=64, num_heads=4)  # head size 16
    monkeypatch.setattr(vllm_adapter, "make_llm", lambda *a, **k: pytest.fail("vLLM was started"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"head size 16 .* expected one of \[32, 64, 80"):
        VLLMEngine(str(tmp_path))


def _one_char_per_token_tokenizer(vocab_size=256):
    """A real fast tokenizer whose every token is one character: printable ASCII, then CJK."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(32 + i) for i in range(95)] + [chr(0x4E00 + i) for i in range(vocab_size - 95)]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chars[1])


@pytest.mark.parametrize("engine_kind", ["vllm", "hf"])
def test_stop_strings_end_completions_at_the_completing_token(models, vllm_engine, engine_kind):
    tokenizer = _one_char_per_token_tokenizer()
    hf = HFEngine(models["first"][1], tokenizer=tokenizer)
    free = hf.generate(PROMPTS[:2], GREEDY)[0][0].token_ids
    text = tokenizer.decode(free)
    assert len(text) == len(free)
    stop = text[4:6]  # a two-token string: the cut falls on the token that completes it
    end = text.index(stop) + len(stop)
    engine = hf
    if engine_kind == "vllm":
        engine, vllm_engine.tokenizer = vllm_engine, tokenizer
    try:
        sampling = SamplingConfig(temperature=0, max_new_tokens=24, ignore_eos=True, stop=(stop,))
        c = engine.generate(PROMPTS[:1], sampling)[0][0]
    finally:
        vllm_engine.tokenizer = None
    assert c.finish_reason == "stop" and c.token_ids == free[:end] and len(c.logprobs) == end
    assert tokenizer.decode(c.token_ids).endswith(stop)
    assert len(hf._stop_string_criteria((stop,))) == 1  # HF also stops the row early, not only cuts it
    # Without a tokenizer a stop string cannot be seen: refused before any work.
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        HFEngine(models["first"][1]).generate(PROMPTS[:1], sampling)


def test_the_tokenizers_eos_stops_generation_too(models):
    tokenizer = _one_char_per_token_tokenizer()
    free = HFEngine(models["first"][1]).generate(PROMPTS[:1], GREEDY)[0][0].token_ids
    engine = HFEngine(models["first"][1], eos_token_id=[], tokenizer=tokenizer)
    assert engine.eos_token_ids == [tokenizer.eos_token_id]
    stops = [t for t in free if t == tokenizer.eos_token_id]
    c = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=24))[0][0]
    if stops:
        assert c.finish_reason == "stop" and c.token_ids[-1] == tokenizer.eos_token_id
    else:
        assert c.finish_reason == "length"


def test_the_head_size_table_checked_before_start_up_is_vllms_own():
    pytest.importorskip("vllm")
    from fastrlhf.rollout import vllm_adapter

    assert vllm_adapter.CPU_SUPPORTED_HEAD_SIZES == vllm_adapter.cpu_supported_head_sizes()


def test_asleep_bytes_are_the_sleeping_allocations_of_vllms_pool(monkeypatch):
    """What the step leaves out of torch's counters: the sizes (``handle[1]``) of the pool's allocations whose
    pages sleep released, read from vLLM's own allocator (the same fields in 0.26 and 0.32); 0 before an engine
    with sleep mode made the allocator."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.device_allocator import AllocationData
    from vllm.device_allocator.cumem import CuMemAllocator

    from fastrlhf.rollout import vllm_adapter

    monkeypatch.setattr(CuMemAllocator, "instance", None)
    assert vllm_adapter.asleep_bytes() == 0
    # handle: (device, size, pointer, CUDA handle)
    data = {1: AllocationData(handle=(0, 3 << 20, 1, 0), tag="weights", is_asleep=True),
            2: AllocationData(handle=(0, 5 << 20, 2, 0), tag="kv_cache", is_asleep=False),
            3: AllocationData(handle=(0, 7 << 20, 3, 0), tag="kv_cache", is_asleep=True)}
    monkeypatch.setattr(CuMemAllocator, "instance", SimpleNamespace(pointer_to_data=data))
    assert vllm_adapter.asleep_bytes() == 10 << 20


def test_the_cuda_sync_loads_in_place_exactly_the_models_whose_kernels_read_the_checkpoint_layout(vllm_engine):
    """On CUDA the sync takes the model's own ``load_weights`` (one copy per tensor) where no module processes its
    weights after loading; vLLM's generic reload otherwise. The real engine's module tree (a Llama here, the same
    vLLM classes as on a GPU) qualifies, so the GPU run does not silently fall back; a quantized layer, a MoE
    layer's method or a module with post-load processing of its own (MLA) does not."""
    import torch.nn as nn

    from fastrlhf.rollout.vllm_adapter import engine_loads_in_place, loads_in_place

    assert engine_loads_in_place(vllm_engine.llm)

    def model_with(method_name: str | None = None, module_name: str | None = None) -> nn.Module:
        model = nn.Sequential(nn.Linear(2, 2))
        model[0].quant_method = type("UnquantizedLinearMethod", (), {})()
        if method_name:
            extra = nn.Linear(2, 2)
            extra.quant_method = type(method_name, (), {})()
            model.append(extra)
        if module_name:
            model.append(type(module_name, (nn.Module,), {"process_weights_after_loading": lambda self, dtype: None})())
        return model

    assert loads_in_place(model_with()) and loads_in_place(model_with(module_name="Attention"))
    assert not loads_in_place(model_with("Fp8LinearMethod"))
    assert not loads_in_place(model_with("UnquantizedFusedMoEMethod"))
    assert not loads_in_place(model_with(module_name="MLAAttention"))
