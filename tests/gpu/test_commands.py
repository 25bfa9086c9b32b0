"""Every command through the DeepSpeed launcher on one device, then the memory plan against what the RL
runs measured.

- ``fastrlhf sft`` padded and packed (its loss falls), ``fastrlhf rm`` pairwise and classifier, GRPO on
  ZeRO-2 (reference model, HF rollouts), padded and packed with shared prompts, and PPO on ZeRO-3 (critic),
  each with finite metrics; packed SFT and pairwise RM also evaluate held-out lines (``data.eval_path``,
  finite ``eval/*`` figures at each ``trainer.eval_every`` and the last step). On CUDA: the 1.5B Qwen2 shape
  from random init in bf16, NCCL; on the CPU: a tiny Qwen2, gloo.
- The same with ``rollout.engine: vllm`` in the trainer's process (asleep during the update on CUDA): GRPO
  on ZeRO-2, PPO on ZeRO-3, a LoRA actor; and ``scripts/vllm_beside_actor.py``, the trainer's step driven
  stage by stage. On CUDA these skip where vLLM is not installed (on the project's lent machines, the
  ``vllm`` call of scripts/gpu_session.sh unpacks it).
- ``fastrlhf plan``'s peak against the measured one: on CUDA the caching allocator's peak
  (``torch.cuda.max_memory_reserved``) plus what the device holds beyond it (CUDA context, NCCL), as
  the trainer logs them (``memory/*``, fastrlhf.rl.step); on the CPU the rank's peak RSS. On CUDA the
  plan's scoring phase also bounds what the score stage allocated.

No run writes a checkpoint or an export (``trainer.save_final: false``): a 1.5B checkpoint with its
optimizer states is 24 GB, more than the GPU machine's disk can spare.
"""

import importlib.util
import json
import math
import os
import sys
import time

import pytest
import torch
import yaml
from helpers.launch import run_group
from helpers.proof import model_dtype, model_shape

from fastrlhf.distributed import free_port
from fastrlhf.rl.step_metrics import STAGES

GiB = 2.0**30
# The plan may be under the measured peak by 5% at most (an under-estimate ends in an out-of-memory
# crash at step 1) and over it by 25% at most. On the CPU the plan counts a rank's whole resident set,
# where the runtime (python, torch, DeepSpeed) dwarfs a tiny model: checked against CPU_BOUNDS.
GPU_BOUNDS = (0.95, 1.25)
CPU_BOUNDS = (0.75, 1.25)


@pytest.fixture(scope="module")
def proof(where, tmp_path_factory):
    """The model folder and the data files every command reads."""
    from fastrlhf.modeling.tiny import make_qwen2_on

    root = tmp_path_factory.mktemp(f"proof-{where}")
    shape = model_shape(where)
    model = make_qwen2_on(where, model_dtype(where), **shape)
    model.generation_config.eos_token_id = None  # completions run to max_new_tokens: a steady step size
    model.save_pretrained(root / "model")
    del model
    if where == "cuda":  # what this process keeps on the device counts in the runs' context (see run())
        torch.cuda.empty_cache()
    vocab, g = shape["vocab_size"], torch.Generator().manual_seed(0)

    def ids(n, lo=3, hi=vocab):
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    lines = {
        # Responses drawn from 64 tokens: even a random-init 1.5B model lowers its loss within a few steps.
        "sft": [{"prompt_ids": ids(24), "response_ids": ids(40, 100, 164)} for _ in range(16)],
        "pairs": [{"prompt_ids": ids(16), "chosen_ids": ids(24, 3, 200), "rejected_ids": ids(24, 300, 500)}
                  for _ in range(16)],
        "cls": [{"input_ids": ids(32, *((3, 200) if i % 2 else (300, 500))), "label": i % 2} for i in range(16)],
        "prompts": [{"prompt_ids": ids(16 + 8 * (i % 4)), "meta": {"target_token": 3}} for i in range(16)],
        # Held out (data.eval_path), drawn as the training lines: lengths that differ, so the evaluation's batches pad
        "sft-eval": [{"prompt_ids": ids(8 + 4 * i), "response_ids": ids(40 - 4 * i, 100, 164)} for i in range(6)],
        "pairs-eval": [{"prompt_ids": ids(8 + 2 * i), "chosen_ids": ids(24, 3, 200), "rejected_ids": ids(16, 300, 500)}
                       for i in range(6)],
    }
    for name, rows in lines.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, where, {}


