"""Rollout throughput (VLLMEngine vs HFEngine) across model sizes, and weight-sync cost.

Workload: 64 prompts of 16 tokens x n=4 x 64 new tokens (16,384 generated tokens per round),
fp32, temperature 1, eos ignored so every round generates the same number of tokens.
Targets on the 2-core CPU dev machine: vLLM >= 2x HF tokens/s at ~20M parameters; a weight sync
into vLLM <= 3x a plain ``copy_`` of the same state dict, and the synced engine's tokens/s (what
the trainer generates with). Reported as ``target_met``; a miss fails
only with ``FASTRLHF_BENCH_STRICT=1``, as in the end-to-end benchmarks (a loaded shared machine
moves these ratios). The per-size ratios also give the crossover behind
``fastrlhf.rollout.CPU_VLLM_CROSSOVER_PARAMS``, which is always checked against this run.
The sync is also timed per architecture, side by side: an ~80M Llama and an ~41M Qwen2-shaped model
(q/k/v biases, tied embeddings, GQA, Qwen2's 151,936-row vocabulary), with the Qwen2/Llama ratio.
"""

import gc
import os
import time

import pytest
import torch

from fastrlhf.modeling.tiny import count_parameters, save_tiny_llama, save_tiny_qwen2
from fastrlhf.rollout import CPU_VLLM_CROSSOVER_PARAMS, HFEngine, SamplingConfig, sync_weights

NUM_PROMPTS, PROMPT_LEN, N, NEW_TOKENS = 64, 16, 4, 64
SAMPLING = SamplingConfig(n=N, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=0, ignore_eos=True)
ROUNDS = 2
# The small sizes' rounds take about a second, and one slow round moved the 1M ratio from 1.0 to 1.4
# in a 2-round run; their medians need more rounds to hold still for the crossover check.
ROUNDS_BY_SIZE = {"0.2M": 5, "1M": 5, "4M": 3}

# name -> tiny_llama_config kwargs (head size >= 32 for the vLLM CPU backend)
SIZES = {
    "0.2M": dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=2),
    "1M": dict(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4),
    "4M": dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8),
    "20M": dict(vocab_size=4096, hidden_size=512, num_layers=6, num_heads=8),
}
TARGET_SIZE = "20M"
MIN_VLLM_SPEEDUP = 2.0
MAX_SYNC_OVER_COPY = 3.0
SYNC_ROUNDS = 9
# Weight sync per architecture: name -> (family, config kwargs). The Llama is untied, MHA, no biases;
# the Qwen2 has q/k/v biases, tied embeddings, 2 key/value heads for 4 query heads and the real
# Qwen2 vocabulary, so most of its parameters are the tied embedding / lm_head. Head size 64 both.
SYNC_ARCHITECTURES = {
    "llama-80M": ("llama", dict(vocab_size=32000, hidden_size=640, num_layers=8, num_heads=10, intermediate_size=1728)),
    "qwen2-41M": (
        "qwen2",
        dict(vocab_size=151936, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    ),
}
PARITY_BAND = 0.1  # vLLM/HF ratios within 10% of 1.0 are ties for the crossover check
STRICT = os.environ.get("FASTRLHF_BENCH_STRICT") == "1"

_tokens_per_s: dict[tuple[str, str], float] = {}
_sync_seconds: dict[str, float] = {}
_state: dict = {}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_rollout")
    dirs, models = {}, {}
    for name, kw in SIZES.items():
        dirs[name] = root / name
        models[name] = save_tiny_llama(dirs[name], seed=0, max_position_embeddings=256, **kw)
    return dirs, models


def _prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (NUM_PROMPTS, PROMPT_LEN), generator=g).tolist()


def _vllm_engine(dirs, size, dtype="float32"):
    """One vLLM engine at a time in this process: the previous (size, dtype)'s is closed first."""
    current = _state.get("engine")
    if current is not None and _state.get("engine_key") == (size, dtype):
        return current
    if current is not None:
        current.close()
        _state["engine"] = None
        gc.collect()
    os.environ.pop("TRITON_INTERPRET", None)
    from fastrlhf.rollout import VLLMEngine

    engine = VLLMEngine(str(dirs[size]), dtype=dtype, max_model_len=256, kv_cache_bytes=512 << 20)
    _state.update(engine=engine, engine_key=(size, dtype))
    return engine


