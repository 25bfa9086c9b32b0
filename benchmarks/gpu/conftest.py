"""``make bench-gpu``: the CUDA skip, the device record of every benchmark, and where the figures go.

``benchmarks/conftest.py`` (a parent folder) would put these figures into the CPU tables
(``benchmarks/results/<name>.md`` and ``RESULTS.md``, headed by the CPU model). Its ``_collect_extra_info``
fixture is overridden here, so that rows of ``benchmarks/gpu`` are written to
``benchmarks/results/gpu/bench-gpu.md`` instead (a run of some tests only: ``results/gpu/partial/``), next to
the pytest-benchmark JSON that the ``make bench-gpu`` command line names.
"""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch

NO_CUDA = "needs a CUDA device: run `make bench-gpu` on a GPU machine"
RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "gpu")
_rows: list[tuple[str, dict]] = []


def device_info() -> dict:
    """What every record carries: the device and the versions that decide its speed."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {"device": torch.cuda.get_device_name(), "torch_version": torch.__version__,
            "triton_version": triton_version, "cuda_version": torch.version.cuda}


@pytest.fixture
def gpu_benchmark(request):
    """The ``benchmark`` fixture on a CUDA device, its ``extra_info`` starting with :func:`device_info`; its
    figures are collected for ``bench-gpu.md``. Skipped without CUDA (the fixture is asked for only then, so
    pytest-benchmark does not warn about a fixture the skipped test never used)."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 would run the kernels interpreted on the GPU: use `make bench-gpu`")
    benchmark, info = request.getfixturevalue("benchmark"), device_info()
    benchmark.extra_info.update(info)
    yield benchmark
    if set(benchmark.extra_info) - set(info):  # it measured something
        _rows.append((request.node.name, dict(benchmark.extra_info)))


@pytest.fixture(autouse=True)
def _collect_extra_info():
    """Replaces ``benchmarks/conftest.py``'s collector in this folder: these rows go to ``results/gpu/``."""
    yield


def _out_dir(config) -> str:
    partial = bool(config.option.keyword or config.option.markexpr
                   or any("::" in str(a) for a in config.invocation_params.args))
    path = os.path.join(RESULTS_DIR, "partial") if partial else RESULTS_DIR
    os.makedirs(path, exist_ok=True)
    return path


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    config = terminalreporter.config
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    first = _rows[0][1]
    lines = ["# GPU benchmark results (`make bench-gpu`)", "",
             f"- device: {first.get('device')}; torch {first.get('torch_version')}, triton "
             f"{first.get('triton_version')}, CUDA {first.get('cuda_version')}; Python {sys.version.split()[0]}",
             f"- finished {now}; command: `pytest {' '.join(config.invocation_params.args)}`", ""]
    for name, info in _rows:
        lines += [f"## {name}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in info.items() if isinstance(v, (int, float, str, bool)) or v is None]
        lines.append("")
        for key, rows in info.items():  # a time-by-kernel profile (timing.profile_kernels): its own table
            if key.endswith("profile_top") and rows:
                lines += [f"{key}:", "", "| kernel | calls | ms | share |", "|---|---|---|---|"]
                lines += [f"| `{name}` | {calls} | {ms} | {share:.1%} |" for name, calls, ms, share in rows]
                lines.append("")
            if key.endswith("profile_stages") and rows:  # a profiled step's stages (trainer.profile_step)
                lines += [f"{key}:", "", "| stage | calls | wall ms | device ms | busy |", "|---|---|---|---|---|"]
                lines += [f"| {stage} | {s['calls']} | {s['wall_ms']} | {s['device_ms']} | {s['busy']} |"
                          for stage, s in rows.items()]
                lines.append("")
    path = os.path.join(_out_dir(config), "bench-gpu.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    terminalreporter.write_sep("-", "GPU benchmarks")
    for line in lines:
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"written to {os.path.relpath(path)}")
