"""``trainer.profile_step``: the one step it names runs under torch.profiler and leaves its stages, its largest ops
and a timeline in ``output_dir/profile``; every other step runs as it would."""

from __future__ import annotations

import dataclasses
import gzip
import json

from helpers.rl_case import GRPO, PROMPTS, fixed_completions, guarded_step, make_config

from fastrlhf.engine.step_profile import profile_step


def _profiled(tmp_path, profile: int | None):
    hp = make_config(GRPO)
    hp = dataclasses.replace(hp, output_dir=str(tmp_path),
                             trainer=dataclasses.replace(hp.trainer, profile_step=profile))
    rl, actor, _ = guarded_step(hp)
    for step in (1, 2):
        completions = fixed_completions(actor, hp.rollout.temperature)  # sampled from this step's weights
        with profile_step(hp, step, rank=0):
            metrics = rl(PROMPTS, None, step=step, completions=completions)
        assert metrics["skipped"] == 0.0
    return tmp_path / "profile"


def test_the_named_step_is_profiled_by_stage(tmp_path):
    folder = _profiled(tmp_path, 2)
    assert sorted(p.name for p in folder.iterdir()) == ["step-2-rank-0.json", "step-2-rank-0.trace.json.gz"]
    summary = json.loads((folder / "step-2-rank-0.json").read_text())
    assert summary["step"] == 2 and summary["device"] == "cpu" and summary["profile_of"] == "CPU ops (self time)"
    stages = summary["stages"]
    # the RL step's stages as StepClock marks them (completions given: no generation), each timed
    assert {"score", "reward", "train"} <= stages.keys(), stages
    assert all(s["wall_ms"] > 0 and s["calls"] >= 1 and s["device_ms"] is None for s in stages.values()), stages
    assert stages["reward"]["wall_ms"] <= stages["score"]["wall_ms"]  # nested in it
    top = summary["profile_top"]
    assert len(top) == 20 and all(not name.startswith("fastrlhf:") for name, *_ in top)
    assert sum(share for *_, share in top) <= 1.0 and 0 < summary["profile_gemm_share"] < 1
    assert any("mm" in name for name, *_ in top)  # the model's GEMMs are among the largest ops
    trace = json.loads(gzip.open(folder / "step-2-rank-0.trace.json.gz").read())
    assert any(e.get("name") == "fastrlhf:train" for e in trace["traceEvents"])


def test_other_steps_are_not_profiled(tmp_path):
    assert not _profiled(tmp_path, 7).exists()

