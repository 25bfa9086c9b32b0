"""scripts/gpu_session.sh, the device calls of a lent GPU session, run here with stand-ins: its own logic (which
tests and benchmarks each call selects, vLLM unpacked only once both parts arrived, the caps) cannot wait for a GPU
to be checked, and a mistake in it costs a session's whole device time."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from helpers.paths import ROOT

PYTHON_STUB = """#!/usr/bin/env bash
# python3 on the "device": records its arguments (and the race's runs and budget); sleeps where asked (the cap's test);
# fails where its arguments hold STUB_FAIL; imports answer.
echo "$*${FASTRLHF_RACE_RUNS:+ runs=$FASTRLHF_RACE_RUNS}${FASTRLHF_RACE_BUDGET_S:+ budget=$FASTRLHF_RACE_BUDGET_S}" \
  >> "$OUT/calls.txt"
case "$*" in
  *"-c "*) echo "stub: $*" ;;
  *"${STUB_FAIL:-no such call}"*) echo "1 failed"; exit 1 ;;
  *) [ -n "${STUB_SLEEP:-}" ] && sleep "$STUB_SLEEP"
     # a race keeps its profiled step's timeline where the script asks
     case "$*" in
       *benchmarks/gpu*) mkdir -p "$FASTRLHF_RACE_TRACES" && echo t > "$FASTRLHF_RACE_TRACES/run.trace" ;;
     esac
     echo "1 passed" ;;
esac
"""
UNPACK_STUB = """#!/usr/bin/env bash
# As vllm_carry.sh's: exits 3 while one of its parts (STUB_PARTS: two, or HOPPER_ONLY's one) is missing here.
cd "$(dirname "$0")"
for p in ${STUB_PARTS:-part-aa part-ab}; do [ -f "$p" ] || exit 3; done
echo unpack >> "$OUT/calls.txt"
mkdir -p "$VSITE" && echo 'export STUB_VLLM=1' > "$VSITE/env.sh"
"""


def _exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def device(tmp_path):
    """A checkout as the GPU machine sees it: the script, .gpu-carry (its on_device.sh puts stand-ins for python3
    and nvidia-smi first on PATH) and .vllm-carry's unpack.sh; returns (root, run)."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "gpu_session.sh"), root / "scripts")
    stubs = tmp_path / "stubs"
    _exe(stubs / "python3", PYTHON_STUB)
    # nvidia-smi: the device's line, or for --query-compute-apps the pids in STUB_GPU_PIDS (one per line)
    _exe(stubs / "nvidia-smi", "#!/usr/bin/env bash\ncase \"$*\" in\n"
                               "  *compute-apps*) echo \"${STUB_GPU_PIDS:-}\" | tr ',' '\\n' ;;\n"
                               "  *) echo 'NVIDIA H100 80GB HBM3, 81559 MiB, 580.0' ;;\nesac\n")
    (root / ".gpu-carry").mkdir()
    (root / ".gpu-carry" / "on_device.sh").write_text(f"export PATH={stubs}:$PATH\n")
    _exe(root / ".vllm-carry" / "unpack.sh", UNPACK_STUB)
    out = tmp_path / "out"

    def run(*args, **env):  # the calls of this run, less the import checks (`python3 -c`)
        (out / "calls.txt").unlink(missing_ok=True)
        result = subprocess.run(["bash", "scripts/gpu_session.sh", *args], cwd=root, capture_output=True, text=True,
                                timeout=60, env={**os.environ, "OUT": str(out), "VSITE": str(tmp_path / "vsite"),
                                                 "VPARTS": str(tmp_path / "vparts"),
                                                 "TRL_SITE": str(tmp_path / "trl" / "site-packages"),
                                                 "FASTRLHF_RACE_TRACES": str(tmp_path / "traces"), **env})
        calls = (out / "calls.txt").read_text().splitlines() if (out / "calls.txt").exists() else []
        calls = [c for c in calls if not c.startswith("-c ")]
        return result.returncode, result.stdout + result.stderr, calls

    return root, run


