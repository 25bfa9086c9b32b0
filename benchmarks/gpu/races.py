"""The races of ``make bench-gpu`` as plain functions, so that ``test_races_cpu.py`` can run every line of
them at tiny shapes on a CPU. ``test_bench_gpu.py`` runs them at full size, each in a fresh child process
(``python -m benchmarks.gpu.races NAME JSON``, see :func:`run_child`): the peak-memory figures then start
from an empty device, and nothing a race leaves behind (an NCCL group, a DeepSpeed engine, the caching
allocator's blocks) reaches the next one.

1. :func:`lm_head_race`: the LM head and GRPO loss of a 7B model (Qwen2.5-7B's H and V) on 16,384 tokens,
   forward + backward: fastrlhf's fused kernel, the same math on materialised logits, Liger-Kernel's
   ``LigerFusedLinearGRPOLoss`` and the three bare GEMMs every exact method runs (the floor).
2. :func:`rl_update_race`: ``RLStep.update`` of the 1.5B Qwen2 on DeepSpeed ZeRO-2 with gradient checkpointing,
   in trained tokens/s and MFU against a bf16 GEMM rate measured in the same process.
3. :func:`grpo_vs_trl`: whole GRPO steps (HF generate, reference, update) of ``fastrlhf train`` against TRL's
   ``GRPOTrainer``, each trainer in its own process on the same model folder, prompts and batch.
4. :func:`layouts_race`: the reference pass and update in the padded, packed and shared-prompt layouts
   (``benchmarks/gpu/layouts.py``).
5. :func:`grpo_engines`: whole GRPO steps of ``fastrlhf train`` with vLLM in the trainer's process against the
   same steps with HF ``generate``, and against TRL's ``GRPOTrainer`` with its colocated vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT_PREFIX = "GPU_RACE "
MIB, GIB = float(1 << 20), float(1 << 30)

# Qwen2.5-7B's hidden size and padded vocabulary; 16 sequences of 1024 tokens.
LM_HEAD_7B = dict(batch=16, seq_len=1024, hidden=3584, vocab=152_064)
# GRPO's loss as the trainer runs it: PPO clip 0.2 both ways, k3 KL to the reference in the loss, token mean.
LOSS = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_kind="k3")
AGG = "token-mean"
# The CPU smoke shape: the GPU proof's tiny Qwen2 (tests/helpers/proof.py), GQA, biases, tied embeddings.
TINY_QWEN2 = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                  max_position_embeddings=1024, tie_word_embeddings=True)


class Unavailable(Exception):
    """A contender that cannot run here (a package missing); its reason goes into the results."""


def model_shape(name: str) -> dict:
    from fastrlhf.modeling.tiny import QWEN2_1_5B

    return dict(QWEN2_1_5B) if name == "qwen2-1.5b" else dict(TINY_QWEN2)


# ------------------------------------------------------------------------------------------------ timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(step, device: torch.device, warmup: int = 1, repeats: int = 5) -> tuple[dict, object]:
    """Median time of ``repeats`` calls of ``step`` after ``warmup`` ones (CUDA events on a GPU), and on CUDA
    the peak memory the calls allocated above what was allocated before them, warm-up included (what a
    first call allocates and later calls reuse must count). Returns the figures and the last call's value."""
    cuda = device.type == "cuda"
    free_device_memory(device)
    sync(device)
    if cuda:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        last = step()
    times = []
    for _ in range(repeats):
        ms, last = _timed_ms(step, cuda)
        times.append(ms)
    peak = (torch.cuda.max_memory_allocated(device) - base) / MIB if cuda else None
    return {"time_ms": statistics.median(times), "times_ms": [round(t, 3) for t in times], "peak_mib": peak}, last


def measure_paired(steps: dict, device: torch.device, rounds: int = 5) -> dict[str, list[float]]:
    """Each of ``steps`` (name: callable) timed once per round, the rounds one after another, the order reversed
    every other round, so that two contenders' times of one round share the device's clock and temperature: a
    ratio of one round's times is not moved by the clock drifting between two blocks of repeats (the 7B head's
    repeats spread over 79-90 ms on an H100). Each step runs once untimed first (the allocator's blocks, any
    compilation). Returns each step's times in ms, round by round."""
    cuda = device.type == "cuda"
    names, times = list(steps), {name: [] for name in steps}
    for name in names:
        steps[name]()
    sync(device)
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            times[name].append(_timed_ms(steps[name], cuda)[0])
    return times


def _timed_ms(step, cuda: bool) -> tuple[float, object]:
    """One call of ``step``: its milliseconds (between CUDA events on a GPU, the wall clock elsewhere) and value."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        value = step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), value
    t0 = time.perf_counter()
    value = step()
    return (time.perf_counter() - t0) * 1e3, value


def gemm_tflops(device: torch.device, size: int = 8192, dtype: torch.dtype = torch.bfloat16, repeats: int = 10
                ) -> float:
    """The dense GEMM rate of this device (median of ``repeats`` ``size``-cubed matmuls), the MFU denominator."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(size, size, device=device, dtype=dtype)
    stats, _ = measure(lambda: torch.mm(a, b, out=c), device, warmup=3, repeats=repeats)
    return 2 * size**3 / (stats["time_ms"] / 1e3) / 1e12


def profile_kernels(step, device: torch.device, top: int = 10) -> dict:
    """One warm call of ``step`` under torch.profiler, its time summed by kernel name
    (:func:`fastrlhf.engine.step_profile.summarize_kernels`)."""
    from torch.profiler import ProfilerActivity, profile

    from fastrlhf.engine.step_profile import summarize_kernels

    cuda = device.type == "cuda"
    step()  # warm: compiled kernels, allocator blocks
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        sync(device)
    return summarize_kernels(prof, cuda, top)


def _accepted(fn, kwargs: dict) -> tuple[dict, list[str]]:
    """``kwargs`` that ``fn`` takes, and the names it does not (a newer or older signature)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs), []
    return {k: v for k, v in kwargs.items() if k in params}, sorted(k for k in kwargs if k not in params)


# ------------------------------------------------------------------------------------------------ race 1
def lm_head_inputs(device, dtype, batch, seq_len, hidden, vocab, seed=0) -> dict:
    """GRPO-like inputs: completions of T/2..T tokens (the rest masked), one advantage per sequence, and old
    and reference logprobs near the policy's own (ratios near 1, as in an update), so that no clamp decides."""
    torch.manual_seed(seed)
    h = torch.randn(batch, seq_len, hidden, device=device, dtype=dtype)
    w = torch.randn(vocab, hidden, device=device, dtype=dtype) * hidden**-0.5  # logits of unit scale
    labels = torch.randint(0, vocab, (batch, seq_len), device=device)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch, 1), device=device)
    mask = (torch.arange(seq_len, device=device) < lengths).float()
    with torch.no_grad():  # row by row: never the [N, V] logits
        lp = torch.stack([(h[i] @ w.t()).float().log_softmax(-1).gather(-1, labels[i, :, None])[:, 0]
                          for i in range(batch)])
    adv = torch.randn(batch, device=device)
    return dict(hidden=h.requires_grad_(), weight=w.requires_grad_(), labels=labels, mask=mask, adv_seq=adv,
                adv_tok=adv[:, None].expand(batch, seq_len).contiguous(),
                old=lp + 0.05 * torch.randn_like(lp), ref=lp + 0.05 * torch.randn_like(lp))


def _clear_grads(x: dict) -> None:
    x["hidden"].grad = x["weight"].grad = None