def _config(root, name, where):
    cuda = where == "cuda"
    # GRPO with the HF engine checkpoints the first half of the layers only (model.checkpoint_layers): its run and
    # the plan's count of it against the measured peak.
    half = {"checkpoint_layers": model_shape(where)["num_layers"] // 2} if name == "grpo" else {}
    common = {"output_dir": str(root / name), "model": {"path": str(root / "model"), "dtype": "auto",
                                                        "gradient_checkpointing": True, **half,
                                                        **({"lora_r": 8} if "lora" in name else {})}}
    loop = {"save_final": False, "log_every": 1}
    if name.startswith("sft"):
        # sft-packed and rm-pairwise evaluate held-out lines (data.eval_path) at the steps EVAL_STEPS names
        held_out = {"eval_path": str(root / "sft-eval.jsonl")} if name == "sft-packed" else {}
        return "sft", {**common, "data": {"path": str(root / "sft.jsonl"), "max_len": 128, **held_out},
                       "trainer": {**loop, "max_steps": 8, "batch_size": 8, "lr": 1e-4 if cuda else 1e-2,
                                   "packing": name.endswith("packed"), "eval_every": 4},
                       "deepspeed": {"zero_stage": 2}}
    if name.startswith("rm"):
        kind = name.split("-")[1]
        held_out = {"eval_path": str(root / "pairs-eval.jsonl")} if kind == "pairwise" else {}
        return "rm", {**common, "kind": kind,
                      "data": {"path": str(root / ("pairs.jsonl" if kind == "pairwise" else "cls.jsonl")),
                               **held_out},
                      "trainer": {**loop, "max_steps": 4, "batch_size": 8, "lr": 1e-5 if cuda else 1e-3,
                                  "eval_every": 2},
                      "deepspeed": {"zero_stage": 2}}
    ppo, shared, vllm = name.startswith("ppo"), name == "grpo-shared", "vllm" in name
    # vLLM: in the trainer's process, asleep (CUDA) while the update runs; the stale-engine check stays on.
    engine = ({"engine": "vllm", "sleep": cuda} if vllm else {"engine": "hf", "max_logprob_mismatch": None})
    if vllm and name in ("ppo-vllm", "grpo-vllm-lora"):
        engine["enforce_eager"] = True  # no CUDA graph capture: one device call holds all four vLLM starts
    beside = name == "vllm-beside"  # tests/gpu/scripts/vllm_beside_actor.py: one large update, no reference
    return "train", {**common, "algorithm": "ppo" if ppo else "grpo",
                     **({"critic": {"path": None}} if ppo else {}),
                     "reward": {"function": "target_token"},
                     "data": {"prompts": str(root / "prompts.jsonl"), "max_prompt_len": 40},
                     # On the CPU a small bucket, so that the tiny model's sync takes several too.
                     "rollout": {**engine, "n": 4, "max_new_tokens": 64 if cuda else 8,
                                 **({} if cuda or not vllm else {"sync_bucket_bytes": 1 << 16})},
                     "trainer": {**loop, "max_steps": 3, "prompts_per_step": 8, "minibatch_size": 16,
                                 "grad_accum": 1 if beside else 2, "kl_coef": 0.0 if beside else 0.01,
                                 "lr": (1e-2 if cuda else 5e-2) if beside else 1e-6 if cuda else 1e-3,
                                 "packing": shared, "share_prompts": shared,
                                 # importance weights against the real engine: geometric-mean ratios masked
                                 # beyond [0.5, 2] (near 1 when the engine's logprobs are the trainer's)
                                 **({"tis_cap": 2.0, "tis_level": "geometric", "tis_mode": "mask", "tis_floor": 0.5}
                                    if name == "grpo-vllm" else {})},
                     # ZeRO-3 steps its optimizer once per sub_group_size (1e9) parameters: two sub-groups at
                     # 1.5B, so the tiny CPU model is split into several as well.
                     "deepspeed": {"zero_stage": 3 if ppo else 2,
                                   **({} if cuda or not ppo else
                                      {"extra": {"zero_optimization": {"sub_group_size": 10_000}}})}}


def run(proof, name):
    """Run ``name`` once per module (the plan tests read the RL runs' metrics); returns its config path
    and its metrics records."""
    root, where, done = proof
    if name not in done:
        command, raw = _config(root, name, where)
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        _launch(name, where, "--module", "fastrlhf", command, "--config", str(path))
        with open(root / name / "metrics.jsonl") as f:
            done[name] = (str(path), [json.loads(line) for line in f], this_process_on_the_device())
    return done[name]


def run_beside(proof) -> dict:
    """tests/gpu/scripts/vllm_beside_actor.py through the launcher on the ``vllm-beside`` config; its report."""
    root, where, done = proof
    if "vllm-beside" not in done:
        _, raw = _config(root, "vllm-beside", where)
        path, report = root / "vllm-beside.yaml", root / "vllm-beside.json"
        path.write_text(yaml.safe_dump(raw))
        script = os.path.join(os.path.dirname(__file__), "scripts", "vllm_beside_actor.py")
        _launch("vllm-beside", where, script, str(path), str(report))
        done["vllm-beside"] = json.loads(report.read_text())
    return done["vllm-beside"]


def _launch(name, where, *args) -> None:
    """``args`` under the DeepSpeed launcher on one device, which must exit 0 within 300 s."""
    started = time.perf_counter()
    rc, log = run_group([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port",
                         str(free_port()), *args], timeout=300, env=_env(where))
    # What a device call's cap must hold (-s shows it): the launcher, loads, engine start and steps.
    print(f"\n{name} on {where}: {time.perf_counter() - started:.0f} s through the launcher")
    assert rc == 0, log[-4000:]


def _env(where) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT")}
    env.update(FASTRLHF_DIST_TIMEOUT="120", FASTRLHF_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
    if where == "cpu":
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def needs_vllm(where) -> None:
    if where == "cuda" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not on this GPU machine: the second call of scripts/gpu_session.sh unpacks it")


def this_process_on_the_device() -> float:
    """GiB this test process holds on the GPU (its CUDA context and allocator, if an earlier test made them),
    read while no run is alive: the runs measure the device's used memory, which counts this process too."""
    if not torch.cuda.is_initialized():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GiB


def _finite(records, keys):
    for r in records:
        for k in keys:
            # metrics.jsonl writes a non-finite value as a number (NaN, Infinity): isfinite refuses it
            assert isinstance(r.get(k), (int, float)) and math.isfinite(r[k]), (k, r)


# The runs with data.eval_path: the steps whose records carry the held-out figures (trainer.eval_every, and the last)
EVAL_STEPS = {"sft-packed": [4, 8], "rm-pairwise": [2, 4]}


def _held_out(name, records, keys) -> list[dict]:
    """The records of ``name`` with eval/* figures, at EVAL_STEPS alone, each of ``keys`` finite (the evaluation's
    sums on the device, brought to the host in one read: fastrlhf.supervised.evaluation)."""
    evaluated = [r for r in records if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evaluated] == EVAL_STEPS.get(name, []), evaluated
    _finite(evaluated, keys)
    if evaluated:
        print(f"\n{name} held out on each evaluation: " + "; ".join(
            ", ".join(f"{k} {r[k]:.4f}" for k in keys) for r in evaluated))
    return evaluated


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft-padded", "sft-packed"])
def test_sft_lowers_its_loss(proof, name):
    _, records, _ = run(proof, name)
    assert [r["step"] for r in records] == list(range(1, 9))
    _finite(records, ("loss", "grad_norm"))
    losses = [r["loss"] for r in records]
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2, losses
    for r in _held_out(name, records, ("eval/loss", "eval/perplexity")):
        assert r["eval/perplexity"] == pytest.approx(math.exp(r["eval/loss"]), rel=1e-6), r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rm-pairwise", "rm-classifier"])
def test_rm_trains(proof, name):
    _, records, _ = run(proof, name)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    _finite(records, ("loss", "accuracy", "grad_norm"))
    for r in _held_out(name, records, ("eval/loss", "eval/accuracy", "eval/margin")):
        assert 0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/loss"] > 0, r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "ppo", "grpo-shared"])
def test_rl_trains(proof, name):
    _, records, _ = run(proof, name)
    assert [r["step"] for r in records] == [1, 2, 3]
    keys = ("reward_mean", "policy_loss", "grad_norm", "kl") + (("value_loss",) if name == "ppo" else ())
    _finite(records, keys)
    assert all(r["skipped"] == 0 for r in records), records


# The engine's logprobs against the actor's (mean |diff| per token): what a correct engine stays under (bf16 kernels
# on CUDA differ from the trainer's; fp32 on the CPU nearly not). A stale engine shows far more (mismatch_stale).
MISMATCH_MAX = {"cuda": 0.05, "cpu": 1e-3}
# The largest gap between the actor's top logprob and that of the engine's greedy token: a near-tie in bf16, none
# in fp32.
GREEDY_GAP_MAX = {"cuda": 0.1, "cpu": 1e-4}


@pytest.mark.slow
def test_vllm_beside_the_actor(proof):
    """vLLM in the trainer's process beside a ZeRO-2 actor (tests/gpu/scripts/vllm_beside_actor.py): logprobs
    against the actor's (and, with a repetition penalty and min-p, against transformers' processors), sleep's freed
    memory and wake's restored memory, the bucketed sync, then greedy output against HF's on the updated weights."""
    _, where, _ = proof
    needs_vllm(where)
    r = run_beside(proof)
    print(f"\nvLLM beside the actor on {where}: " + json.dumps(r))
    assert r["engine"] == "vllm" and r["generated_tokens"] == 8 * 4 * (64 if where == "cuda" else 8), r
    assert r["mismatch_before"] <= MISMATCH_MAX[where] and r["mismatch_after"] <= MISMATCH_MAX[where], r
    # The update moved the actor far enough that an engine left on the old weights would show (the checks have
    # power): its earlier logprobs and greedy tokens against the new actor.
    assert r["mismatch_stale"] > 5 * MISMATCH_MAX[where], r
    # rollout.repetition_penalty and min_p through vLLM's sampler: its logprobs are of the processed distribution,
    # nearer it than the plain one by far
    assert r["processed_gap_mean"] <= MISMATCH_MAX[where], r
    assert r["processed_plain_gap_mean"] > 4 * r["processed_gap_mean"], r
    assert r["greedy_changed_by_update"] > 0 and r["greedy_worst_gap_stale"] > GREEDY_GAP_MAX[where], r
    assert r["greedy_worst_gap"] <= GREEDY_GAP_MAX[where], r
    if where == "cpu":
        assert r["greedy_equal_hf"] == 1.0, r
    assert r["sync_buckets"] >= 2 and r["sync_bytes"] >= r["params"] * (2 if where == "cuda" else 4), r
    if where == "cuda":
        held = r["engine_weights_gib"] + r["kv_cache_gib"]
        assert r["sleep_mode"] and r["sleep_freed_gib"] >= 0.9 * held, r
        assert abs(r["wake_restored_gib"] - r["sleep_freed_gib"]) <= 0.05 * r["sleep_freed_gib"], r
        assert r["sync_loads_in_place"], r  # the Qwen2 model's sync is its own load_weights, not the generic reload
    else:  # the packed GEMM weights and the KV cache leave the resident set until the sync rewrites them
        assert r["sleep_freed_gib"] > 0 and r["wake_restored_gib"] > 0, r
    assert r["kv_cache_gib"] > 0, r  # vLLM says how many blocks it made (the CUDA bound above reads it)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo-vllm", "ppo-vllm", "grpo-vllm-lora"])
def test_rl_trains_with_vllm(proof, name):
    """GRPO on ZeRO-2, PPO with a critic on ZeRO-3 (the sync gathers each bucket's parameters) and GRPO with a LoRA
    actor (the sync merges the adapter), with ``rollout.engine: vllm`` in the trainer's process."""
    _, where, _ = proof
    needs_vllm(where)
    _, records, _ = run(proof, name)
    assert [r["step"] for r in records] == [1, 2, 3]
    keys = ("reward_mean", "policy_loss", "grad_norm", "logprob_mismatch_mean", "time/sync")
    _finite(records, keys + (("value_loss",) if name.startswith("ppo") else ()))
    assert all(r["skipped"] == 0 for r in records), records
    assert all(r["sync_bytes"] > 0 and r["sync_buckets"] >= 2 for r in records), records
    worst = max(r["logprob_mismatch_mean"] for r in records)
    # Printed (-s): the figures a GPU session's record gives, beside the bounds asserted here.
    print(f"\n{name} on {where}, per step: " + "; ".join(
        f"mismatch {r['logprob_mismatch_mean']:.4f}, sync {r['time/sync'] * 1e3:.0f} ms"
        + (f", tis weight {r['tis_weight_mean']:.4f}, outside {r['tis_outside_fraction']:.4f}"
           if "tis_weight_mean" in r else "") for r in records))
    assert worst <= MISMATCH_MAX[where], f"engine vs actor logprobs: {worst:.4f} nats per token"
    if name == "grpo-vllm":  # engine logprobs aligned with the trainer's tokens give ratios near 1, kept
        assert all(0.9 <= r["tis_weight_mean"] <= 1.1 and r["tis_outside_fraction"] <= 0.05 for r in records), [
            (r["tis_weight_mean"], r["tis_outside_fraction"]) for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "ppo", "grpo-vllm"])
def test_plan_against_the_measured_peak(proof, name):
    """With vLLM the plan counts the engine's weights and KV cache as well."""
    from fastrlhf.memory.plan import plan_memory
    from fastrlhf.memory.plan_command import load_plan_config

    _, where, _ = proof
    if "vllm" in name:
        needs_vllm(where)
    path, records, here = run(proof, name)
    config = load_plan_config(path, device=where)
    if where == "cuda":
        plan = plan_memory(config, 1, None, "cuda")
        reserved = max(r["memory/peak_reserved_gib"] for r in records)
        context = records[-1]["memory/context_gib"] - here
        measured = (reserved + context) * GiB
        def per_stage(suffix):
            return ", ".join(f"{stage} {max(r.get(key, 0.0) for r in records):.2f}" for stage in STAGES
                             if (key := f"memory/{stage}{suffix}") in records[-1])

        setup = ", ".join(f"{k[len('memory/setup_'):-len('_gib')]} {v:.2f}" for k, v in records[0].items()
                          if k.startswith("memory/setup_"))
        # Where the allocator's peak comes from (a stage, or the set-up's cache): read on the next GPU run.
        detail = (f"measured: allocator peak {reserved:.2f} GiB + context {context:.2f} GiB (the device's used "
                  f"memory beyond the allocator, less this test process's {here:.2f}); most allocated per "
                  f"stage: {per_stage('_gib')}; reserved per stage: {per_stage('_reserved_gib')}; allocator retries "
                  f"per stage: {per_stage('_alloc_retries')}; set-up: {setup}")
        low, high = GPU_BOUNDS
    else:
        plan = plan_memory(config, 1, 16 * 2**30, "cpu")
        measured = max(r["memory/peak_rss_gib"] for r in records) * GiB
        detail = f"measured: peak RSS {measured / GiB:.3f} GiB"
        low, high = CPU_BOUNDS
    ratio = plan.total / measured
    print(f"\n{name} on {where}:\n{plan.table()}\n{detail}\nplan / measured = {ratio:.3f}")
    assert low <= ratio <= high, f"plan {plan.total / GiB:.2f} GiB / measured {measured / GiB:.2f} GiB = {ratio:.3f}"
    if where == "cuda":
        # The scoring phase (no-grad forwards) is under the peak here; it must not be under what its stage
        # allocated: the held components (allocator slack and context included, which allocations do not
        # count) plus the phase bound it, within the plan's 5%. With vLLM the stage's figure leaves out the
        # sleeping engine's pool, which torch's counters keep (StepClock).
        phase = {p: sum(plan.components[c] for c in names) for p, names in plan.phases.items()}
        planned = plan.total - phase[plan.peak_phase] + phase["scoring"]
        scored = max(r["memory/score_gib"] for r in records) * GiB
        print(f"score stage: planned {planned / GiB:.2f} GiB, allocated {scored / GiB:.2f} GiB")
        assert scored <= planned * 1.05, (planned, scored)
