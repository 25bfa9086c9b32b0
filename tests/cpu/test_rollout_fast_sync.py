"""The in-place CPU weight update (``vllm_inplace_sync``, reached from ``vllm_adapter.reload_weights``:
weights written in place into packed GEMM weights, or vLLM's repack of the changed layers where that
is unavailable) against the generic ``reload_weights`` path and HF.

The tiny Llama (tied and untied embeddings) must take the direct path, end with every linear layer
and lm_head on the kind of GEMM weight the CPU probe (fastrlhf/cpu/probe.py) allows for it (an
in-place packed weight, or vLLM's repack), and generate exactly what HF generates from the synced
weights and exactly what the generic path gives (same sampled tokens and bitwise-equal logprobs).
Each test runs with the probe's real answer and with the probe forced off (the path of a CPU that
allows no in-place packing: no C compiler, or a oneDNN that packs otherwise). A layout the direct
path does not handle (qkv/o biases) must fall back to the generic path and still be correct. One engine at a
time: each start-up costs seconds.

The tiny Qwen2 (q/k/v biases, which vLLM fuses into qkv_proj's bias; grouped-query attention; tied
and untied embeddings) must take the direct path too, leave the engine computing with exactly the
trainer's weights (read back from the packed GEMM weights), and give the trainer's logprobs and the
generic path's samples bitwise. One engine per Qwen2 variant, shared by that variant's tests.
"""

import os

import pytest
import torch
from helpers.cpu_probe import probe_answer

from fastrlhf.algorithms import logprobs_from_logits
from fastrlhf.modeling.tiny import make_tiny_llama, make_tiny_qwen2, save_tiny_llama, save_tiny_qwen2
from fastrlhf.rollout import HFEngine, SamplingConfig, sync_weights

pytestmark = pytest.mark.slow

MODEL_KW = dict(initializer_range=0.2, vocab_size=256, hidden_size=64, num_heads=2)
MAX_MODEL_LEN = 512
GREEDY = SamplingConfig(temperature=0, max_new_tokens=24, ignore_eos=True)
SAMPLED = SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=3)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts([5, 17, 140, 300])  # 140 and 300 span full 128-token prefix-cache blocks


def _tokens(results):
    return [[c.token_ids for c in samples] for samples in results]


def _samples(results):
    return [[(c.token_ids, c.logprobs) for c in samples] for samples in results]


def _engine(path, dtype="float32"):
    pytest.importorskip("vllm")
    saved = os.environ.pop("TRITON_INTERPRET", None)
    from fastrlhf.rollout import VLLMEngine

    try:
        return VLLMEngine(str(path), dtype=dtype, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=32 << 20)
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


class _PathSpy:
    """Counts which update path each sync takes."""

    def __init__(self, monkeypatch):
        from fastrlhf.cpu import vllm_inplace_sync
        from fastrlhf.rollout import vllm_adapter

        self.fast = 0
        self.generic = 0
        refresh = vllm_adapter._refresh_tied_lm_head

        def counted_fast(worker, named_tensors):
            taken = vllm_inplace_sync.try_update_in_place(worker, named_tensors)
            self.fast += taken
            return taken

        def counted_generic(worker):  # runs once after every generic reload_weights
            self.generic += 1
            return refresh(worker)

        monkeypatch.setattr(vllm_adapter, "IN_PLACE_UPDATERS", (counted_fast,))
        monkeypatch.setattr(vllm_adapter, "_refresh_tied_lm_head", counted_generic)


def _expected_gemm_kinds(model, dtype) -> set[str]:
    """The kinds ``gemm_weight_kinds`` must report after a direct-path sync of ``model``, from the CPU
    probe: a layer gets an in-place packed weight where vLLM runs it on oneDNN (not sgl-kernel, which
    it picks for small bf16 weights on AMX) and this machine packs its shape in panels."""
    from fastrlhf.cpu.packed_linear import new_packed_weight
    from fastrlhf.cpu.probe import cpu_probe

    c = model.config
    head = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    shapes = {(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size), (c.vocab_size, c.hidden_size)}
    probe = cpu_probe()
    return {"in_place" if probe.vllm_gemm(n, k, dtype) == "onednn" and new_packed_weight(n, k, dtype, probe) is not None
            else "vllm" for n, k in shapes}