def test_the_first_call_runs_the_proof_without_vllm(device):
    _, run = device
    rc, log, calls = run("tests")
    assert rc == 0, log
    (pytest_call,) = [c for c in calls if "pytest" in c]
    assert "-m gpu tests/gpu" in pytest_call and "-k not vllm" in pytest_call, pytest_call
    assert "unpack" not in calls and "test-gpu exit 0" in log
    # A K picks some of them, still without vLLM's
    rc, log, calls = run("tests", "200", "update_syncs or compile")
    (pytest_call,) = [c for c in calls if "pytest" in c]
    assert rc == 0 and "-k not vllm and (update_syncs or compile)" in pytest_call, pytest_call


def test_vllm_is_unpacked_only_once_both_parts_arrived_then_its_tests_run(device):
    root, run = device
    (root / ".vllm-carry" / "part-aa").write_bytes(b"a")
    rc, log, calls = run("vllm")
    # The call that delivers one part reads the probes (seconds) and spends nothing else.
    assert rc == 1 and "carry the other part next" in log and calls == ["scripts/gpu_probe.py"], (log, calls)
    # The next call's checkout holds only what it carried (the device tool removes the rest): part-ab.
    (root / ".vllm-carry" / "part-aa").unlink()
    (root / ".vllm-carry" / "part-ab").write_bytes(b"b")
    rc, log, calls = run("vllm", "300")
    assert rc == 0, log
    assert calls[0] == "unpack" and "-m gpu tests/gpu" in calls[1] and "-k vllm" in calls[1], calls
    # Then the race vLLM against HF, in the time the call's cap leaves (no smoke: the tests passed).
    assert "benchmarks/gpu" in calls[-1] and "-k vllm_vs_hf" in calls[-1], calls
    assert 250 < int(calls[-1].rsplit("budget=", 1)[1]) <= 300 and len(calls) == 3, calls
    rc, log, calls = run("vllm", "200")  # the same machine: vLLM is there, not unpacked again
    assert rc == 0 and calls[0].startswith("-m pytest -m gpu tests/gpu") and len(calls) == 1, (log, calls)
    assert "next call, vllm-bench" in log, log  # a race that cannot fit is left to the next call
    rc, log, calls = run("vllm-bench", "230")
    assert rc == 0 and "unpack" not in calls, (log, calls)
    assert "-k vllm_vs_hf" in calls[-1] and calls[-1].endswith("budget=230"), calls


def test_the_first_vllm_call_with_a_cap_runs_the_races_hf_half_and_the_next_its_vllm_half_first(device):
    """HF generate needs no vLLM: the call that delivers one part spends its cap on the race's HF run (the
    baseline, on the same warm machine); the next call runs the vLLM run first, then the tests, and no whole race."""
    root, run = device
    (root / ".vllm-carry" / "part-aa").write_bytes(b"a")
    hf_json = root / "benchmarks" / "results" / "gpu" / "partial" / "bench-hf.json"
    hf_json.parent.mkdir(parents=True)
    hf_json.write_text('{"extra_info": {"fastrlhf_hf_step_s": 15.0}}')  # what the stand-in race "measured"
    rc, log, calls = run("vllm", "200")
    assert calls[0] == "scripts/gpu_probe.py" and "-k vllm_vs_hf" in calls[1], calls
    assert calls[1].endswith("runs=fastrlhf_hf budget=200") and len(calls) == 2, calls
    (root / ".vllm-carry" / "part-aa").unlink()
    (root / ".vllm-carry" / "part-ab").write_bytes(b"b")
    rc, log, calls = run("vllm", "400", "vllm and not ppo-vllm")
    assert rc == 0 and calls[0] == "unpack", (log, calls)
    assert "-k vllm_vs_hf" in calls[1] and "runs=fastrlhf_vllm budget=" in calls[1], calls
    assert 200 < int(calls[1].rsplit("budget=", 1)[1]) <= 240, calls
    assert "-k vllm and not ppo-vllm" in calls[2] and len(calls) == 3, calls


