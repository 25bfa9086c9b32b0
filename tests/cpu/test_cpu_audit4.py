"""Audit of the CPU-only machinery (fastrlhf/cpu): its isolation from GPU runs, and its fast paths against the
generic ones on this CPU, on the CPUs CI may run on instead, and across ranks.

- Isolation: no module reaches ``fastrlhf.cpu`` by a module name in a string (``importlib.import_module``,
  ``__import__``), which the import scans of test_cpu_isolation.py do not see; the switch answers None for every
  spelling of a CUDA device and for a machine with CUDA.
- The packing kernel is built with ``$CC`` as make reads it: a launcher or flags in it (``ccache gcc``,
  ``gcc -m64``) are words of the command, not the name of a compiler that does not exist.
- Other CPUs, as oneDNN sees them under ``ONEDNN_MAX_CPU_ISA`` (AVX2 without AVX-512, as on many CI machines;
  AVX-512 without bf16; AVX): wherever the probe and the shape's own check allow an in-place packed weight, its
  GEMM gives bitwise what torch's oneDNN linear gives on the weight it packs itself, and where oneDNN packs a shape
  otherwise (AVX2 packs a (192, 64) fp32 weight in panels of 16, not the probe's 64) none is offered.
- ZeRO 1-2 with the master partition shared (``zero_master``), on two ranks with their own data and a padded last
  partition, trains and resumes bitwise as DeepSpeed's own cloned master does (test_zero_master.py: one rank).
"""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.launch import run_group
from helpers.paths import ROOT

from fastrlhf.cpu import probe
from fastrlhf.cpu.packed_linear import PackingUnavailable, build_pack_kernel

SWITCH = "fastrlhf/engine/platform.py"
_DYNAMIC_IMPORTS = {"import_module", "__import__", "find_spec"}


def _python_files(*folders):
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    yield path, os.path.relpath(path, ROOT).replace(os.sep, "/")


def _string_imports_of_the_cpu_package(source: str) -> list[int]:
    """The lines where ``source`` imports a ``fastrlhf.cpu`` module by a name in a string."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        func = getattr(node, "func", None)
        name = getattr(func, "attr", getattr(func, "id", None))
        if isinstance(node, ast.Call) and name in _DYNAMIC_IMPORTS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("fastrlhf.cpu"):
                lines.append(node.lineno)
    return lines


def test_no_module_imports_the_cpu_package_by_a_name_in_a_string():
    sample = 'import importlib\nimportlib.import_module("fastrlhf.cpu.probe")\nm = __import__("fastrlhf.cpu")\n'
    assert _string_imports_of_the_cpu_package(sample) == [2, 3]  # the scan sees what it looks for
    offenders = []
    for path, rel in _python_files("fastrlhf", "kernels"):
        if not rel.startswith("fastrlhf/cpu/") and rel != SWITCH:
            offenders += [f"{rel}:{line}" for line in _string_imports_of_the_cpu_package(open(path).read())]
    assert offenders == [], f"import fastrlhf.cpu only through fastrlhf.engine.platform.cpu_tools: {offenders}"


def test_the_switch_answers_none_for_every_cuda_device(monkeypatch):
    from fastrlhf.engine.platform import cpu_tools

    for device in ("cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 3)):
        assert cpu_tools(device) is None, device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_tools() is None  # the machine decides where no device is named: a GPU run
    assert cpu_tools("cpu") is not None  # a run that names the CPU gets it even there


@pytest.mark.parametrize("extra", ["-std=gnu99", "-O0"])
def test_a_cc_with_flags_builds_the_kernel(monkeypatch, extra):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("CC", f"{compiler} {extra}")  # as make, setuptools and CI images spell it
    kernel, isa = build_pack_kernel(("-O3",))
    assert kernel is not None and isa in ("avx", "scalar")


def test_an_empty_cc_means_the_default_compiler(monkeypatch):
    if shutil.which("cc") is None:
        pytest.skip("no cc on this machine")
    monkeypatch.setenv("CC", "")
    assert build_pack_kernel(("-O3",))[1] in ("avx", "scalar")


def test_the_probe_names_a_cc_it_cannot_split(monkeypatch):
    monkeypatch.setenv("CC", "gcc 'unclosed")
    with pytest.raises(PackingUnavailable, match="no C compiler"):
        build_pack_kernel(("-O3",))


def _isa_cases(isa: str) -> tuple[str, list[list[str]]]:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "PYTHONPATH": os.path.join(ROOT, "tests")}
    env.pop(probe.FORCE_ENV, None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "helpers", "cpu4_isa_check.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("SUMMARY "))
    return summary, [line.split()[1:] for line in lines if line.startswith("CASE ")]


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2", "AVX512_CORE", "AVX"])
def test_in_place_packed_weights_are_onednns_own_on_other_cpus(isa):
    summary, cases = _isa_cases(isa)
    assert len(cases) == 16, cases
    for dtype, n, k, in_place, *rest in cases:
        name = dtype.removeprefix("torch.")
        if f"{name} repacked by vLLM" in summary:
            assert in_place == "False", (isa, summary, dtype, n, k)  # the probe said no: nothing offered
        if in_place == "True":
            bitwise, linear = float(rest[1]), float(rest[3])
            assert bitwise == 0.0, (isa, dtype, n, k, bitwise)
            assert linear < (1e-3 if name == "float32" else 1.0), (isa, dtype, n, k, linear)


@pytest.mark.slow
def test_zero_master_on_two_ranks_trains_and_resumes_as_deepspeeds_own(tmp_path):
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "tests", "helpers", "cpu4_zero_ranks.py"),
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests"), "CUDA_VISIBLE_DEVICES": ""}
    code, out = run_group(argv, timeout=600, env=env)
    assert code == 0, out[-4000:]
    # The ranks share the launcher's stdout: their lines may run into each other.
    found = sorted(
        set(
            re.findall(
                r"STAGE (\d) RANK (\d) SHARED_BYTES (\d+) MOVED (\w+) MAX_DIFF (nan|inf|[\d.e+-]+) "
                r"RESUME_DIFF (nan|inf|[\d.e+-]+)",
                out,
            )
        )
    )
    assert [f[:2] for f in found] == [("1", "0"), ("1", "1"), ("2", "0"), ("2", "1")], out[-4000:]
    for stage, rank, shared, moved, diff, resume_diff in found:
        assert int(shared) > 0 and moved == "True", (stage, rank, shared, moved)
        assert float(diff) == 0.0 and float(resume_diff) == 0.0, (stage, rank, diff, resume_diff)


def test_the_adapters_cpu_only_calls_do_nothing_on_a_gpu(monkeypatch):
    """Every caller guards them with ``not on_cuda`` today; one that did not got an AttributeError of None."""
    from fastrlhf.engine import platform
    from fastrlhf.rollout import vllm_adapter

    monkeypatch.setattr(platform, "cpu_tools", lambda device=None: None)
    assert vllm_adapter.release_embedding_pack(object()) is False
    assert vllm_adapter.share_input_embedding(object(), None) == 0
    assert vllm_adapter.release_for_update(object()) == 0