def _generic_path_gives_the_same_engine(engine, first, second, expected_first, direct_samples, spy, monkeypatch):
    """vLLM's generic reload from ``first`` to ``second`` leaves the engine sampling exactly what the
    direct path left it sampling (``direct_samples``), on vLLM's own packed weights."""
    from fastrlhf.cpu.vllm_inplace_sync import gemm_weight_kinds

    _generic_only(monkeypatch)
    sync_weights(first, engine)
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected_first
    sync_weights(second, engine)
    assert spy.generic == 2
    assert gemm_weight_kinds(engine.llm) == {"vllm"}
    assert _samples(engine.generate(PROMPTS[:3], SAMPLED)) == direct_samples
    monkeypatch.undo()


def _generic_only(monkeypatch):
    from fastrlhf.rollout import vllm_adapter

    monkeypatch.setattr(vllm_adapter, "IN_PLACE_UPDATERS", ())


@pytest.mark.parametrize(
    "tied, answer", [(False, "real"), (True, "real"), (False, "forced-off")],
    ids=["untied", "tied", "untied-forced-off"],
)
def test_tiny_llama_takes_the_direct_path_and_matches_hf_and_the_generic_path(tmp_path, monkeypatch, tied, answer):
    kw = dict(MODEL_KW, tie_word_embeddings=tied)
    first = save_tiny_llama(tmp_path / "first", seed=1, **kw)
    second = make_tiny_llama(seed=2, **kw)
    with probe_answer(answer):
        kinds = _expected_gemm_kinds(second, torch.float32)
        engine = _engine(tmp_path / "first")
        try:
            _llama_direct_path(first, second, engine, kinds, monkeypatch)
        finally:
            engine.close()
    if answer == "forced-off":
        assert kinds == {"vllm"}


def _llama_direct_path(first, second, engine, kinds, monkeypatch):
    """The engine starts on ``first``; syncs to ``second`` (direct), back and forth (generic), then to
    ``first`` (direct again), its GEMM weights of ``kinds`` after each direct sync."""
    from fastrlhf.cpu.vllm_inplace_sync import embedding_pack_released, gemm_weight_kinds

    spy = _PathSpy(monkeypatch)
    expected_first = _tokens(HFEngine(first).generate(PROMPTS, GREEDY))
    expected_second = _tokens(HFEngine(second).generate(PROMPTS, GREEDY))
    assert expected_first != expected_second
    assert embedding_pack_released(engine.llm)  # at start-up, and still generating exactly
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected_first

    assert gemm_weight_kinds(engine.llm) == {"vllm"}
    # Small buckets: q/k/v and gate/up of a layer arrive in different buckets.
    sync_weights(second, engine, bucket_bytes=16 << 10)
    assert (spy.fast, spy.generic) == (1, 0)
    assert gemm_weight_kinds(engine.llm) == kinds
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected_second
    direct = _samples(engine.generate(PROMPTS[:3], SAMPLED))

    _generic_path_gives_the_same_engine(engine, first, second, expected_first, direct, spy, monkeypatch)

    # And the direct path after a generic reload, back to the first model.
    spy = _PathSpy(monkeypatch)
    sync_weights(first, engine)
    assert (spy.fast, spy.generic) == (1, 0)
    assert gemm_weight_kinds(engine.llm) == kinds
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected_first


# Wide enough that vLLM runs some bf16 layers on oneDNN even on AMX, where it gives weights of up to
# 1 MiB to sgl-kernel (qkv_proj and gate_up_proj here are larger, o_proj, down_proj and lm_head not).
BF16_KW = dict(initializer_range=0.05, vocab_size=256, hidden_size=512, num_heads=8, intermediate_size=1024)


