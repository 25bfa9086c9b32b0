"""The CPU benchmarks' contenders do the same work (benchmarks/e2e_*.py) and their figures carry a spread
(benchmarks/memory.py)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from benchmarks.e2e_common import WORKLOADS, prepare
from tests.helpers.cpubench_capture import ours_config, trl_args


@pytest.fixture(scope="module")
def doubling_files(tmp_path_factory):
    """Workload A's model folder (rotary positions, stretched to 1,024 for the other workloads' lengths) and
    prompts: what each trainer is configured with does not depend on the model."""
    work = str(tmp_path_factory.mktemp("cpubench"))
    files = prepare(work, WORKLOADS["A"])
    path = os.path.join(files["model_dir"], "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(config, max_position_embeddings=1024), f)
    return files


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_e2e_trainers_are_configured_alike(monkeypatch, tmp_path, doubling_files, workload):
    w = WORKLOADS[workload]
    spec = dict(w, **doubling_files, model="doubling", threads=2, out_dir=str(tmp_path / "out"))
    ours, trl = ours_config(monkeypatch, spec), trl_args(monkeypatch, spec)
    nproc, batch = w.get("nproc", 1), w["prompts_per_step"] * w["n"]
    # Gradient checkpointing recomputes each layer's forward in the backward: both or neither.
    assert ours.model.gradient_checkpointing == trl["gradient_checkpointing"], (workload, ours.model, trl)
    # One generation and one optimizer step per RL step, on-policy (no old-logprob pass) for both.
    assert ours.trainer.minibatch_size == batch
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] * nproc == batch
    assert trl["steps_per_generation"] == trl["gradient_accumulation_steps"] and trl["num_iterations"] == 1
    assert ours.trainer.max_steps == trl["max_steps"] == w["warmup"] + w["steps"]
    # Sampling, loss and optimizer knobs.
    assert ours.rollout.n == trl["num_generations"] and ours.rollout.max_new_tokens == trl["max_completion_length"]
    assert ours.rollout.temperature == trl["temperature"] == 1.0
    assert ours.trainer.lr == trl["learning_rate"] and ours.trainer.max_grad_norm == trl["max_grad_norm"]
    assert ours.trainer.kl_coef == trl["beta"] and ours.trainer.kl_kind == "k3"  # TRL's KL is k3
    assert ours.trainer.agg == "token-mean" and trl["loss_type"] == "dapo"
    assert ours.model.dtype == "float32" and not trl["bf16"] and not trl["fp16"]


VARIANT = textwrap.dedent("""
    import time

    def make_sleeper(pauses):
        left = list(pauses)

        def step():
            time.sleep(left.pop(0) if left else 0.0)

        return step
""")


def test_measure_reports_the_spread_of_the_runs(tmp_path):
    from benchmarks.memory import measure

    path = os.path.join(tmp_path, "variant.py")
    with open(path, "w") as f:
        f.write(VARIANT)
    # warm-up 0 s, then runs of 0.01, 0.25 and 0.05 s
    result = measure(path, "make_sleeper", {"pauses": [0.0, 0.01, 0.25, 0.05]}, threads=1, repeats=3, timeout_s=120)
    assert len(result["times_s"]) == 3
    assert result["time_s"] == pytest.approx(0.01, abs=0.05)
    assert result["time_s_median"] == pytest.approx(0.05, abs=0.05)
    assert result["time_s_max"] == pytest.approx(0.25, abs=0.1)
    assert result["time_s"] <= result["time_s_median"] <= result["time_s_max"]