def _generated(results):
    return sum(len(c.token_ids) for samples in results for c in samples)


CASES = [(size, "hf") for size in SIZES] + [(size, "vllm") for size in SIZES]


@pytest.mark.parametrize("size,engine_kind", CASES, ids=[f"{s}-{e}" for s, e in CASES])
def test_generate_tokens_per_second(benchmark, model_dirs, size, engine_kind):
    dirs, models = model_dirs
    if engine_kind == "vllm":
        pytest.importorskip("vllm")
        engine = _vllm_engine(dirs, size)
    else:
        torch.set_num_threads(os.cpu_count() or 1)
        engine = HFEngine(models[size])
    prompts = _prompts(SIZES[size]["vocab_size"])
    engine.generate(prompts[:4], SAMPLING)  # warm-up
    rounds = ROUNDS_BY_SIZE.get(size, ROUNDS)
    results = benchmark.pedantic(engine.generate, args=(prompts, SAMPLING), rounds=rounds, iterations=1)
    tokens = _generated(results)
    assert tokens == NUM_PROMPTS * N * NEW_TOKENS
    tps = tokens / benchmark.stats.stats.median
    _tokens_per_s[(size, engine_kind)] = tps
    benchmark.extra_info.update(
        engine=engine_kind,
        size=size,
        num_params=count_parameters(models[size]),
        tokens_per_round=tokens,
        tokens_per_s=round(tps, 1),
    )
    if engine_kind == "vllm" and (size, "hf") in _tokens_per_s:
        ratio = tps / _tokens_per_s[(size, "hf")]
        benchmark.extra_info["hf_tokens_per_s"] = round(_tokens_per_s[(size, "hf")], 1)
        benchmark.extra_info["vllm_over_hf"] = round(ratio, 3)
        if size == TARGET_SIZE:
            benchmark.extra_info.update(target=f">= {MIN_VLLM_SPEEDUP}x", target_met=bool(ratio >= MIN_VLLM_SPEEDUP))
            if STRICT:
                assert ratio >= MIN_VLLM_SPEEDUP, f"vLLM is {ratio:.2f}x HF at {size}, target >= {MIN_VLLM_SPEEDUP}x"


def test_crossover_matches_the_engine_choice_constant(benchmark, model_dirs):
    """The constant must sit above every size where HF clearly wins and at or below every size where
    vLLM clearly wins; a size within ``PARITY_BAND`` of 1.0 is a tie (either engine is right there:
    at 0.92M runs have measured 0.96 and 1.01)."""
    _, models = model_dirs
    measured = [s for s in SIZES if (s, "hf") in _tokens_per_s and (s, "vllm") in _tokens_per_s]
    if len(measured) != len(SIZES):
        pytest.skip("needs every test_generate_tokens_per_second case of this run")
    ratios = {s: _tokens_per_s[(s, "vllm")] / _tokens_per_s[(s, "hf")] for s in SIZES}
    params = {s: count_parameters(models[s]) for s in SIZES}
    faster = [s for s in SIZES if ratios[s] > 1.0]
    benchmark.extra_info.update({f"vllm_over_hf_{s}": round(r, 3) for s, r in ratios.items()})
    benchmark.extra_info.update({f"params_{s}": params[s] for s in SIZES})
    benchmark.extra_info["crossover_constant"] = CPU_VLLM_CROSSOVER_PARAMS
    benchmark.pedantic(lambda: None, rounds=1)
    assert faster, f"vLLM never beat HF: {ratios}"
    benchmark.extra_info["first_size_vllm_wins"] = faster[0]
    hf_wins = [params[s] for s in SIZES if ratios[s] <= 1.0 - PARITY_BAND]
    vllm_wins = [params[s] for s in SIZES if ratios[s] >= 1.0 + PARITY_BAND]
    assert vllm_wins, f"vLLM never clearly beat HF: {ratios}"
    assert max(hf_wins, default=0) < CPU_VLLM_CROSSOVER_PARAMS <= min(vllm_wins), (
        f"CPU_VLLM_CROSSOVER_PARAMS={CPU_VLLM_CROSSOVER_PARAMS} disagrees with this run: ratios {ratios}, "
        f"params {params}"
    )