def test_a_first_call_whose_hf_run_failed_leaves_the_whole_race_to_the_next(device):
    root, run = device
    (root / ".vllm-carry" / "part-aa").write_bytes(b"a")
    run("vllm", "200")  # the stand-in writes no figures: the HF run did not finish
    (root / ".vllm-carry" / "part-ab").write_bytes(b"b")
    rc, log, calls = run("vllm", "560")
    # the whole race: the benchmark's own runs (both), not a list of the script's
    assert "-k vllm" in calls[1] and "-k vllm_vs_hf" in calls[2] and "runs=" not in calls[2] and len(calls) == 3, calls


def test_a_one_part_vllm_carry_unpacks_in_its_first_call(device):
    """vllm_carry.sh's HOPPER_ONLY=1 makes one part (43 MiB, beside .gpu-carry's 15): vLLM's tests run in the
    call that carries it, and the next call finds vLLM unpacked."""
    root, run = device
    (root / ".vllm-carry" / "part-aa").write_bytes(b"a")
    rc, log, calls = run("vllm", "300", STUB_PARTS="part-aa")
    assert rc == 0 and calls[0] == "unpack" and "-k vllm" in calls[1], (log, calls)
    (root / ".vllm-carry" / "part-aa").unlink()
    rc, log, calls = run("vllm-bench", "200", STUB_PARTS="part-aa")
    assert "unpack" not in calls and "-k vllm_vs_hf" in calls[-1], (log, calls)


def test_a_bench_call_delivers_the_first_vllm_part_for_the_vllm_call_after_it(device):
    """A session's first call can measure issue #43's benchmarks while it brings part-aa: the `vllm` call after it
    carries part-ab alone and unpacks both."""
    root, run = device
    (root / ".vllm-carry" / "part-aa").write_bytes(b"a")
    rc, log, calls = run("bench", "200", "lm_head")
    assert rc == 0 and "-k lm_head" in calls[0] and "unpack" not in calls and len(calls) == 1, (log, calls)
    assert "vLLM parts kept for the next call: part-aa unpack.sh" in log, log
    (root / ".vllm-carry" / "part-aa").unlink()
    (root / ".vllm-carry" / "unpack.sh").unlink()  # that call carries part-ab and nothing else of vLLM's
    (root / ".vllm-carry" / "part-ab").write_bytes(b"b")
    rc, log, calls = run("vllm", "300", "ppo-vllm")
    assert rc == 0 and calls[0] == "unpack" and "-k ppo-vllm" in calls[1], (log, calls)


def test_failed_vllm_tests_are_followed_by_the_engine_alone_then_the_race(device):
    root, run = device
    for part in ("part-aa", "part-ab"):
        (root / ".vllm-carry" / part).write_bytes(b"x")
    rc, log, calls = run("vllm", STUB_FAIL="tests/gpu")
    assert [c.split()[0] for c in calls] == ["unpack", "-m", ".gpu-carry/vllm_smoke.py", "-m"], calls
    assert "test-gpu-vllm exit 1" in log and "-k vllm_vs_hf" in calls[-1], log


def test_the_races_timelines_come_back_as_one_archive(device, tmp_path):
    import tarfile

    _, run = device
    rc, log, _ = run("bench", "30", "lm_head")
    assert rc == 0 and "timelines: traces-bench.tgz" in log, log
    with tarfile.open(tmp_path / "out" / "traces-bench.tgz") as tar:
        assert "./run.trace" in tar.getnames()


def test_a_call_past_its_cap_is_stopped_and_said(device):
    _, run = device
    rc, log, _ = run("bench", "1", STUB_SLEEP="5")
    assert "bench-gpu exit 124 after" in log, log


