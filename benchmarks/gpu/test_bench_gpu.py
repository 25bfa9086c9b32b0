"""``make bench-gpu``: the three GPU races of ``races.py`` at full size, each in a fresh child process, on one
H100/H200 (estimated: about 1 + 1 + 3 minutes, the last capped by ``grpo_vs_trl``'s ``budget_s``). Every
figure lands in the record's ``extra_info`` (pytest-benchmark JSON, ``benchmarks/results/gpu/``); the
benchmark fixture's own time is the child's wall time, start-up included: not a figure.

1. ``test_lm_head_7b``: N=16,384 tokens, H=3,584, V=152,064, bf16, forward + backward of the GRPO loss:
   fused (fastrlhf), naive (materialised logits), Liger-Kernel and the three bare GEMMs. Targets: fused
   <= 1.10x the GEMMs' time (the median ratio of rounds that time both one after the other, so the clock's drift
   between two blocks of repeats does not count), fused peak <= 0.2x naive's, Liger >= 5x fused's time. Issue
   #43's before and after, side by side: fused with the three softmax launches per chunk instead of the row kernel
   (``fused_no_rows``) and, besides, with grad_weight summed through a bf16 scratch (``fused_before``); the row
   kernel with one or two programs per SM looping over rows (``fused_rows_1_per_sm``, ``fused_rows_2_per_sm``)
   instead of one per row, so that a row's second read finds it in L2. Then the
   CUDA time by kernel of one fused step after and before (``fused_profile_top``, ``fused_before_profile_top``:
   the ten largest; issue #43's first step). And what ``model.fp32_logits`` costs: the fused step with the
   chunk's logits in fp32 (``fused_fp32_logits``, ``fp32_logits_over_fused``).
2. ``test_rl_update_1_5b``: ``RLStep.update`` of the 1.5B Qwen2 on 64 x (128 + 256) tokens: trained tokens/s
   and MFU = 6 x params x tokens / time / the bf16 GEMM rate measured in the same process (every real
   token, prompt and completion, runs forward and backward; the LM head only on completion positions, so
   6 x params over-counts it by its share on prompts, about 5% here). Target (issue #43): MFU >= 45%. Run with
   gradient checkpointing (2 micro-batches; and of the first 14 of the 28 layers only, ``model.checkpoint_layers``)
   and without it (4 micro-batches), each with the update's time by
   kernel (``profile_top``: what it spends outside the GEMMs); and without it with Liger-Kernel's RMSNorm,
   SwiGLU and rotary kernels (``model.liger_kernels``), and with its decoder layers torch.compiled instead
   (``model.compile``), beside the run without either. ``plan-auto``: checkpointing and micro-batches as the
   memory plan decides them on the device at hand (``auto`` for both; ``plan_decided`` in the figures).
3. ``test_grpo_step_vs_trl``: s/step and peak reserved memory of ``fastrlhf train`` (HF engine) and TRL's
   GRPOTrainer (without and with Liger: TRL 1.16 has no ``use_liger_loss``, its ``use_liger_kernel`` swaps in
   Liger's layer kernels and keeps TRL's own fused LM head), 16 prompts x 8 completions of 128 tokens.
   Targets: speed-up >= 1.5x, memory <= 0.6x TRL's.

4. ``test_layouts_1_5b``: the reference pass + update of one GRPO step, padded, packed and with shared prompts,
   on workload C's shape scaled to the 1.5B model (``layouts.py``). Targets: packed >= 1.5x padded, shared
   >= 2x padded. ``test_layouts_1_5b_grpo_race_shape``: the same at the GRPO races' batch, a diagnosis (no
   target): whether the shared layout is slower than the padded one there by itself, and with the shared layout
   on per-segment sdpa as well (``shared_sdpa``) whether FlexAttention is why.

5. ``test_grpo_step_vllm_vs_hf`` and ``test_grpo_step_vllm_vs_trl`` (issue #42): whole GRPO steps with vLLM in
   the trainer's process (asleep during the update), 8 prompts x 8 completions of 128 + 256 tokens, against the
   same steps with HF ``generate`` (target: >= 5x), and against TRL's colocated vLLM with sleep mode, without and
   with Liger (targets: >= 1.5x, <= 0.8x its device memory); the sync of the 1.5B model (<= 100 ms) and the
   logprob mismatch (<= 0.02 per token). ``FASTRLHF_RACE_RUNS`` may name fastrlhf runs with options,
   ``fastrlhf_vllm[_shared][_liger]``: on packed rows that hold each group's prompt once
   (``trainer.share_prompts``), with Liger-Kernel's layer kernels (``model.liger_kernels``), raced beside the
   default (``shared_*``, ``liger_*`` ratios; ``targets_met`` where any of them meets every target). Each
   fastrlhf run of these GRPO races (3. and 5.) runs one more step under ``trainer.profile_step``, left out of its
   figures: each stage's wall and device time, what the host did in it, what it compiled and the largest kernels
   (``*_profile_stages``, ``*_profile_host``, ``*_profile_compiles``, ``*_profile_top``), where the step's time goes.
   TRL's steps are split into the same stages by timing its methods (``trl*_generate_s``, ``_score_s``,
   ``_train_s``, ``_sync_s``). Each fits one device call (vLLM is
   unpacked by the second call of scripts/gpu_session.sh; skipped where it is missing).

Targets are reported (``targets_met``); a miss fails only with ``FASTRLHF_BENCH_STRICT=1``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from benchmarks.gpu.children import run_child
from benchmarks.gpu.workload import LM_HEAD_7B

STRICT = os.environ.get("FASTRLHF_BENCH_STRICT") == "1"


def _race(benchmark, name: str, params: dict, timeout_s: float, targets: bool = True) -> dict:
    """``targets``: False for a diagnosis, which has none to meet."""
    result: dict = {}
    benchmark.pedantic(lambda: result.update(run_child(name, params, timeout_s)), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    if STRICT and targets:
        assert result.get("targets_met"), result
    return result


def test_lm_head_7b(gpu_benchmark):
    _race(gpu_benchmark, "lm_head", dict(device="cuda", **LM_HEAD_7B), timeout_s=300)


# Race 4's diagnosis at the GRPO races' batch, ahead of the update's variants: it serves issue #42, and a device
# call cut by its cap keeps the tables of the tests before the cut.
def test_layouts_1_5b_grpo_race_shape(gpu_benchmark):
    from benchmarks.gpu.layouts import GRPO_RACE_SHAPE

    _race(gpu_benchmark, "layouts", dict(device="cuda", shape="qwen2-1.5b", **GRPO_RACE_SHAPE), timeout_s=240,
          targets=False)


@pytest.mark.parametrize("checkpointing,liger,layers,compiled,auto",
                         [(True, False, None, False, False), (True, False, 14, False, False),
                          (False, False, None, False, False), (False, True, None, False, False),
                          (False, False, None, True, False), (False, False, None, False, True)],
                         ids=["checkpointing", "checkpointing-14-of-28", "no-checkpointing", "no-checkpointing-liger",
                              "no-checkpointing-compiled", "plan-auto"])
def test_rl_update_1_5b(gpu_benchmark, checkpointing, liger, layers, compiled, auto):
    if liger and importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed (the gpu-bench extra)")
    _race(gpu_benchmark, "rl_update", dict(device="cuda", shape="qwen2-1.5b", gradient_checkpointing=checkpointing,
                                           grad_accum=2 if checkpointing else 4, liger_kernels=liger,
                                           checkpoint_layers=layers, compiled=compiled, auto=auto),
          timeout_s=300)


def test_grpo_step_vs_trl(gpu_benchmark):
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (the gpu-bench extra: trl==1.16.0, liger-kernel==0.8.5)")
    # Its child only spawns: the model's creation and each trainer run are children of their own.
    _race(gpu_benchmark, "grpo_vs_trl", dict(device="cuda", shape="qwen2-1.5b"), timeout_s=570)


def test_layouts_1_5b(gpu_benchmark):
    _race(gpu_benchmark, "layouts", dict(device="cuda", shape="qwen2-1.5b"), timeout_s=300)


def test_grpo_step_vllm_vs_hf(gpu_benchmark):
    # A lent machine's two vLLM calls may split the race (scripts/gpu_session.sh): the HF run in the call that
    # delivers vLLM's first part, the vLLM run in the next, on the same model and prompts (seed 0).
    runs = (os.environ.get("FASTRLHF_RACE_RUNS") or "fastrlhf_vllm,fastrlhf_hf").split(",")  # unset or empty: both
    if "fastrlhf_vllm" in runs and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (the gpu extra; on the lent machines the second call of gpu_session.sh)")
    _race(gpu_benchmark, "grpo_engines", dict(device="cuda", runs=runs, **_budget()), timeout_s=570)


def test_grpo_step_vllm_vs_trl(gpu_benchmark):
    for module in ("vllm", "trl"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (the gpu and gpu-bench extras)")
    # FASTRLHF_RACE_RUNS may name others, e.g. fastrlhf_vllm_shared (each group's prompt once), fastrlhf_vllm_liger.
    runs = (os.environ.get("FASTRLHF_RACE_RUNS") or "fastrlhf_vllm,trl_vllm,trl_vllm_liger").split(",")
    _race(gpu_benchmark, "grpo_engines", dict(device="cuda", runs=runs, **_budget()), timeout_s=570)


def _budget() -> dict:
    """The engine race's time budget where the device call gives one (scripts/gpu_session.sh: the seconds its
    cap leaves, ``FASTRLHF_RACE_BUDGET_S``), less the race child's own start and the model's save."""
    left = os.environ.get("FASTRLHF_RACE_BUDGET_S")
    return {} if left is None else dict(budget_s=max(float(left) - 30.0, 1.0))
