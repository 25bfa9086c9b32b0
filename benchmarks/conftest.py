"""Collects every benchmark's ``extra_info`` and prints one table per benchmark module at the end.

Generic on purpose: any test in ``benchmarks/`` that uses the ``benchmark`` fixture gets a row
with whatever scalar ``extra_info`` it recorded (times, peak memory, ratios against a baseline).
The table of ``benchmarks/test_bench_<name>.py`` is also written as markdown to
``benchmarks/results/<name>.md`` and its rows as ``benchmarks/results/<name>.json``; a partial run
(``-k``, ``-m``, node ids) writes to ``benchmarks/results/partial/`` instead, so it cannot clobber a
full run's figures.

``benchmarks/results/RESULTS.md`` then collects every module's rows found in ``results/*.json``
(this run's and, for modules this run did not touch, the last run's, marked with their date) into
one table, one line per figure, under a header naming the machine, the load and the command.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import pytest

_RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_rows: dict[str, list[tuple[str, dict]]] = {}
_session: dict = {}


def pytest_deselected(items):
    _session["partial"] = True


def _partial_run(config) -> bool:
    """A run of some tests only (-k, -m, node ids): its figures must not replace a full run's."""
    return bool(_session.get("partial") or config.option.keyword or config.option.markexpr
                or any("::" in str(a) for a in config.invocation_params.args))


def _out_dir(config) -> str:
    """``results/``, or ``results/partial/`` in a partial run (created)."""
    path = os.path.join(_RESULTS_DIR, "partial") if _partial_run(config) else _RESULTS_DIR
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def results_dir(request) -> str:
    """Where a benchmark writes extra files (see ``_out_dir``)."""
    return _out_dir(request.config)


def pytest_sessionstart(session):
    _session["start"] = datetime.datetime.now(datetime.timezone.utc)
    _session["load_start"] = _loadavg()


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


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
    out_dir = _out_dir(terminalreporter.config)
    for module, rows in sorted(_rows.items()):
        lines = _table(rows)
        terminalreporter.write_sep("-", f"{module}: extra_info")
        for line in lines:
            terminalreporter.write_line(line)
        name = module.removeprefix("test_bench_").removeprefix("test_")
        path = os.path.join(out_dir, f"{name}.md")
        with open(path, "w") as f:
            f.write(f"# Benchmark results: {module}\n\n" + "\n".join(lines) + "\n")
        terminalreporter.write_line(f"written to {os.path.relpath(path)}")
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump({"module": module, "finished": _now(), "load_avg_end": _loadavg(),
                       "rows": [{"benchmark": n, **_scalars(i)} for n, i in rows]}, f, indent=1)
    if out_dir != _RESULTS_DIR:
        terminalreporter.write_line(f"a partial run (-k, -m or node ids): figures only in {os.path.relpath(out_dir)}/; "
                                    "results/*.md and RESULTS.md keep the last full run's")
        return
    path = _write_results_md(terminalreporter.config)
    terminalreporter.write_line(f"all benchmark figures collected in {os.path.relpath(path)}")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _scalars(info: dict) -> dict:
    return {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool))}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem = f", {kib / (1 << 20):.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    versions = []
    for name in ("torch", "transformers", "trl", "vllm", "deepspeed"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__version__", None):
            versions.append(f"{name} {module.__version__}")
    return (f"{cpu}, {os.cpu_count()} logical CPUs{mem}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}" + (f"; {', '.join(versions)}" if versions else ""))


def _write_results_md(config) -> str:
    """One table with every figure of every benchmark module that has a ``results/<name>.json``."""
    modules = []
    for fname in sorted(os.listdir(_RESULTS_DIR)):
        if not fname.endswith(".json") or fname == "bench.json":
            continue
        try:
            with open(os.path.join(_RESULTS_DIR, fname)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "rows" in data and "module" in data:
            modules.append(data)
    args = " ".join(config.invocation_params.args) or "benchmarks"
    lines = [
        "# Benchmark results",
        "",
        f"- machine: {_machine()}",
        f"- this run: started {_session.get('start', datetime.datetime.now()).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"finished {_now()}; load average (1/5/15 min) at start {_session.get('load_start', 'n/a')}, "
        f"at end {_loadavg()}",
        f"- command: `make bench` (here: `pytest {args}`)",
        "- modules: " + ", ".join(f"{m['module']} (finished {m['finished']}, load at end "
                                  f"{m.get('load_avg_end', 'n/a')})" for m in modules),
        "",
        "| module | benchmark | figure | value |",
        "|---|---|---|---|",
    ]
    for m in modules:
        name = m["module"].removeprefix("test_bench_")
        for row in m["rows"]:
            for key, value in row.items():
                if key != "benchmark":
                    lines.append(f"| {name} | {row['benchmark']} | {key} | {value} |")
    path = os.path.join(_RESULTS_DIR, "RESULTS.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path
