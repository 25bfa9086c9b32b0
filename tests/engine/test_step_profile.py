"""``trainer.profile_step``: the one step it names runs under torch.profiler and leaves its stages, its largest ops
and a timeline in ``output_dir/profile``; every other step runs as it would."""

from __future__ import annotations

import dataclasses
import gzip
import json
from types import SimpleNamespace

from helpers.rl_case import GRPO, PROMPTS, fixed_completions, guarded_step, make_config

from fastrlhf.engine import step_profile
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



def test_each_stage_says_what_the_host_did_in_it(tmp_path):
    summary = json.loads((_profiled(tmp_path, 2) / "step-2-rank-0.json").read_text())
    host = summary["host"]
    assert host.keys() == summary["stages"].keys(), host
    assert all(h["launches"] == h["syncs"] == h["allocs"] == 0 and h["sync_wait_ms"] == 0 for h in host.values()), host
    # completions given: the generate stage may hold no op
    assert all(host[stage]["ops"] > 0 for stage in ("score", "reward", "train")), host
    assert host["reward"]["ops"] <= host["score"]["ops"]  # nested in it
    assert summary["compiles"]["in_step"] == dict(frames=0, graphs=0, past_recompile_limit=0), summary["compiles"]


class _Event:
    def __init__(self, name, start, end, parent=None):
        self.name, self.cpu_parent, self.device_type = name, parent, None
        self.time_range = SimpleNamespace(start=start, end=end)


def test_syncs_launches_and_allocations_are_counted_in_the_stage_they_happen_in():
    """A GPU profile's host timeline, as the profiler names its calls: a sync's wait, and an allocation's, is
    counted where it starts, an op nested in another op is not counted again."""
    train = _Event("fastrlhf:train", 0, 100)
    mm = _Event("aten::mm", 10, 20)
    events = [_Event("fastrlhf:score", 100, 200), train, mm, _Event("aten::empty", 11, 12, parent=mm),
              _Event("cudaLaunchKernel", 13, 14, parent=mm), _Event("cudaStreamSynchronize", 50, 90),
              _Event("cudaMalloc", 15, 18, parent=mm), _Event("cudaFree", 91, 99),
              _Event("aten::item", 120, 130), _Event("cudaMemcpy", 121, 129), _Event("cudaMemcpyAsync", 150, 151)]
    got = step_profile._host_side(events)
    assert got == {"train": dict(ops=1, launches=1, syncs=1, sync_wait_ms=0.04, allocs=2, alloc_ms=0.011),
                   "score": dict(ops=1, launches=0, syncs=1, sync_wait_ms=0.008, allocs=0, alloc_ms=0.0)}, got


def test_a_step_that_compiles_says_so(tmp_path):
    """The profiled step's torch.compile work (a first call compiles; the same call again does not), so that a
    slow profiled step that was compiling is not read as a steady one."""
    import torch

    config = SimpleNamespace(output_dir=str(tmp_path), trainer=SimpleNamespace(profile_step=1))
    f = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")
    compiles = []
    for _ in range(2):
        with profile_step(config, 1):
            f(torch.ones(3))
        compiles.append(json.loads((tmp_path / "profile" / "step-1-rank-0.json").read_text())["compiles"])
    assert compiles[0]["in_step"]["frames"] >= 1 and compiles[0]["in_step"]["graphs"] == 1, compiles
    assert compiles[1]["in_step"] == dict(frames=0, graphs=0, past_recompile_limit=0), compiles
    assert compiles[1]["in_process"]["graphs"] >= 1, compiles


def _events(*rows):
    """torch's own ``FunctionEvent`` objects, linked as its profiler links them (a kernel listed in the ``kernels``
    of the host event it belongs to, by name and duration; torch 2.11's have no link id): rows of
    ``(name, start_us, end_us, where, linked_to)``, ``where`` one of ``op``, ``range``, ``kernel``, ``span`` (a
    range's span on the device timeline), ``linked_to`` the index of a host row."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    events = [FunctionEvent(id=i, name=name, thread=1, start_us=start, end_us=end, is_user_annotation=where in
                            ("range", "span"), device_type=DeviceType.CUDA if where in ("kernel", "span") else
                            DeviceType.CPU) for i, (name, start, end, where, _) in enumerate(rows)]
    for (name, start, end, _, linked_to) in rows:
        if linked_to is not None:
            events[linked_to].append_kernel(name, 0, end - start)
    return events


def test_a_stage_owns_the_kernels_it_launched_on_any_thread():
    """On an H100 the train stage read 9.5% busy: only the kernels of ops nested in the range on its own thread were
    counted, and the backward's ops run on autograd's thread. A kernel belongs to the stage its op was launched in,
    read from what torch 2.11's profiler builds as well as later ones."""
    events = _events(
        ("fastrlhf:train", 100, 200, "range", None),
        ("fastrlhf:score", 300, 400, "range", None),
        ("aten::mm", 110, 112, "op", None),               # 2: the forward, in the range's thread
        ("nvjet_forward", 150, 170, "kernel", 2),          # 20 us
        ("aten::mm", 180, 182, "op", None),               # 4: the backward, on autograd's thread
        ("nvjet_backward", 205, 245, "kernel", 4),         # 40 us, run after the range closed
        ("aten::mm", 250, 252, "op", None),               # 6: after the stage
        ("nvjet_forward", 310, 330, "kernel", 6),          # the same kernel as the first, run in the next stage
        ("graph_kernel", 120, 130, "kernel", None),        # linked to no op (a graph's replay): 10 us
        ("nvjet_forward", 160, 180, "kernel", None),       # the same name and time as a linked one, but linked to none
        ("fastrlhf:train", 100, 200, "span", 0),           # the range's span on the device, listed under the range
    )
    stages = step_profile._stages(events, cuda=True)
    assert stages["train"] == dict(calls=1, wall_ms=0.1, device_ms=0.09, busy=0.9), stages
    assert stages["score"] == dict(calls=1, wall_ms=0.1, device_ms=0.0, busy=0.0), stages
    assert step_profile._stages(events, cuda=False)["train"] == dict(calls=1, wall_ms=0.1, device_ms=None, busy=None)