def test_what_a_cut_command_left_on_the_gpu_is_killed(device):
    """The launcher's ranks outlive the pytest that timeout kills: their memory would be the next call's."""
    _, run = device
    rank = subprocess.Popen(["sleep", "60"])  # a rank still holding the GPU
    try:
        rc, log, _ = run("bench", "1", STUB_SLEEP="5", STUB_GPU_PIDS=str(rank.pid))
        assert f"killing {rank.pid}" in log and rank.wait(timeout=10) == -9, log
        other = subprocess.Popen(["sleep", "60"])
        try:  # a command that ends in time leaves the GPU's processes alone
            rc, log, _ = run("bench", "30", STUB_GPU_PIDS=str(other.pid))
            assert "killing" not in log and other.poll() is None, log
        finally:
            other.kill()
            other.wait(timeout=10)  # reaped: no zombie left for the rest of the session
    finally:
        rank.kill()
        rank.wait(timeout=10)


def test_an_unknown_call_says_which_there_are(device):
    _, run = device
    rc, log, _ = run("all")
    assert rc == 2 and "usage:" in log and "vllm-bench" in log, log


def test_the_trl_call_unpacks_trl_from_beside_gpu_carry(device, tmp_path):
    """TRL's archive lives in .trl-carry, not in .gpu-carry (which every call carries, beside a 38 MiB vLLM
    part); without it the call says TRL's races are skipped and still runs the vLLM-vs-TRL selection."""
    import tarfile

    root, run = device
    for part in ("part-aa", "part-ab"):
        (root / ".vllm-carry" / part).write_bytes(b"x")
    rc, log, calls = run("trl")
    race, hf_race = calls[-2:]
    assert "TRL's races are skipped" in log and race.split(" -k ")[1].startswith("vllm_vs_trl "), (log, calls)
    assert 560 <= int(race.rsplit("budget=", 1)[1]) <= 570, calls  # the race ends its runs before the call's cap
    assert " -k grpo_step_vs_trl " in hf_race, calls  # then the HF-engine race, in the time left
    (tmp_path / "src" / "trl").mkdir(parents=True)
    (tmp_path / "src" / "trl" / "marker.py").write_text("")
    (root / ".trl-carry").mkdir()
    with tarfile.open(root / ".trl-carry" / "trl-site.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "src" / "trl", arcname="trl")
    rc, log, calls = run("trl")
    assert (tmp_path / "trl" / "site-packages" / "trl" / "marker.py").exists() and "skipped" not in log, log
    (race,) = [c for c in calls if "-k vllm_vs_trl" in c]
    assert " runs=" not in race, calls  # the benchmark's own runs
    rc, log, calls = run("trl", "400", "fastrlhf_vllm,fastrlhf_vllm_shared,trl_vllm")  # the runs named
    (race,) = [c for c in calls if "-k vllm_vs_trl" in c]
    assert "runs=fastrlhf_vllm,fastrlhf_vllm_shared,trl_vllm budget=" in race and rc == 0, (log, calls)


def test_the_session_log_is_whole_when_the_call_ends(device, tmp_path):
    """The log's tee writes after the script's own lines: a call that ended before it had left $OUT a log without
    its last lines. A tee that starts late (a slow machine) must still have written them all when the call ends,
    even with the script's output going to a file (the device call's), not to a pipe that waits for the tee."""
    root, _ = device
    slow = tmp_path / "slow-tee"
    _exe(slow / "tee", f"#!/usr/bin/env bash\nsleep 2\nexec {shutil.which('tee')} \"$@\"\n")
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{slow}:{os.environ['PATH']}", "OUT": str(out),
           "FASTRLHF_RACE_TRACES": str(tmp_path / "traces"), "VPARTS": str(tmp_path / "vparts")}
    result = subprocess.run(["bash", "scripts/gpu_session.sh", "tests", "30"], cwd=root, env=env, timeout=60,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert result.returncode == 0
    assert (out / "session-tests.log").read_text().splitlines()[-1].startswith("== done"), out