def test_weight_sync_vs_plain_copy(benchmark, model_dirs):
    pytest.importorskip("vllm")
    dirs, models = model_dirs
    _measure_sync(benchmark, _vllm_engine(dirs, TARGET_SIZE), models[TARGET_SIZE])


def _measure_sync(benchmark, engine, source, size: str = TARGET_SIZE) -> float:
    """Median sync of ``source`` into ``engine`` against a plain copy_ of the same state dict; returns
    the median sync seconds."""
    src = {k: v.detach() for k, v in source.state_dict().items()}
    dst = {k: v.clone() for k, v in src.items()}

    def plain_copy():
        for k, v in src.items():
            dst[k].copy_(v)

    copy_times = []

    def timed_plain_copy():
        # Interleaved with the sync rounds (pedantic's setup runs before each), so both see the
        # same machine load: on the shared 2-core box a burst of load can slow either by 10-100x.
        t0 = time.perf_counter()
        plain_copy()
        copy_times.append(time.perf_counter() - t0)
        return (source, engine), {}

    plain_copy()
    sync_weights(source, engine)  # warm-up
    stats = benchmark.pedantic(sync_weights, setup=timed_plain_copy, rounds=SYNC_ROUNDS, iterations=1)
    copy_s = sorted(copy_times)[len(copy_times) // 2]
    sync_s = benchmark.stats.stats.median
    ratio = sync_s / copy_s
    benchmark.extra_info.update(
        size=size,
        dtype=str(next(source.parameters()).dtype).removeprefix("torch."),
        bytes_per_sync=stats.bytes,
        num_buckets=stats.num_buckets,
        sync_ms=round(sync_s * 1e3, 2),
        plain_copy_ms=round(copy_s * 1e3, 2),
        sync_over_copy=round(ratio, 3),
        target=f"<= {MAX_SYNC_OVER_COPY}x",
        target_met=bool(ratio <= MAX_SYNC_OVER_COPY),
        packed_in_place=_packed_in_place(engine),
        cpu_probe=_cpu_probe_summary(),
    )
    if STRICT:
        assert ratio <= MAX_SYNC_OVER_COPY, f"sync takes {ratio:.2f}x a plain copy_ (target <= {MAX_SYNC_OVER_COPY}x)"
    return sync_s


def _packed_in_place(engine) -> bool:
    """Whether the engine's GEMMs now run on weights the sync wrote in place (see
    fastrlhf/cpu/vllm_inplace_sync.py) rather than on vLLM's repacked ones."""
    from fastrlhf.cpu import vllm_inplace_sync

    return vllm_inplace_sync.gemm_weight_kinds(engine.llm) == {"in_place"}


def _cpu_probe_summary() -> str:
    """What this CPU allows the in-place sync (fastrlhf/cpu/probe.py): the figures mean that path."""
    from fastrlhf.cpu.probe import cpu_probe

    return cpu_probe().summary()


def _update_path(engine) -> str:
    """Which update the engine's syncs take: "in_place:<family>" (vllm_inplace_sync) or "generic"
    (vLLM's reload_weights)."""
    from fastrlhf.cpu import vllm_inplace_sync

    family = vllm_inplace_sync.in_place_layout(engine.llm)
    return f"in_place:{family}" if family else "generic"


def test_generate_after_weight_sync(benchmark, model_dirs):
    """Tokens/s of the engine the trainer generates with: synced at least once, so its GEMMs run on
    the packed weights the sync writes in place. Same workload as test_generate_tokens_per_second;
    compared with the fresh engine there (vLLM's own packed weights) and with HF."""
    pytest.importorskip("vllm")
    dirs, models = model_dirs
    engine = _vllm_engine(dirs, TARGET_SIZE)
    sync_weights(models[TARGET_SIZE], engine)
    prompts = _prompts(SIZES[TARGET_SIZE]["vocab_size"])
    engine.generate(prompts[:4], SAMPLING)  # warm-up
    results = benchmark.pedantic(engine.generate, args=(prompts, SAMPLING), rounds=ROUNDS, iterations=1)
    tokens = _generated(results)
    assert tokens == NUM_PROMPTS * N * NEW_TOKENS
    tps = tokens / benchmark.stats.stats.median
    benchmark.extra_info.update(
        engine="vllm", size=TARGET_SIZE, tokens_per_s=round(tps, 1), packed_in_place=_packed_in_place(engine)
    )
    engine.close()
    _state.clear()
    if (TARGET_SIZE, "vllm") in _tokens_per_s:
        benchmark.extra_info["over_fresh_engine"] = round(tps / _tokens_per_s[(TARGET_SIZE, "vllm")], 3)
    if (TARGET_SIZE, "hf") in _tokens_per_s:
        ratio = tps / _tokens_per_s[(TARGET_SIZE, "hf")]
        benchmark.extra_info.update(
            vllm_over_hf=round(ratio, 3), target=f">= {MIN_VLLM_SPEEDUP}x", target_met=bool(ratio >= MIN_VLLM_SPEEDUP)
        )
        if STRICT:
            assert ratio >= MIN_VLLM_SPEEDUP, f"vLLM after a sync is {ratio:.2f}x HF, target >= {MIN_VLLM_SPEEDUP}x"


def test_weight_sync_vs_plain_copy_bf16(benchmark, model_dirs):
    """The same sync into a bf16 engine (oneDNN packs bf16 weights as K-adjacent pairs), against a
    copy_ of the bf16 state dict. The issue's target is the fp32 one; this row says the bf16 path
    holds it too."""
    pytest.importorskip("vllm")
    import copy

    dirs, models = model_dirs
    engine = _vllm_engine(dirs, TARGET_SIZE, "bfloat16")
    try:
        _measure_sync(benchmark, engine, copy.deepcopy(models[TARGET_SIZE]).bfloat16())
    finally:
        engine.close()
        _state.clear()


@pytest.fixture(scope="module")
def architecture_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_sync_architectures")
    save = {"llama": save_tiny_llama, "qwen2": save_tiny_qwen2}
    dirs, models = {}, {}
    for name, (family, kw) in SYNC_ARCHITECTURES.items():
        dirs[name] = root / name
        models[name] = save[family](dirs[name], seed=0, max_position_embeddings=256, **kw)
    return dirs, models


@pytest.mark.parametrize("arch", list(SYNC_ARCHITECTURES))
def test_weight_sync_per_architecture(benchmark, architecture_dirs, arch):
    """Seconds per step of the trainer -> vLLM sync (one ``sync_weights`` of the whole fp32 model, as
    after every update of an RL run) for a Llama and a Qwen2-shaped model; the Qwen2 row also gives
    its time over the Llama's (``over_llama``), with its bytes over the Llama's for scale."""
    pytest.importorskip("vllm")
    dirs, models = architecture_dirs
    model, config = models[arch], models[arch].config
    engine = _vllm_engine(dirs, arch)
    try:
        sync_s = _measure_sync(benchmark, engine, model, size=arch)
        benchmark.extra_info["update_path"] = _update_path(engine)
    finally:
        engine.close()
        _state.clear()
    _sync_seconds[arch] = sync_s
    benchmark.extra_info.update(
        architecture=type(model).__name__,
        num_params=count_parameters(model),
        vocab_size=config.vocab_size,
        tied=bool(config.tie_word_embeddings),
        qkv_bias=any(n.endswith("q_proj.bias") for n, _ in model.named_parameters()),
        heads=f"{config.num_attention_heads}/{config.num_key_value_heads}",
        sync_s_per_step=round(sync_s, 4),
    )
    llama, qwen2 = SYNC_ARCHITECTURES
    if arch == qwen2 and llama in _sync_seconds:
        llama_bytes = count_parameters(models[llama]) * 4
        benchmark.extra_info.update(
            llama_sync_s_per_step=round(_sync_seconds[llama], 4),
            over_llama=round(sync_s / _sync_seconds[llama], 3),
            bytes_over_llama=round(benchmark.extra_info["bytes_per_sync"] / llama_bytes, 3),
        )