def _fused_step(x: dict, device, chunks: int | None = None, fp32_logits: bool = False, **paths: bool):
    """fastrlhf's fused step; ``paths`` turns its faster paths off (``fused_linear_chunks.fused_linear_paths``);
    ``chunks``: that many equal chunks instead of the budget's; ``fp32_logits``: ``model.fp32_logits``'s cost."""
    from fastrlhf.kernels import fused_linear_policy_loss
    from fastrlhf.kernels.fused_linear_chunks import fused_linear_paths

    tokens = x["labels"].numel()
    chunk_size = None
    if chunks is not None:  # even chunks rounded up to 64 rows, as the budget's are (components.balanced_chunk_rows)
        even = -(-tokens // chunks)
        chunk_size = min(tokens, -(-even // 64) * 64)

    def step():
        with fused_linear_paths(**paths):
            loss, _ = fused_linear_policy_loss(x["hidden"], x["weight"], x["labels"], x["old"], x["adv_tok"],
                                               x["mask"], ref_logprobs=x["ref"], agg=AGG, chunk_size=chunk_size,
                                               fp32_logits=fp32_logits, **LOSS)
        loss.backward()
        _clear_grads(x)
        return loss.detach()

    return step


# Issue #43's steps, each timed before and after in the same call: "fused_torch_cast" scales and casts the fp32
# grad_weight sum with torch's mul instead of the Triton cast kernel; "fused_no_rows" runs a chunk's softmax
# passes as three launches (stats, token loss, gradient) instead of the one-pass row kernel; "fused_before"
# also sums grad_weight through a bf16 scratch (with the shorter chunks that memory allows) instead of in the
# GEMM: the kernel as it was before all three.
BEFORE_PATHS = {"fused_torch_cast": dict(cast_kernel=False),
                "fused_no_rows": dict(one_pass_rows=False),
                "fused_before": dict(one_pass_rows=False, gemm_fp32_sum=False, cast_kernel=False)}


def naive_loss(x: dict):
    """What a user writes (and ``benchmarks/test_bench_kernels.py``'s naive): bf16 logits, one fp32 log-softmax
    for the logprobs and the entropy, then ``fastrlhf.algorithms``' formulas. Returns (loss, detached
    metrics): the entropy's graph dies here, before backward."""
    from fastrlhf.algorithms import actor_loss_per_token, aggregate_loss, masked_mean

    logp = torch.log_softmax((x["hidden"] @ x["weight"].t()).float(), dim=-1)
    lp = logp.gather(-1, x["labels"].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    loss_mat, clipped, kl = actor_loss_per_token(lp, ent, x["old"], x["adv_tok"], x["mask"], x["ref"], **LOSS)
    metrics = {"entropy": masked_mean(ent, x["mask"]), "clipfrac": masked_mean(clipped.float(), x["mask"]),
               "kl": masked_mean(kl, x["mask"])}
    return aggregate_loss(loss_mat, x["mask"], AGG), {k: v.detach() for k, v in metrics.items()}


def _naive_step(x: dict, device):
    def step():
        loss, _ = naive_loss(x)
        loss.backward()
        _clear_grads(x)
        return loss.detach()

    return step


def _liger_step(x: dict, device):
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as exc:
        raise Unavailable(f"liger-kernel is not installed ({exc})") from None
    # loss_type "dapo": the sum over the batch's kept tokens over their count, i.e. token-mean on one rank.
    # torch.compile of its loss math on CUDA, as Liger and TRL default to; the warm-up call pays for it.
    init, dropped = _accepted(LigerFusedLinearGRPOLoss.__init__, dict(
        beta=LOSS["kl_coef"], epsilon_low=LOSS["clip_low"], epsilon_high=LOSS["clip_high"], loss_type="dapo",
        use_ref_model=True, compiled=device.type == "cuda"))
    call, dropped_call = _accepted(LigerFusedLinearGRPOLoss.forward, dict(ref_per_token_logps=x["ref"],
                                                                          old_per_token_logps=x["old"]))
    if set(dropped + dropped_call) - {"compiled"}:  # another signature: it would not be the same loss
        raise Unavailable(f"LigerFusedLinearGRPOLoss takes no {', '.join(dropped + dropped_call)}")
    loss_fn = LigerFusedLinearGRPOLoss(**init)

    def step():
        # [B, T, H] hidden, [B] advantages (one per sequence): Liger's layout; it chunks by sequence.
        out = loss_fn(x["hidden"], x["weight"], x["labels"], x["mask"], x["adv_seq"], **call)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        _clear_grads(x)
        return loss.detach()

    return step


def _gemms_step(x: dict, device):
    h = x["hidden"].detach().reshape(-1, x["hidden"].shape[-1])
    w = x["weight"].detach()
    dh, dw = torch.empty_like(h), torch.empty_like(w)

    def step():
        # logits = h W^T, then dlogits (here the logits' own buffer, as the fused kernel reuses it) back
        # through both operands: dH = dlogits W, dW = dlogits^T h.
        logits = h @ w.t()
        torch.mm(logits, w, out=dh)
        torch.mm(logits.t(), h, out=dw)

    return step


# Fewer, longer chunks than the budget's five at the 7B head (issue #43's "two chunks of 8,192"): each chunk's
# grad_weight GEMM that adds into the fp32 sum took 0.6 ms more than the one that writes it (H100, 2026-11-28), at
# a larger logits buffer; timed beside the default so that the budget is chosen from a measurement.
CHUNK_VARIANTS = {"fused_3_chunks": 3, "fused_2_chunks": 2}
# The row kernel with one or two programs per SM, each looping over rows, instead of one per row (about eight rows
# per SM at once: 321 MB at the 7B head, far more than an H100's 50 MB L2): 40 MB of rows in flight with one, so a
# row's second read finds it in L2, 80 MB with two, and twice the loads to hide the memory's latency.
ROW_GRID_VARIANTS = {"fused_rows_1_per_sm": dict(row_programs_per_sm=1),
                     "fused_rows_2_per_sm": dict(row_programs_per_sm=2)}
LM_HEAD_CONTENDERS = {"fused": _fused_step, "naive": _naive_step, "liger": _liger_step, "gemms": _gemms_step,
                      **{name: functools.partial(_fused_step, **paths)
                         for name, paths in {**BEFORE_PATHS, **ROW_GRID_VARIANTS}.items()},
                      **{name: functools.partial(_fused_step, chunks=n) for name, n in CHUNK_VARIANTS.items()},
                      "fused_fp32_logits": functools.partial(_fused_step, fp32_logits=True)}
LM_HEAD_TARGETS = dict(fused_over_gemms_max=1.10, fused_over_naive_peak_max=0.2, liger_over_fused_min=5.0)


def lm_head_race(device: str = "cuda", dtype: str = "bfloat16", batch: int = 16, seq_len: int = 1024,
                 hidden: int = 3584, vocab: int = 152_064, warmup: int = 1, repeats: int = 5,
                 contenders=tuple(LM_HEAD_CONTENDERS), seed: int = 0, profile: bool = True) -> dict:
    """Time (median ms) and peak memory above the inputs (MiB) of each contender's forward + backward; with
    ``profile``, the fused step's time by kernel (:func:`profile_kernels`, after the timed runs)."""
    device = torch.device(device)
    x = lm_head_inputs(device, getattr(torch, dtype), batch, seq_len, hidden, vocab, seed)
    out = dict(tokens=batch * seq_len, hidden=hidden, vocab=vocab, dtype=dtype, warmup=warmup, repeats=repeats,
               masked_fraction=round(1 - float(x["mask"].mean()), 4),
               tf32=torch.backends.cuda.matmul.allow_tf32, **LOSS, agg=AGG)
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        out["liger_version"] = version("liger-kernel")
    for name in contenders:
        try:
            stats, loss = measure(LM_HEAD_CONTENDERS[name](x, device), device, warmup, repeats)
        except Unavailable as exc:
            out[f"{name}_skipped"] = str(exc)
            continue
        except torch.OutOfMemoryError:
            out[f"{name}_error"], stats = "out of memory", None
        _clear_grads(x)
        free_device_memory(device)  # out of the except block: its traceback held the failed call's tensors
        if stats is None:
            continue
        out[f"{name}_time_ms"] = round(stats["time_ms"], 3)
        out[f"{name}_times_ms"] = stats["times_ms"]
        if stats["peak_mib"] is not None:
            out[f"{name}_peak_mib"] = round(stats["peak_mib"], 1)
        if name != "gemms":
            out[f"{name}_loss"] = float(loss)
    if "fused_time_ms" in out and "gemms_time_ms" in out:  # the target's ratio, round by round on one clock
        try:
            paired = measure_paired({name: LM_HEAD_CONTENDERS[name](x, device) for name in ("gemms", "fused")},
                                    device, rounds=max(repeats, 2))
        except torch.OutOfMemoryError:  # both contenders' buffers at once: the blocks' figures still stand
            out["fused_over_gemms_paired_error"], paired = "out of memory", None
        _clear_grads(x)
        free_device_memory(device)
        if paired is not None:
            ratios = [f / g for f, g in zip(paired["fused"], paired["gemms"], strict=True)]
            out["fused_over_gemms_paired"] = round(statistics.median(ratios), 4)
            out["fused_over_gemms_paired_rounds"] = [round(r, 4) for r in ratios]
    for name in ("fused", "fused_before"):  # the profile's top kernels after and before issue #43's steps
        if profile and name in contenders:
            out.update({f"{name}_{k}": v for k, v in profile_kernels(LM_HEAD_CONTENDERS[name](x, device),
                                                                     device).items()})
            _clear_grads(x)
    if "gemms_time_ms" in out:
        out["gemms_tflops"] = round(3 * 2 * batch * seq_len * hidden * vocab / out["gemms_time_ms"] / 1e9, 1)
    _ratio(out, "fused_over_gemms", "fused_time_ms", "gemms_time_ms")
    _ratio(out, "fused_over_naive_peak", "fused_peak_mib", "naive_peak_mib")
    _ratio(out, "liger_over_fused", "liger_time_ms", "fused_time_ms")
    _ratio(out, "before_over_fused", "fused_before_time_ms", "fused_time_ms")
    _ratio(out, "torch_cast_over_fused", "fused_torch_cast_time_ms", "fused_time_ms")  # the cast kernel's gain
    # Above 1: the variant (fewer chunks, or the row kernel looping on one or two programs per SM) is faster;
    # their peaks are in *_peak_mib.
    for name in (*CHUNK_VARIANTS, *ROW_GRID_VARIANTS):
        _ratio(out, f"fused_over_{name.removeprefix('fused_')}", "fused_time_ms", f"{name}_time_ms")
    _ratio(out, "no_rows_over_fused", "fused_no_rows_time_ms", "fused_time_ms")  # the row kernel's gain
    _ratio(out, "before_over_no_rows", "fused_before_time_ms", "fused_no_rows_time_ms")  # the GEMM's fp32 sum's
    _ratio(out, "fp32_logits_over_fused", "fused_fp32_logits_time_ms", "fused_time_ms")  # model.fp32_logits' cost
    fused = out.get("fused_loss")
    for name in ("naive", "liger", *BEFORE_PATHS, *CHUNK_VARIANTS, *ROW_GRID_VARIANTS, "fused_fp32_logits"):
        if fused is not None and f"{name}_loss" in out:
            out[f"{name}_loss_rel_diff"] = abs(out[f"{name}_loss"] - fused) / max(abs(fused), 1e-12)
    out.update(LM_HEAD_TARGETS)
    out["targets_met"] = lm_head_targets_met(out)
    return out


def lm_head_targets_met(out: dict) -> bool:
    """Issue #43's three targets on a race's figures. The time against the bare GEMMs is judged on the paired rounds
    where they ran: the block medians' ratio also holds the clock's drift between the two blocks, run seconds
    apart with other contenders (Liger's 1 s calls among them) between them."""
    t = LM_HEAD_TARGETS
    over_gemms = out.get("fused_over_gemms_paired", out.get("fused_over_gemms", 1e9))
    return bool(over_gemms <= t["fused_over_gemms_max"]
                and out.get("fused_over_naive_peak", 1e9) <= t["fused_over_naive_peak_max"]
                and out.get("liger_over_fused", 0) >= t["liger_over_fused_min"])


def _ratio(out: dict, key: str, num: str, den: str) -> None:
    if out.get(num) is not None and out.get(den):
        out[key] = round(out[num] / out[den], 4)


# ------------------------------------------------------------------------------------------------ race 2
def actor_engine(dev, torch_dtype, model: dict, seed: int, lr: float, micro_batch: int, grad_accum: int,
                 gradient_checkpointing: bool = True, liger_kernels: bool = False, checkpoint_layers=None,
                 compiled: bool = False):
    """``(engine, reference, guard)`` as ``fastrlhf train`` builds them for GRPO: the actor from random init in a
    ZeRO-2 engine (bf16 with fp32 master weights on a GPU), gradient checkpointing (unless told otherwise; of the
    first ``checkpoint_layers`` layers where given), its frozen reference; with ``liger_kernels``, both with
    Liger-Kernel's layers (``model.liger_kernels``); with ``compiled``, both with each decoder layer torch.compiled
    (``model.compile``)."""
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.deepspeed import build_train_engine
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.modeling.loading import apply_liger_layers, checkpoint_first_layers
    from fastrlhf.modeling.tiny import make_qwen2_on

    actor = make_qwen2_on(dev, torch_dtype, seed=seed, **model).train()
    reference = make_qwen2_on(dev, torch_dtype, seed=seed, **model).requires_grad_(False)
    if liger_kernels:
        apply_liger_layers(actor)
        apply_liger_layers(reference)
    if compiled:
        from fastrlhf.modeling.compile import compile_layers

        compile_layers(actor)
        compile_layers(reference)
    if gradient_checkpointing:
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as modeling.py
        if checkpoint_layers is not None:
            checkpoint_first_layers(actor, checkpoint_layers)
    actor.config.use_cache = False
    guard = StepGuard()
    engine = build_train_engine(actor, DeepSpeedConfig(zero_stage=2, bf16=torch_dtype == torch.bfloat16), lr=lr,
                                micro_batch_size=micro_batch, grad_accum=grad_accum, max_grad_norm=1.0, guard=guard)
    return engine, reference, guard


def rl_update_race(device: str = "cuda", shape: str = "qwen2-1.5b", dtype: str = "bfloat16", prompts: int = 8,
                   n: int = 8, prompt_len: int = 128, new_tokens: int = 256, grad_accum: int = 2, updates: int = 4,
                   gemm_size: int = 8192, seed: int = 0, gradient_checkpointing: bool = True,
                   liger_kernels: bool = False, profile: bool = True, checkpoint_layers: int | None = None,
                   compiled: bool = False, auto: bool = False) -> dict:
    """One GRPO step's update (``RLStep.update``: every micro-batch's forward + backward and the optimizer
    step) as the trainer builds it (tests/gpu/test_update_syncs.py): ZeRO-2, bf16 with fp32 master weights,
    gradient checkpointing, a reference model (KL in the loss), the HF engine sharing the actor (which
    generates nothing here). Full-length completions of random tokens, then ``updates`` steps on them, each
    timed around ``update`` only; the first is the warm-up (Triton compiles, DeepSpeed's buffers).

    MFU = 6 x params x trained tokens / update time / the measured GEMM rate, trained tokens being every real
    token of the sequences (prompt and completion: all run forward and backward; the LM head only sees the
    completion positions, so 6 x params over-counts its share on prompt tokens; ``mfu_head_on_completions`` counts
    the head there only, and the embedding lookup nowhere). ``mfu_with_recompute``
    counts the forward that gradient checkpointing repeats (8 x params x tokens, or 6 + 2 x the share of layers
    checkpointed with ``checkpoint_layers``; as MFU without it). With ``profile``, one more update's time by
    kernel (:func:`profile_kernels`): what it spends outside the GEMMs.
    ``liger_kernels``: the actor and reference with Liger-Kernel's RMSNorm, SwiGLU and rotary kernels; ``compiled``:
    with each decoder layer torch.compiled (``model.compile``; the warm-up update compiles). ``auto``: gradient
    checkpointing and the micro-batch as the memory plan decides them on this device for
    ``model.gradient_checkpointing: auto`` and ``trainer.max_tokens_per_microbatch: auto`` (:func:`plan_decided`),
    instead of ``gradient_checkpointing``, ``checkpoint_layers`` and ``grad_accum``."""
    from benchmarks.e2e_common import even_fraction_reward
    from fastrlhf import distributed as D
    from fastrlhf.memory.components import checkpointed_layers
    from fastrlhf.modeling.tiny import count_parameters
    from fastrlhf.rl.rewards import RewardScorer
    from fastrlhf.rl.step import RLStep
    from fastrlhf.rollout.hf_engine import HFEngine
    from fastrlhf.rollout.sampling import Completion

    D.init_distributed(timeout_s=120)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    torch_dtype, model = getattr(torch, dtype), model_shape(shape)
    batch = prompts * n
    decided = None
    if auto:
        decided = plan_decided(dev, model, dtype, prompts, n, prompt_len, new_tokens)
        gradient_checkpointing, checkpoint_layers = decided["gradient_checkpointing"], decided["checkpoint_layers"]
        grad_accum = decided["grad_accum"]
    config = update_config(dtype, prompts, n, prompt_len, new_tokens, grad_accum, updates, seed,
                           gradient_checkpointing=gradient_checkpointing, checkpoint_layers=checkpoint_layers,
                           compile=compiled)
    engine, reference, guard = actor_engine(dev, torch_dtype, model, seed, 1e-6, batch // grad_accum, grad_accum,
                                            gradient_checkpointing, liger_kernels, checkpoint_layers, compiled)
    actor, params = engine.module, count_parameters(engine.module)
    timed: list[dict] = []
    step_exp: list = []  # the last update's experience, profiled again at the end

    class TimedStep(RLStep):
        def update(self, exp, step):
            step_exp[:] = [exp]
            sync(self.device)
            t0 = time.perf_counter()
            metrics = super().update(exp, step)
            sync(self.device)
            parts = exp.token_parts()
            timed.append(dict(seconds=time.perf_counter() - t0, tokens=sum(p + c for p, c in parts),
                              completion_tokens=sum(c for _, c in parts)))
            return metrics

    step = TimedStep(config, engine, HFEngine(engine.module), RewardScorer(even_fraction_reward), reference=reference,
                     pad_token_id=actor.config.pad_token_id, rollout_shares_actor=True, device=engine.device,
                     guard=guard)
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, model["vocab_size"], (prompts, prompt_len), generator=g).tolist()
    # Full-length completions of random tokens, as a random-init model samples them (EOS never): the update's
    # cost does not depend on which tokens they are, and HF generate took 8-15 s of each variant's device time.
    uniform = -math.log(model["vocab_size"])
    completions = [[Completion(torch.randint(3, model["vocab_size"], (new_tokens,), generator=g).tolist(),
                               [uniform] * new_tokens, "length") for _ in range(n)] for _ in prompt_ids]
    metrics = [step(prompt_ids, None, step=i + 1, completions=completions) for i in range(updates)]
    measured = timed[1:] if len(timed) > 1 else timed
    update_s = statistics.median(t["seconds"] for t in measured)
    tokens = measured[-1]["tokens"]
    gemm = gemm_tflops(dev, gemm_size, torch_dtype)
    model_tflops = 6 * params * tokens / update_s / 1e12
    # The FLOPs the update runs: no GEMM for the embedding lookup, the LM head on completion positions only (6 x
    # params counts the head, tied or not, on every token: about 5% too many at 1.5B with 128-token prompts).
    embeddings = {id(m.weight): m.weight.numel() for m in (actor.get_input_embeddings(), actor.get_output_embeddings())}
    head, completion_tokens = actor.get_output_embeddings().weight.numel(), measured[-1]["completion_tokens"]
    head_tflops = 6 * ((params - sum(embeddings.values())) * tokens + head * completion_tokens) / update_s / 1e12
    layers = actor.config.num_hidden_layers  # the share of the forward that the backward repeats
    recomputed = checkpointed_layers(config.model, layers) / layers
    out = dict(shape=shape, params=params, sequences=batch, prompt_len=prompt_len, new_tokens=new_tokens,
               micro_batch=batch // grad_accum, optimizer_steps=metrics[-1].get("optimizer_steps"),
               trained_tokens=tokens, completion_tokens=completion_tokens,
               update_s=round(update_s, 4), update_s_all=[round(t["seconds"], 4) for t in timed],
               tokens_per_s=round(tokens / update_s, 1), gemm_tflops=round(gemm, 1),
               model_tflops=round(model_tflops, 2), mfu=round(model_tflops / gemm, 4),
               mfu_with_recompute=round(model_tflops * (6 + 2 * recomputed) / 6 / gemm, 4),
               mfu_head_on_completions=round(head_tflops / gemm, 4),
               mfu_target=0.45, gradient_checkpointing=gradient_checkpointing, liger_kernels=liger_kernels,
               checkpoint_layers=checkpoint_layers, compiled=compiled,
               skipped_steps=sum(m.get("skipped", 0) for m in metrics))
    if decided is not None:
        out["plan_decided"] = decided
    for key, name in (("memory/train_gib", "update_peak_allocated_gib"), ("memory/peak_reserved_gib",
                                                                         "step_peak_reserved_gib")):
        if key in metrics[-1]:  # CUDA only
            out[name] = round(metrics[-1][key], 2)
    if profile:
        out.update(profile_kernels(lambda: step.update(step_exp[0], updates + 1), engine.device))
    out["targets_met"] = out["mfu"] >= out["mfu_target"]
    return out


def update_config(dtype: str, prompts: int, n: int, prompt_len: int, new_tokens: int, grad_accum: int = 1,
                  updates: int = 1, seed: int = 0, path: str = "unused", **model_fields):
    """The ``TrainConfig`` of :func:`rl_update_race`'s GRPO run (the HF engine, sharing the actor), which
    :func:`plan_decided` plans as well; ``model_fields``: the ``ModelConfig``'s others."""
    from fastrlhf.config import DataConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig, TrainerConfig

    trainer = TrainerConfig(max_steps=updates, prompts_per_step=prompts, minibatch_size=prompts * n,
                            grad_accum=grad_accum, ppo_epochs=1, lr=1e-6, kl_coef=LOSS["kl_coef"],
                            kl_kind=LOSS["kl_kind"], clip_low=LOSS["clip_low"], clip_high=LOSS["clip_high"], agg=AGG)
    return TrainConfig(output_dir="unused", model=ModelConfig(path=path, dtype=dtype, **model_fields),
                       data=DataConfig(prompts="unused", max_prompt_len=prompt_len), trainer=trainer,
                       algorithm="grpo", seed=seed,
                       rollout=RolloutConfig(engine="hf", n=n, max_new_tokens=new_tokens, max_logprob_mismatch=None),
                       reward=RewardConfig(function="target_token"))


def plan_decided(dev: torch.device, model: dict, dtype: str, prompts: int, n: int, prompt_len: int,
                 new_tokens: int, budget_bytes: int | None = None) -> dict:
    """What ``fastrlhf train`` with ``model.gradient_checkpointing: auto`` and ``trainer.max_tokens_per_microbatch:
    auto`` runs for :func:`rl_update_race`'s update on this device (``memory.auto``, from the plan of the whole run on
    one rank, :func:`update_config`: the actor's ZeRO-2 engine, its reference, the HF engine sharing the actor):
    checkpointing, the layers it covers, and the fewest micro-batches (a divisor of the batch) whose sequences fit
    the decided tokens. ``budget_bytes``: the plan's budget instead of the device's memory."""
    from fastrlhf.memory.auto import resolve_auto_settings
    from fastrlhf.memory.plan import plan_memory
    from fastrlhf.modeling.tiny import tiny_qwen2_config

    batch, length = prompts * n, prompt_len + new_tokens
    with tempfile.TemporaryDirectory(prefix="bench-gpu-plan-") as folder:
        tiny_qwen2_config(**model).save_pretrained(folder)  # config.json only: all the plan reads
        config = update_config(dtype, prompts, n, prompt_len, new_tokens, path=folder, gradient_checkpointing="auto")
        config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer,
                                                                          max_tokens_per_microbatch="auto"))
        plan = plan_memory(config, 1, budget_bytes, device=dev.type)
        decided, notes = resolve_auto_settings(config, plan)
    per_micro = max(1, int(decided.trainer.max_tokens_per_microbatch) // length)
    grad_accum = next(d for d in range(1, batch + 1) if batch % d == 0 and batch // d <= per_micro)
    return dict(gradient_checkpointing=bool(decided.model.gradient_checkpointing),
                checkpoint_layers=decided.model.checkpoint_layers, grad_accum=grad_accum,
                micro_tokens=int(decided.trainer.max_tokens_per_microbatch), plan_gib=round(plan.total / 2**30, 2),
                budget_gib=round(plan.budget / 2**30, 2), notes=notes)


# ------------------------------------------------------------------------------------------------ race 3
def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``t<id>`` words, so that TRL's text prompts are exactly the token-id prompts
    fastrlhf reads; the last two ids are padding and EOS (a random-init model almost never samples EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pad, eos = vocab_size - 2, vocab_size - 1
    vocab = {f"t{i}": i for i in range(pad)}
    vocab.update({"<pad>": pad, "<eos>": eos})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>",
                                   clean_up_tokenization_spaces=False)


def save_model(device: str, shape: str, dtype: str, out_dir: str, seed: int = 0) -> dict:
    """A random-init model folder (safetensors) with its tokenizer; EOS and padding are the tokenizer's."""
    from transformers import GenerationConfig

    from fastrlhf.modeling.tiny import count_parameters, make_qwen2_on

    model = make_qwen2_on(device, getattr(torch, dtype), seed=seed, **model_shape(shape))
    tokenizer = word_tokenizer(model.config.vocab_size)
    model.config.bos_token_id, model.config.eos_token_id = None, tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {"params": count_parameters(model)}


def _child_env(device: str) -> dict:
    """This environment without the in-process group's variables (each child makes its own); on a CPU, no
    CUDA and the threads this machine has."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(FASTRLHF_DIST_TIMEOUT="120", FASTRLHF_NO_PROGRESS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    # The children import benchmarks.* (the launcher's too); whatever the path had first stays first.
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path + ([ROOT] if ROOT not in path else []))
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(os.cpu_count() or 1))
    return env


def _run(cmd: list[str], env: dict, timeout_s: float) -> str:
    """Run ``cmd`` from the repository root in its own process group (killed whole on timeout); its stdout."""
    from benchmarks.e2e_common import run_in_own_group

    returncode, stdout, stderr = run_in_own_group(cmd, env, timeout_s, " ".join(cmd[:6]))
    if returncode != 0:
        raise RuntimeError(f"exit {returncode}: {' '.join(cmd[:6])}\n{(stdout + stderr)[-6000:]}")
    return stdout


def run_child(race: str, params: dict, timeout_s: float = 600.0, device: str = "cuda") -> dict:
    """``RACES[race](**params)`` in a fresh ``python -m benchmarks.gpu.races`` process; its result."""
    out = _run([sys.executable, "-m", "benchmarks.gpu.races", race, json.dumps(params)], _child_env(device), timeout_s)
    lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(f"{race}: no {RESULT_PREFIX.strip()} line in its output:\n{out[-4000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def run_fastrlhf(spec: dict, work: str, timeout_s: float, engine: str = "hf", shared: bool = False,
                 liger: bool = False, compile: bool = False, fp32: bool = False) -> dict:
    """``fastrlhf train`` through DeepSpeed's launcher on one device (``engine``: ``hf``, or ``vllm`` in the
    trainer's process, asleep during the update on CUDA); the per-step figures of its metrics.jsonl. ``shared``:
    packed rows with each group's prompt once (``trainer.packing``, ``trainer.share_prompts``); ``liger``:
    Liger-Kernel's RMSNorm, SwiGLU and rotary kernels in the actor and reference (``model.liger_kernels``);
    ``compile``: their decoder layers torch.compiled (``model.compile``; the first step compiles); ``fp32``: the LM
    head's logits in fp32 in the trainer and the engine (``model.fp32_logits``). With
    ``spec["profile"]`` (the races' default) one more step runs under ``trainer.profile_step``, left out of the
    figures: its stages' wall and device time, what the host did in each, what it compiled and its largest kernels
    (``profile_stages``, ``profile_host``, ``profile_compiles``, ``profile_top``). A run that fails in that step
    keeps the figures of the steps before it."""
    import yaml

    from fastrlhf.distributed import free_port

    profiled = spec["steps"] + 1 if spec.get("profile", True) else None
    name = ("fastrlhf" if engine == "hf" else f"fastrlhf-{engine}") + ("-shared" if shared else "") + (
        "-liger" if liger else "") + ("-compile" if compile else "") + ("-fp32" if fp32 else "")
    out_dir = os.path.join(work, name)
    vllm = {"engine": "vllm", "sleep": spec["device"] == "cuda", "max_logprob_mismatch": None}
    raw = {
        "algorithm": "grpo", "output_dir": out_dir, "seed": 0,
        "model": {"path": spec["model_dir"], "dtype": "auto", "gradient_checkpointing": True,
                  **({"liger_kernels": True} if liger else {}), **({"compile": True} if compile else {}),
                  **({"fp32_logits": True} if fp32 else {})},
        "reward": {"function": "benchmarks.e2e_common:even_fraction_reward"},
        "data": {"prompts": spec["prompts_file"], "max_prompt_len": spec["prompt_len"]},
        "rollout": {"engine": "hf", "n": spec["n"], "temperature": 1.0, "max_new_tokens": spec["new_tokens"],
                    "max_logprob_mismatch": None, **(vllm if engine == "vllm" else {})},
        "trainer": {"max_steps": profiled or spec["steps"], "profile_step": profiled,
                    "prompts_per_step": spec["prompts"],
                    "minibatch_size": spec["prompts"] * spec["n"], "grad_accum": spec["grad_accum"], "lr": 1e-6,
                    "agg": AGG, **LOSS, "save_final": False, "log_every": 1,
                    **({"packing": True, "share_prompts": True} if shared else {})},
        "deepspeed": {"zero_stage": 2},
    }
    path = out_dir + ".yaml"
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    failed = None
    with DevicePeak(spec["device"]) as device_peak:
        try:
            _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port",
                  str(free_port()), "--module", "fastrlhf", "train", "--config", path], _child_env(spec["device"]),
                 timeout_s)
        except RuntimeError as e:
            failed = e
    metrics_file = os.path.join(out_dir, "metrics.jsonl")
    rows = []
    if os.path.exists(metrics_file):
        with open(metrics_file) as f:
            rows = [r for r in map(json.loads, filter(str.strip, f)) if "step_time" in r]
    rows = [r for r in rows if r.get("step", 0) <= spec["steps"]]
    if failed is not None and (profiled is None or len(rows) < spec["steps"]):
        raise failed
    profile = {}
    profile_file = os.path.join(out_dir, "profile", f"step-{profiled}-rank-0.json")
    if profiled and os.path.exists(profile_file):
        with open(profile_file) as f:
            p = json.load(f)
        profile = dict(profile_stages=p["stages"], profile_host=p["host"], profile_compiles=p["compiles"],
                       profile_top=p["profile_top"], profile_gemm_share=p["profile_gemm_share"],
                       **_keep_trace(profile_file, name))
    elif profiled:
        profile = dict(profile_error=str(failed)[-1500:] if failed else "no profile written")
    steps = [dict(step_s=r.get("wall_time", r["step_time"]), tokens=r["generated_tokens"],
                  generate_s=r["time/generate"], score_s=r["time/score"], train_s=r["time/train"],
                  sync_s=r["time/sync"],
                  sync_bytes=r.get("sync_bytes", 0.0), trained_tokens=r["rank_tokens"],
                  mismatch=r.get("logprob_mismatch_mean"),
                  peak_gib=r.get("memory/peak_reserved_gib"), context_gib=r.get("memory/context_gib"),
                  peak_rss_gib=r.get("memory/peak_rss_gib"),
                  allocator={k[len("memory/"):]: v for k, v in r.items() if k.endswith(ALLOCATOR_SUFFIXES)})
             for r in rows]
    # TRL's peak_gib is its process's max_memory_reserved over the whole run: here the set-up's peak counts as well
    # (logged with the first step: the trainer empties the set-up's cache before it, so no step's peak holds it).
    peaks = [p for r in rows for p in (r.get("memory/peak_reserved_gib"), r.get("memory/setup_peak_reserved_gib"))
             if p is not None]
    contexts = [s["context_gib"] for s in steps if s["context_gib"] is not None]
    return dict(steps=steps, peak_gib=max(peaks) if peaks else None, context_gib=max(contexts) if contexts else None,
                device_peak_gib=device_peak.gib, **profile)


TRACE_KEEP_MAX_BYTES = 12 << 20  # a device call brings back files of 16 MiB at most


def _keep_trace(profile_file: str, name: str) -> dict:
    """The profiled step's timeline (``.trace.json.gz`` beside its summary) copied to ``$FASTRLHF_RACE_TRACES``
    (scripts/gpu_session.sh sets it), since the race's work folder is deleted: where a step's host time goes (a
    stage far under 1 busy) is read there, not in the kernel table. Returns ``profile_trace`` (its name, or why
    it was not kept)."""
    keep = os.environ.get("FASTRLHF_RACE_TRACES")
    trace = profile_file.removesuffix(".json") + ".trace.json.gz"
    if not keep or not os.path.exists(trace):
        return {}
    if os.path.getsize(trace) > TRACE_KEEP_MAX_BYTES:
        return {"profile_trace": f"not kept: {os.path.getsize(trace) >> 20} MiB"}
    os.makedirs(keep, exist_ok=True)
    kept = f"{name}-{os.path.basename(trace)}"
    shutil.copy(trace, os.path.join(keep, kept))
    return {"profile_trace": kept}


class DevicePeak:
    """The most memory the GPU had in use while the block ran, above what it had at the start (every process:
    the trainer, vLLM's pools, CUDA contexts), from ``nvidia-smi`` sampled every 50 ms: the one measure that
    reads fastrlhf, TRL and vLLM's allocators alike. ``gib`` is None on a CPU or without nvidia-smi."""

    def __init__(self, device: str):
        self.on = device == "cuda" and shutil.which("nvidia-smi") is not None
        self.gib = None

    def _query(self, *loop: str):
        import subprocess

        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0", *loop]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def __enter__(self):
        if self.on:
            self.base = float(self._query().communicate(timeout=30)[0].split()[0])
            self.proc = self._query("-lms", "50")
        return self

    def __exit__(self, *exc):
        if self.on:
            self.proc.terminate()
            samples = [float(x) for x in self.proc.communicate(timeout=30)[0].split() if x.strip().isdigit()]
            self.gib = round((max(samples, default=self.base) - self.base) / 1024, 2)  # MiB -> GiB
        return False


def trl_grpo(spec: dict) -> dict:
    """TRL's ``GRPOTrainer`` on ``spec`` (a child process: it owns its allocator). Matched to ``run_fastrlhf``:
    the model folder loaded in fp32 with bf16 autocast (TRL's defaults, and like fastrlhf fp32 master weights
    under bf16 compute), group-std scaled rewards, k3 KL with the same beta, clip 0.2, ``dapo`` (token mean
    over the generation batch), AdamW at a constant learning rate, clip-norm 1.0, gradient checkpointing,
    HF generate, and one generation and one optimizer step per step: ``steps_per_generation`` =
    ``gradient_accumulation_steps`` micro-batches of fastrlhf's size, ``num_iterations`` 1 (no old-logprob
    pass, as fastrlhf skips it on-policy; with vLLM, no importance-sampling correction, whose default runs that
    pass). A callback times each optimizer step (= one GRPO step), and
    :func:`time_trl_stages` its generation, scoring and weight sync, named as fastrlhf's stages are."""
    import dataclasses

    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.e2e_common import even_fraction_reward

    cuda = spec["device"] == "cuda"
    with open(spec["prompts_file"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ids_of = {r["prompt"]: r["prompt_ids"] for r in rows}
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"])
    assert all(tokenizer(text=r["prompt"])["input_ids"] == r["prompt_ids"] for r in rows), "TRL would see other ids"

    def reward(prompts, completions, completion_ids, **kwargs):
        return [even_fraction_reward(ids_of[p], list(c)) for p, c in zip(prompts, completion_ids, strict=True)]

    batch, micro = spec["prompts"] * spec["n"], spec["prompts"] * spec["n"] // spec["grad_accum"]
    wanted = dict(
        output_dir=os.path.join(spec["work"], "trl"), seed=0, use_cpu=not cuda, bf16=cuda, fp16=False,
        model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=True,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_iterations=1, num_generations=spec["n"],
        max_completion_length=spec["new_tokens"], max_prompt_length=spec["prompt_len"], temperature=1.0, top_p=1.0,
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", beta=LOSS["kl_coef"], epsilon=LOSS["clip_low"], scale_rewards="group",
        loss_type="dapo", max_steps=spec["steps"], logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    if spec.get("vllm"):
        # TRL's colocated vLLM in the trainer's process, asleep during the update, at TRL's own
        # vllm_gpu_memory_utilization (its default, as a user starts with). Its importance-sampling correction
        # (on by default) recomputes the policy's logprobs of the whole batch after generation: a forward pass that
        # fastrlhf's on-policy step does not run (it corrects nothing), so off, for the same passes on both sides.
        wanted.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=cuda,  # sleep mode needs CUDA
                      vllm_importance_sampling_correction=False)
    if spec.get("liger"):
        # TRL <= 1.x had use_liger_loss (Liger's fused GRPO loss); 1.16 keeps only use_liger_kernel (Liger's
        # layer kernels; the loss is TRL's own fused LM head either way).
        wanted["use_liger_loss" if "use_liger_loss" in fields else "use_liger_kernel"] = True
    missing = [k for k in ("use_vllm", "vllm_mode", "vllm_enable_sleep_mode") if k in wanted and k not in fields]
    if missing:  # dropped silently, the run would race HF generate under the name of TRL's vLLM
        raise RuntimeError(f"TRL {trl.__version__}'s GRPOConfig has no {', '.join(missing)}")
    args = GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})
    steps: list[dict] = []
    device = torch.device("cuda" if cuda else "cpu")

    stages: dict = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            sync(device)
            stages.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync(device)
            step_s = time.perf_counter() - self.t0
            steps.append({"step_s": step_s, **trl_step_stages(stages, step_s)})

    dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows]})
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    time_trl_stages(trainer, device, stages)
    trainer.train()
    return dict(steps=steps, trl_version=trl.__version__, ignored_args=sorted(set(wanted) - fields),
                liger_flag=next((k for k in ("use_liger_loss", "use_liger_kernel") if wanted.get(k)), None),
                vllm_gpu_memory_utilization=getattr(args, "vllm_gpu_memory_utilization", None) if spec.get("vllm")
                else None,
                peak_gib=torch.cuda.max_memory_reserved() / GIB if cuda else None,
                weights_dtype=str(next(trainer.model.parameters()).dtype))


def time_trl_stages(trainer, device: torch.device, seconds: dict) -> dict:
    """Times the parts of a TRL ``GRPOTrainer`` step into ``seconds`` (each call adds to its key; the caller clears it
    each step): the whole generation and scoring (``gen_and_score``), and inside it the generation (vLLM's
    ``generate``, or HF generate's turn) and vLLM's weight sync (``sync``). Each timed call starts and ends with a
    device synchronize, as the step's own timer does. A method this TRL lacks is left as it is. Returns ``seconds``."""
    def timed(owner, method: str, key: str) -> None:
        fn = getattr(owner, method, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(device)
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0

        setattr(owner, method, wrapper)

    timed(trainer, "_generate_and_score_completions", "gen_and_score")
    engine = getattr(trainer, "vllm_generation", None)
    if engine is not None:
        timed(engine, "generate", "generate")
        timed(engine, "sync_weights", "sync")
    else:
        timed(trainer, "_generate_single_turn", "generate")
    return seconds


def trl_step_stages(seconds: dict, step_s: float) -> dict:
    """One TRL step's ``generate_s``, ``score_s`` (rewards, reference and old logprobs: the rest of generation and
    scoring), ``train_s`` (the rest of the step) and ``sync_s``, as fastrlhf's metrics name its stages; nothing where
    the step did not generate through a timed method."""
    if "gen_and_score" not in seconds or "generate" not in seconds:
        return {}
    generate, sync_s = seconds["generate"], seconds.get("sync", 0.0)
    return dict(generate_s=generate, score_s=seconds["gen_and_score"] - generate - sync_s,
                train_s=step_s - seconds["gen_and_score"], sync_s=sync_s)


GRPO_TARGETS = dict(speedup_min=1.5, memory_ratio_max=0.6)


def grpo_vs_trl(device: str = "cuda", shape: str = "qwen2-1.5b", prompts: int = 16, n: int = 8, prompt_len: int = 64,
                new_tokens: int = 128, grad_accum: int = 4, steps: int = 3, warmup: int = 1,
                runs=("fastrlhf", "trl", "trl_liger"), timeout_s: float = 240.0, budget_s: float = 150.0) -> dict:
    """Seconds per GRPO step (median after ``warmup`` steps) and peak reserved device memory of each run;
    fastrlhf's speed-up over TRL and its memory over TRL's. A run whose package is missing is skipped with
    its reason, and so is one that would start after ``budget_s`` (``make bench-gpu`` must stay under 5
    minutes). The model folder (bf16 on CUDA: ~3 GB for 1.5B) and every output go in the end."""

    started, work = time.perf_counter(), tempfile.mkdtemp(prefix="bench-gpu-grpo-")
    try:
        spec, saved = _grpo_setup(work, device, shape, prompts, n, prompt_len, new_tokens, grad_accum, steps,
                                  timeout_s)
        out = dict(shape=shape, prompts=prompts, n=n, prompt_len=prompt_len, new_tokens=new_tokens, steps=steps,
                   warmup_steps=warmup, engine="hf", **LOSS, **GRPO_TARGETS, **saved)
        needs = {"fastrlhf": (), "trl": ("trl",), "trl_liger": ("trl", "liger_kernel")}
        results = {}
        for name in runs:
            if skipped := _cannot_start(needs[name], started, budget_s):
                out[f"{name}_skipped"] = skipped
                continue
            if name == "fastrlhf":
                results[name] = run_fastrlhf(spec, work, timeout_s)
            else:
                results[name] = run_child("trl_grpo", dict(spec=dict(spec, liger=name == "trl_liger")), timeout_s,
                                          device)
        for name, r in results.items():
            _run_figures(out, name, r, warmup, ("peak_gib", "context_gib", "weights_dtype", "liger_flag",
                                                "ignored_args", *PROFILE_KEYS))
        for other in ("trl", "trl_liger"):
            _ratio(out, f"speedup_vs_{other}", f"{other}_step_s", "fastrlhf_step_s")
            _ratio(out, f"memory_ratio_vs_{other}", "fastrlhf_peak_gib", f"{other}_peak_gib")
        out["targets_met"] = bool(out.get("speedup_vs_trl", 0) >= GRPO_TARGETS["speedup_min"]
                                  and out.get("memory_ratio_vs_trl", 1e9) <= GRPO_TARGETS["memory_ratio_max"])
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


# Issue #42's targets: vLLM's step against HF generate's, against TRL's colocated vLLM (time and device memory),
# the weight sync of the 1.5B model, and the engine's logprobs against the trainer's (bf16).
ENGINE_TARGETS = dict(vllm_over_hf_min=5.0, speedup_vs_trl_vllm_min=1.5, memory_vs_trl_vllm_max=0.8, sync_ms_max=100.0,
                      mismatch_max=0.02)
ENGINE_RUNS = ("fastrlhf_vllm", "fastrlhf_hf", "trl_vllm", "trl_vllm_liger")
# Asked for by name only: fastrlhf with vLLM on packed rows that hold each group's prompt once. Any fastrlhf run may
# add ``_shared``, ``_liger`` (model.liger_kernels), ``_compile`` (model.compile) and ``_fp32`` (model.fp32_logits:
# the head's logits in fp32 in trainer and engine) to its name: fastrlhf_<engine>[_shared][_liger][_compile][_fp32].
SHARED_RUN = "fastrlhf_vllm_shared"
FASTRLHF_OPTIONS = ("shared", "liger", "compile", "fp32")
TRL_RUNS = {"trl_vllm": ("trl", "vllm"), "trl_vllm_liger": ("trl", "vllm", "liger_kernel")}  # -> what each imports


def _unknown_run(name: str) -> ValueError:
    return ValueError(f"unknown run {name!r}: fastrlhf_<vllm|hf>[_shared][_liger][_compile][_fp32], "
                      f"{' or '.join(TRL_RUNS)}")


def _fastrlhf_run(name: str) -> tuple[str, dict] | None:
    """``(engine, options)`` of a fastrlhf run's name, None for another trainer's; an unknown part is an error."""
    if not name.startswith("fastrlhf_"):
        return None
    engine, *options = name.split("_")[1:]
    if engine not in ("vllm", "hf") or not set(options) <= set(FASTRLHF_OPTIONS) or len(set(options)) < len(options):
        raise _unknown_run(name)
    return engine, {o: o in options for o in FASTRLHF_OPTIONS}


def _run_needs(name: str) -> tuple[str, ...]:
    """The packages a run of :func:`grpo_engines` imports."""
    fastrlhf = _fastrlhf_run(name)
    if fastrlhf is not None:
        engine, options = fastrlhf
        return ("vllm",) * (engine == "vllm") + ("liger_kernel",) * options["liger"]
    if name not in TRL_RUNS:
        raise _unknown_run(name)
    return TRL_RUNS[name]


def _engine_targets_met(out: dict, run: str) -> bool:
    """Whether fastrlhf's ``run`` meets every target of :data:`ENGINE_TARGETS` (the speed-up over HF generate is
    the default layout's)."""
    t, step, memory = ENGINE_TARGETS, out.get(f"{run}_step_s"), out.get(f"{run}_device_peak_gib")
    trl_step, trl_memory = out.get("trl_vllm_step_s"), out.get("trl_vllm_device_peak_gib")
    return bool(step and memory and trl_step and trl_memory and out.get("vllm_over_hf", 0) >= t["vllm_over_hf_min"]
                and trl_step / step >= t["speedup_vs_trl_vllm_min"]
                and memory / trl_memory <= t["memory_vs_trl_vllm_max"]
                and out.get(f"{run}_sync_ms", 1e9) <= t["sync_ms_max"]
                and out.get(f"{run}_mismatch", 1e9) <= t["mismatch_max"])


def grpo_engines(device: str = "cuda", shape: str = "qwen2-1.5b", prompts: int = 8, n: int = 8, prompt_len: int = 128,
                 new_tokens: int = 256, grad_accum: int = 4, steps: int = 3, warmup: int = 1, runs=ENGINE_RUNS,
                 timeout_s: float = 300.0, budget_s: float = 540.0) -> dict:
    """Whole GRPO steps (generate, reference, update, weight sync) of ``fastrlhf train`` with vLLM in the trainer's
    process (asleep during the update) and with HF ``generate``, and TRL's ``GRPOTrainer`` with its colocated vLLM
    (sleep mode on; with and without Liger), each in its own process on the same model folder, prompts, group
    size, token limits and batch. Per run: s/step (median after ``warmup``), generated tokens/s (over the
    generation), trained tokens/s (prompt and completion tokens over the update), the device's peak memory above
    idle (:class:`DevicePeak`), and for fastrlhf with vLLM the sync's ms and GB/s and the logprob mismatch. A run
    whose package is missing, or that would start after ``budget_s``, is skipped with the reason. ``runs`` may add
    fastrlhf's options to a run's name (:func:`_fastrlhf_run`), e.g. :data:`SHARED_RUN` (each group's prompt
    once): each such vLLM run's ratios against TRL carry its options as a prefix (``shared_speedup_vs_trl_vllm``),
    and ``targets_met`` holds where any fastrlhf vLLM run meets every target."""

    needs = {name: _run_needs(name) for name in runs}  # an unknown name fails before anything starts
    started, work = time.perf_counter(), tempfile.mkdtemp(prefix="bench-gpu-engines-")
    try:
        spec, saved = _grpo_setup(work, device, shape, prompts, n, prompt_len, new_tokens, grad_accum, steps,
                                  timeout_s)
        out = dict(shape=shape, prompts=prompts, n=n, prompt_len=prompt_len, new_tokens=new_tokens, steps=steps,
                   warmup_steps=warmup, **LOSS, **ENGINE_TARGETS, **saved)
        for name in runs:
            if skipped := _cannot_start(needs[name], started, budget_s, MIN_RUN_S):
                out[f"{name}_skipped"] = skipped
                continue
            # The time left, so that a slow or hung run still leaves the race its figures (a device call's cap).
            run_s = min(timeout_s, budget_s - (time.perf_counter() - started))
            try:
                if (fastrlhf := _fastrlhf_run(name)) is not None:
                    r = run_fastrlhf(spec, work, run_s, engine=fastrlhf[0], **fastrlhf[1])
                else:
                    with DevicePeak(device) as peak:
                        r = run_child("trl_grpo", dict(spec=dict(spec, vllm=True, liger=name.endswith("liger"))),
                                      run_s, device)
                    r["device_peak_gib"] = peak.gib
            except (RuntimeError, OSError) as e:  # the others' figures still count
                out[f"{name}_error"] = str(e)[-3000:]
                continue
            _run_figures(out, name, r, warmup, ("device_peak_gib", "peak_gib", "liger_flag", "ignored_args",
                                                "weights_dtype", "vllm_gpu_memory_utilization", *PROFILE_KEYS))
        _ratio(out, "vllm_over_hf", "fastrlhf_hf_step_s", "fastrlhf_vllm_step_s")
        ours = ["fastrlhf_vllm"] + [r for r in runs if r.startswith("fastrlhf_vllm_")]
        for other in ("trl_vllm", "trl_vllm_liger"):
            for run in ours:
                prefix = run[len("fastrlhf_vllm_"):] + "_" if run != "fastrlhf_vllm" else ""
                _ratio(out, f"{prefix}speedup_vs_{other}", f"{other}_step_s", f"{run}_step_s")
                _ratio(out, f"{prefix}memory_vs_{other}", f"{run}_device_peak_gib", f"{other}_device_peak_gib")
        _ratio(out, "shared_over_padded", "fastrlhf_vllm_step_s", f"{SHARED_RUN}_step_s")
        out["targets_met"] = any(_engine_targets_met(out, run) for run in ours)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _grpo_setup(work, device, shape, prompts, n, prompt_len, new_tokens, grad_accum, steps, timeout_s):
    """The spec every GRPO race's runs share, with its model folder saved (bf16 on CUDA, in a child so that this
    process holds no CUDA context while the trainers measure the device) and its prompts written; returns the
    spec and what saving the model reported."""
    spec = dict(device=device, work=work, model_dir=os.path.join(work, "model"), prompts=prompts, n=n,
                prompt_len=prompt_len, new_tokens=new_tokens, grad_accum=grad_accum, steps=steps,
                prompts_file=os.path.join(work, "prompts.jsonl"))
    model = dict(device=device, shape=shape, dtype="bfloat16" if device == "cuda" else "float32",
                 out_dir=spec["model_dir"])
    saved = save_model(**model) if device == "cpu" else run_child("save_model", model, timeout_s, device)
    _write_prompts(spec, model_shape(shape)["vocab_size"])
    return spec, saved


def _cannot_start(modules, started: float, budget_s: float, min_left: float = 0.0) -> str | None:
    """Why a run is skipped (a package missing, or less than ``min_left`` of the race's time budget left), or
    None."""
    import importlib.util

    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if absent:
        return f"{', '.join(absent)} not installed"
    left = budget_s - (time.perf_counter() - started)
    return f"{left:.0f} s of the race's {budget_s:.0f} s left" if left <= min_left else None


MIN_RUN_S = 60.0  # a trainer's start on the 1.5B model and a step or two: less left, and a run is not begun


def _write_prompts(spec: dict, vocab: int) -> None:
    """``prompts`` random prompts of ``prompt_len`` ids below the tokenizer's padding and EOS, with their text."""
    g = torch.Generator().manual_seed(0)
    with open(spec["prompts_file"], "w") as f:
        for ids in torch.randint(3, vocab - 2, (spec["prompts"], spec["prompt_len"]), generator=g).tolist():
            f.write(json.dumps({"prompt_ids": ids, "prompt": " ".join(f"t{i}" for i in ids)}) + "\n")


# The allocator's churn per stage in fastrlhf's step metrics (memory/<stage>_alloc_retries, _cuda_mallocs).
ALLOCATOR_SUFFIXES = ("_alloc_retries", "_cuda_mallocs")
# What run_fastrlhf reads from its profiled step (trainer.profile_step).
PROFILE_KEYS = ("profile_stages", "profile_host", "profile_compiles", "profile_top", "profile_gemm_share",
                "profile_error", "profile_trace")


def _run_figures(out: dict, name: str, r: dict, warmup: int, keys) -> None:
    """One run's figures into ``out`` as ``<name>_<figure>``: medians over the steps after ``warmup`` (all of them
    if there are no more), fastrlhf's rates, sync and mismatch where its metrics hold them, the run's ``keys``
    (floats to 2 decimals), and TRL's version."""
    steps = r["steps"][warmup:] or r["steps"]

    def median(key):
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(values) if values else None

    out[f"{name}_step_s"] = round(median("step_s"), 3)
    out[f"{name}_steps_s"] = [round(s["step_s"], 3) for s in r["steps"]]
    if median("tokens") is not None:  # fastrlhf's metrics
        out[f"{name}_generated_tokens_per_s"] = round(median("tokens") / median("generate_s"), 1)
        out[f"{name}_trained_tokens_per_s"] = round(median("trained_tokens") / median("train_s"), 1)
    # Where the step's time goes (fastrlhf's metrics; TRL's timed methods): what a faster engine can win against
    # what it shares with the other run.
    for stage in ("generate", "score", "train", "sync"):
        if median(f"{stage}_s") is not None:
            out[f"{name}_{stage}_s"] = round(median(f"{stage}_s"), 3)
    if median("sync_bytes"):
        out[f"{name}_sync_ms"] = round(median("sync_s") * 1e3, 2)
        out[f"{name}_sync_gb_per_s"] = round(median("sync_bytes") / 1e9 / median("sync_s"), 2)
    if median("mismatch") is not None:
        out[f"{name}_mismatch"] = round(median("mismatch"), 5)
    churn = {}  # summed over the measured steps: a retry synchronizes the device and empties the cache
    for s in steps:
        for key, n in (s.get("allocator") or {}).items():
            churn[key] = churn.get(key, 0) + int(n)
    if churn:
        out[f"{name}_allocator"] = churn
    for key in keys:
        if r.get(key) is not None:
            out[f"{name}_{key}"] = round(r[key], 2) if isinstance(r[key], float) else r[key]
    if "trl_version" in r:
        out["trl_version"] = r["trl_version"]


def layouts_race(**kwargs) -> dict:
    """Race 4, padded / packed / shared prompts: :func:`benchmarks.gpu.layouts.race`."""
    from benchmarks.gpu.layouts import race

    return race(**kwargs)


RACES = {"lm_head": lm_head_race, "rl_update": rl_update_race, "grpo_vs_trl": grpo_vs_trl, "save_model": save_model,
         "trl_grpo": trl_grpo, "layouts": layouts_race, "grpo_engines": grpo_engines}

if __name__ == "__main__":
    result = RACES[sys.argv[1]](**json.loads(sys.argv[2]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
