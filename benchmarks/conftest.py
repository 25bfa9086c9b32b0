"""Collects every benchmark's ``extra_info`` and prints one table per benchmark module at the end.

Generic on purpose: any test in ``benchmarks/`` that uses the ``benchmark`` fixture gets a row
with whatever scalar ``extra_info`` it recorded (times, peak memory, ratios against a baseline).
The table of ``benchmarks/test_bench_<name>.py`` is also written as markdown to
``benchmarks/results/<name>.md``.
"""

from __future__ import annotations

import os

import pytest

_RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_rows: dict[str, list[tuple[str, dict]]] = {}


@pytest.fixture(autouse=True)
def _collect_extra_info(request):
    # Asked for before the test runs so that the benchmark fixture is torn down after this one.
    bench = request.getfixturevalue("benchmark") if "benchmark" in request.fixturenames else None
    yield
    info = bench.extra_info if bench is not None else None
    if info:
        module = os.path.splitext(os.path.basename(str(request.node.fspath)))[0]
        _rows.setdefault(module, []).append((request.node.name, dict(info)))


def _table(rows: list[tuple[str, dict]]) -> list[str]:
    keys: list[str] = []
    for _, info in rows:
        keys += [k for k, v in info.items() if k not in keys and isinstance(v, (int, float, str))]
    lines = ["| benchmark | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, info in rows:
        lines.append(f"| {name} | " + " | ".join(str(info.get(k, "")) for k in keys) + " |")
    return lines


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    os.makedirs(_RESULTS_DIR, exist_ok=True)
    for module, rows in sorted(_rows.items()):
        lines = _table(rows)
        terminalreporter.write_sep("-", f"{module}: extra_info")
        for line in lines:
            terminalreporter.write_line(line)
        name = module.removeprefix("test_bench_").removeprefix("test_")
        path = os.path.join(_RESULTS_DIR, f"{name}.md")
        with open(path, "w") as f:
            f.write(f"# Benchmark results: {module}\n\n" + "\n".join(lines) + "\n")
        terminalreporter.write_line(f"written to {os.path.relpath(path)}")