def test_bf16_engine_is_updated_in_place_and_matches_the_generic_path(tmp_path, monkeypatch, cpu_probe_answer):
    """bf16 weights are packed in K-adjacent pairs; the in-place path must give the engine the very
    state vLLM's own reload gives it (HF greedy is not the reference here: bf16 rounding differs), on
    the layers the probe allows it and through vLLM's repack on the others."""
    from fastrlhf.cpu.vllm_inplace_sync import gemm_weight_kinds

    first = save_tiny_llama(tmp_path / "first", seed=1, **BF16_KW)
    second = make_tiny_llama(seed=2, **BF16_KW)
    kinds = _expected_gemm_kinds(second, torch.bfloat16)
    assert ("in_place" in kinds) == (cpu_probe_answer.packs_in_place(torch.bfloat16) and kinds != {"vllm"})
    engine = _engine(tmp_path / "first", dtype="bfloat16")
    try:
        before = _samples(engine.generate(PROMPTS[:3], SAMPLED))
        sync_weights(second, engine)
        assert gemm_weight_kinds(engine.llm) == kinds
        direct = _samples(engine.generate(PROMPTS[:3], SAMPLED))
        assert direct != before
        _generic_only(monkeypatch)
        sync_weights(first, engine)
        assert _samples(engine.generate(PROMPTS[:3], SAMPLED)) == before
        sync_weights(second, engine)
        assert gemm_weight_kinds(engine.llm) == {"vllm"}
        assert _samples(engine.generate(PROMPTS[:3], SAMPLED)) == direct
    finally:
        engine.close()


def test_direct_path_rejects_bad_names_and_shapes(tmp_path):
    save_tiny_llama(tmp_path, seed=1, **MODEL_KW)
    engine = _engine(tmp_path)
    try:
        with pytest.raises(ValueError, match="'model.nope.weight' is not a weight of this vLLM Llama"):
            engine.update_weights([("model.nope.weight", torch.zeros(1))])
        with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), expected \(64,\)"):
            engine.update_weights([("model.norm.weight", torch.zeros(3))])
        with pytest.raises(ValueError, match="must carry whole fused layers"):
            engine.update_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])
    finally:
        engine.close()


def test_unhandled_layout_falls_back_to_the_generic_reload(tmp_path, monkeypatch):
    """Biases on q/k/v/o: a Llama the direct path does not handle, detected up front."""
    kw = dict(MODEL_KW, attention_bias=True)
    first = save_tiny_llama(tmp_path / "first", seed=1, **kw)
    second = make_tiny_llama(seed=2, **kw)
    with torch.no_grad():  # biases start at zero: make them matter
        for name, p in second.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.2)
    engine = _engine(tmp_path / "first")
    try:
        from fastrlhf.cpu.vllm_inplace_sync import embedding_pack_released

        assert not embedding_pack_released(engine.llm)  # a layout not known here is left as vLLM made it
        spy = _PathSpy(monkeypatch)
        sync_weights(second, engine)
        assert (spy.fast, spy.generic) == (0, 1)
        expected = _tokens(HFEngine(second).generate(PROMPTS, GREEDY))
        assert expected != _tokens(HFEngine(first).generate(PROMPTS, GREEDY))
        assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected
    finally:
        engine.close()


# Qwen2 as the small Qwen2/Qwen2.5 models are: q/k/v biases, 4 query heads over 2 key/value heads
# (head size 32, which the vLLM CPU backend runs), tied embeddings unless the variant says otherwise.
QWEN2_KW = dict(initializer_range=0.2, vocab_size=256, hidden_size=128, num_heads=4, num_kv_heads=2)
QWEN2_VARIANTS = {"tied": (True, "real"), "untied": (False, "real"), "tied-forced-off": (True, "forced-off")}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module", params=list(QWEN2_VARIANTS))
def qwen2(request, tmp_path_factory):
    """(first, second, engine on first, in_place) for one variant, under its CPU probe answer
    (``in_place``: every GEMM weight packed in place after a direct sync); the engine is left on ``first``."""
    tied, answer = QWEN2_VARIANTS[request.param]
    kw = dict(QWEN2_KW, tie_word_embeddings=tied)
    root = tmp_path_factory.mktemp(f"qwen2_{request.param}")
    first = save_tiny_qwen2(root / "first", seed=1, **kw)
    second = make_tiny_qwen2(seed=2, **kw)
    with probe_answer(answer):
        kinds = _expected_gemm_kinds(second, torch.float32)
        if answer == "forced-off":
            assert kinds == {"vllm"}
        engine = _engine(root / "first")
        try:
            yield first, second, engine, kinds == {"in_place"}
        finally:
            engine.close()


def _hf_weights_as_vllm_fuses_them(model) -> dict[str, torch.Tensor]:
    """The trainer's state dict under vLLM's module names: q|k|v and gate|up concatenated (weights
    and biases), lm_head as well as embed_tokens (the same tensor when tied)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state.setdefault("lm_head.weight", model.get_output_embeddings().weight.detach())
    out = {}
    for name, tensor in state.items():
        fused = next(((f, parts) for f, parts in _FUSED.items() if f".{parts[0]}." in name), None)
        if fused is not None:
            f, parts = fused
            out[name.replace(parts[0], f)] = torch.cat([state[name.replace(parts[0], part)] for part in parts])
        elif not any(f".{part}." in name for parts in _FUSED.values() for part in parts):
            out[name] = tensor
    return out


def _engine_weights(worker) -> dict[str, torch.Tensor]:
    """What the engine's kernels read: each linear layer's in-place packed GEMM weight unpacked to
    [N, K] (see ``packed_linear.reference_pack_rows``), biases, and the weights read directly
    (embedding rows, norms). A layer on vLLM's own packed copy cannot be read and is left out."""
    from fastrlhf.cpu.packed_linear import PackedLinearWeight

    out = {}
    for name, module in worker.model_runner.model.named_modules():
        packed = getattr(module, "cpu_linear", None)
        if isinstance(packed, PackedLinearWeight) and not name.endswith("embed_tokens"):
            n, k = packed.shape
            words = packed.panels.permute(0, 2, 1).reshape(n, -1).contiguous()
            out[f"{name}.weight"] = words.view(packed.dtype).reshape(n, k).clone()
        elif not hasattr(module, "cpu_linear") or name.endswith("embed_tokens"):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.nn.Parameter) and weight.numel():
                out[f"{name}.weight"] = weight.detach().clone()
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.nn.Parameter):
            out[f"{name}.bias"] = bias.detach().clone()
    return out


def _assert_engine_computes_with(engine, model, in_place):
    expected = _hf_weights_as_vllm_fuses_them(model)
    (got,) = engine.llm.collective_rpc(_engine_weights)
    if in_place:  # every weight readable: exactly the trainer's, none missing or extra
        assert sorted(got) == sorted(expected)
    else:  # linear layers and lm_head run on vLLM's packed copies: the rest must still match
        assert set(got) < set(expected) and any(name.endswith("qkv_proj.bias") for name in got)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def _max_logprob_error(model, results, prompts, temperature) -> float:
    worst = 0.0
    for prompt, samples in zip(prompts, results, strict=True):
        for c in samples:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            recomputed = logprobs_from_logits(logits, torch.tensor(c.token_ids), temperature)
            worst = max(worst, (recomputed - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def test_tiny_qwen2_takes_the_direct_path_and_matches_the_trainer_and_the_generic_path(qwen2, monkeypatch):
    """Before the Qwen2 layout was known, every sync of this model took the generic reload."""
    from fastrlhf.cpu.vllm_inplace_sync import embedding_pack_released, gemm_weight_kinds, in_place_layout

    first, second, engine, in_place = qwen2
    assert in_place_layout(engine.llm) == "Qwen2"
    assert embedding_pack_released(engine.llm)
    spy = _PathSpy(monkeypatch)
    expected_first = _tokens(HFEngine(first).generate(PROMPTS, GREEDY))
    expected_second = _tokens(HFEngine(second).generate(PROMPTS, GREEDY))
    assert expected_first != expected_second
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected_first

    # Small buckets: q/k/v weights and biases, and gate/up, of a layer arrive in different buckets.
    stats = sync_weights(second, engine, bucket_bytes=16 << 10)
    assert stats.num_buckets > 4
    assert (spy.fast, spy.generic) == (1, 0)
    assert gemm_weight_kinds(engine.llm) == ({"in_place"} if in_place else {"vllm"})
    _assert_engine_computes_with(engine, second, in_place)
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected_second
    direct = engine.generate(PROMPTS[:3], SAMPLED)
    assert _max_logprob_error(second, direct, PROMPTS[:3], SAMPLED.temperature) <= 1e-4

    _generic_path_gives_the_same_engine(engine, first, second, expected_first, _samples(direct), spy, monkeypatch)

    # And the direct path after a generic reload, back to the first model (as the next test expects).
    spy = _PathSpy(monkeypatch)
    sync_weights(first, engine)
    assert (spy.fast, spy.generic) == (1, 0)
    _assert_engine_computes_with(engine, first, in_place)
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected_first


def test_qwen2_state_dict_with_or_without_lm_head_weight_takes_the_direct_path(qwen2, monkeypatch):
    """A tied model's ``named_parameters`` (what ``sync_weights`` sends) has no lm_head.weight; its
    ``state_dict`` has it too, the same tensor as embed_tokens. Either way: direct path, same engine."""
    first, second, engine, in_place = qwen2
    spy = _PathSpy(monkeypatch)
    with_head = list(second.state_dict().items())
    assert any(name == "lm_head.weight" for name, _ in with_head)
    engine.update_weights(with_head)
    _assert_engine_computes_with(engine, second, in_place)
    expected = _tokens(HFEngine(second).generate(PROMPTS, GREEDY))
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected
    engine.update_weights(list(first.named_parameters()))
    _assert_engine_computes_with(engine, first, in_place)
    assert (spy.fast, spy.generic) == (2, 0)


def test_qwen2_direct_path_rejects_bad_bias_names_and_shapes(qwen2):
    first, _, engine, in_place = qwen2
    p = "model.layers.0.self_attn."
    with pytest.raises(ValueError, match=f"'{p}o_proj.bias' is not a weight of this vLLM Qwen2"):
        engine.update_weights([(f"{p}o_proj.bias", torch.zeros(128))])
    with pytest.raises(ValueError, match=rf"'{p}k_proj.bias' has shape \(128,\), expected \(64,\)"):
        engine.update_weights([(f"{p}k_proj.bias", torch.zeros(128))])
    _assert_engine_computes_with(engine, first, in_place)  # refused before anything was written


def _embedding_data_ptr(worker) -> int:
    return worker.model_runner.model.model.embed_tokens.weight.data_ptr()


def test_qwen2_engine_reads_the_trainers_embedding_it_was_handed(qwen2, monkeypatch):
    """``share_input_embedding``: the engine's lookup reads the trainer's tensor (its own copy freed),
    syncs after in-place updates of the trainer stay exact (a tied lm_head's packed copy is still
    rewritten), and an update with any other tensor, direct or generic, gives the engine a copy of its
    own again without writing into the trainer's."""
    import copy

    first, second, engine, in_place = qwen2
    trainer = copy.deepcopy(second)
    embed = trainer.get_input_embeddings().weight
    sync_weights(trainer, engine)
    assert engine.share_input_embedding(embed) == embed.numel() * embed.element_size()
    assert engine.llm.collective_rpc(_embedding_data_ptr) == [embed.data_ptr()]
    assert engine.share_input_embedding(embed) == 0  # already read from there
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == _tokens(HFEngine(trainer).generate(PROMPTS, GREEDY))

    # An optimizer step changes the trainer's weights in place; the sync that follows is exact.
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    sync_weights(trainer, engine)
    assert engine.llm.collective_rpc(_embedding_data_ptr) == [embed.data_ptr()]
    _assert_engine_computes_with(engine, trainer, in_place)
    expected = _tokens(HFEngine(trainer).generate(PROMPTS, GREEDY))
    assert expected != _tokens(HFEngine(second).generate(PROMPTS, GREEDY))
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected

    # Another model's tensors: the engine takes them into storage of its own.
    kept = embed.detach().clone()
    sync_weights(first, engine)
    assert torch.equal(embed, kept)
    assert engine.llm.collective_rpc(_embedding_data_ptr) != [embed.data_ptr()]
    _assert_engine_computes_with(engine, first, in_place)

    # The same through vLLM's generic reload (a layout the direct path declines).
    assert engine.share_input_embedding(embed) > 0
    _generic_only(monkeypatch)
    sync_weights(second, engine)
    assert torch.equal(embed, kept)
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == _tokens(HFEngine(second).generate(PROMPTS, GREEDY))
    monkeypatch.undo()
    sync_weights(first, engine)  # as the other tests expect
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == _tokens(HFEngine(first).generate(PROMPTS, GREEDY))


def _whole_pages(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` that lie in whole pages (what a release can drop), as uint8."""
    import mmap

    flat = t.detach().reshape(-1).view(torch.uint8)
    lo = -(-flat.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE - flat.data_ptr()
    hi = (flat.data_ptr() + flat.numel()) // mmap.PAGESIZE * mmap.PAGESIZE - flat.data_ptr()
    return flat[lo:max(lo, hi)]


def _released_state(worker):
    """(packed GEMM weights, bytes of them and of the KV cache in whole pages, whether all of those read 0)."""
    from fastrlhf.cpu.packed_linear import PackedLinearWeight
    from fastrlhf.cpu.vllm_inplace_sync import _kv_cache_tensors

    packed = [m.cpu_linear.panels for _, m in worker.model_runner.model.named_modules()
              if isinstance(getattr(m, "cpu_linear", None), PackedLinearWeight)]
    pages = [_whole_pages(t) for t in packed + _kv_cache_tensors(worker)]
    return len(packed), sum(p.numel() for p in pages), all(not p.any() for p in pages)


def test_qwen2_sleep_releases_packed_weights_and_kv_cache_until_the_next_sync(qwen2):
    """On CPU ``sleep()`` gives the pages of the in-place packed GEMM weights and of the KV cache back
    (they read as zeros), the engine refuses to generate until a sync, a sync that leaves a released
    layer unwritten is refused, and a whole sync restores it exactly: the same samples and bitwise the
    same logprobs as an engine that never slept. Where the GEMMs run on vLLM's own packed copies
    (no in-place packing), nothing is released and the engine stays usable."""
    from fastrlhf.cpu import vllm_inplace_sync

    first, second, engine, in_place = qwen2
    sync_weights(second, engine)
    awake = _samples(engine.generate(PROMPTS, SAMPLED))
    greedy = _tokens(engine.generate(PROMPTS, GREEDY))
    assert engine.sync_at_start and not engine.needs_sync
    engine.sleep()
    if not in_place:
        assert not engine.needs_sync
        assert _samples(engine.generate(PROMPTS, SAMPLED)) == awake
        sync_weights(first, engine)  # as the other tests expect
        return
    assert engine.needs_sync
    ((layers, nbytes, zeros),) = engine.llm.collective_rpc(_released_state)
    assert layers == 4 * second.config.num_hidden_layers + 1  # q|k|v, o, gate|up, down per layer; lm_head
    assert nbytes >= 32 << 20 and zeros  # the 32 MiB KV cache and the weights' whole pages read 0 now
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, GREEDY)
    # A partial update (only the norms) leaves released layers at zero: refused, still asleep.
    norms = [(n, p.detach()) for n, p in second.named_parameters() if n.endswith("norm.weight")]
    with pytest.raises(RuntimeError, match="every weight"):
        engine.update_weights(iter(norms))
    assert engine.needs_sync and vllm_inplace_sync.weights_released(engine.llm)
    sync_weights(second, engine)
    assert not engine.needs_sync and not vllm_inplace_sync.weights_released(engine.llm)
    _assert_engine_computes_with(engine, second, in_place)
    assert _samples(engine.generate(PROMPTS, SAMPLED)) == awake
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == greedy
    sync_weights(first, engine)  # as the other tests expect
