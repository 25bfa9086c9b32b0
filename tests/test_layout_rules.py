"""The shape of the package: no import circles in fastrlhf/ or kernels/ (imports inside functions
included), no module above 500 lines, at most 14 entries at fastrlhf's top level; and no file under
tests/ or benchmarks/ imports a test module or a conftest (what tests share lives in tests/helpers/), nor
shares a test module's file name with another; and the tree passes ruff."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 500
MAX_TOP_LEVEL = 14


def modules() -> dict[str, str]:
    """Dotted name -> file of every module of fastrlhf (kernels/ installed as fastrlhf.kernels)."""
    out = {}
    for folder, package in (("fastrlhf", "fastrlhf"), ("kernels", "fastrlhf.kernels")):
        base = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), base)[:-3].replace(os.sep, ".")
                    dotted = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                    out[dotted] = os.path.join(dirpath, name)
    return out


def fastrlhf_imports(name: str, path: str):
    """``(module, names)`` of each import of a fastrlhf module in the file of module ``name`` (at module
    level or inside a function; relative imports resolved): ``from m import a, b`` -> (m, [a, b]),
    ``import m`` -> (m, [])."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            if base.startswith("fastrlhf"):
                yield base, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names if a.name.startswith("fastrlhf"))


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        deps = set()
        for module, names in fastrlhf_imports(name, path):
            if names:
                deps.update(resolve(f"{module}.{n}") for n in names)
            else:
                deps.add(resolve(module))
        graph[name] = {d for d in deps if d and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_of_fastrlhf_names_a_module_that_exists():
    mods = modules()
    missing = [f"{name}: {module}" for name, path in mods.items() for module, _ in fastrlhf_imports(name, path)
               if module not in mods]
    assert missing == []


def test_no_module_above_500_lines():
    long = {name: n for name, path in modules().items() if (n := len(open(path).read().splitlines())) > MAX_LINES}
    assert long == {}


def test_fastrlhf_top_level_holds_at_most_14_entries():
    entries = [e for e in os.listdir(os.path.join(ROOT, "fastrlhf")) if e not in ("__init__.py", "__main__.py",
                                                                                 "__pycache__")]
    assert len(entries) <= MAX_TOP_LEVEL, sorted(entries)
    packages = [e for e in entries if os.path.isdir(os.path.join(ROOT, "fastrlhf", e))]
    for package in packages:  # each package says what it holds
        init = os.path.join(ROOT, "fastrlhf", package, "__init__.py")
        assert ast.get_docstring(ast.parse(open(init).read())), f"fastrlhf/{package}/__init__.py has no docstring"


# --------------------------------------------------------------------------------------------
# Tests import no test module
# --------------------------------------------------------------------------------------------


def is_test_module(dotted: str) -> bool:
    """Whether a dotted module name names a test module (pytest's ``test_*`` / ``*_test``) or a conftest,
    at any level (``test_plan``, ``benchmarks.test_bench_e2e``, ``tests.conftest``)."""
    return any(part.startswith("test_") or part.endswith("_test") or part == "conftest"
               for part in dotted.split("."))


def imports_of_test_modules(source: str) -> list[str]:
    """The imports in ``source`` (anywhere in it, inside functions too) that name a test module or a
    conftest: ``import test_x``, ``from test_x import a``, ``from pkg import test_x``, ``from . import
    conftest`` and ``importlib.import_module("test_x")`` / ``__import__("test_x")``, as one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if is_test_module(module) or any(is_test_module(a.name) for a in node.names):
                found.append(f"line {node.lineno}: from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(arg, str) and is_test_module(arg):
                found.append(f"line {node.lineno}: {name}({arg!r})")
    return found


def test_no_test_module_imports_another_test_module():
    """A test that imports another test module (``from test_plan import ...``) works only when pytest
    happened to import that module first (its folder is then on ``sys.path``), so it fails run alone;
    and the imported module's tests are collected twice. Shared cases go in tests/helpers/."""
    bad = []
    for folder in ("tests", "benchmarks"):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    bad += [f"{os.path.relpath(path, ROOT)}: {line}"
                            for line in imports_of_test_modules(open(path).read())]
    assert bad == []


def test_no_two_test_modules_share_a_file_name():
    """tests/ has no __init__.py files: pytest imports each test module by its file name alone, so a second
    test_x.py in another folder stops the whole collection ("import file mismatch"), and `make test` with it."""
    seen: dict[str, list[str]] = {}
    for folder in ("tests", "benchmarks"):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.startswith("test_") and name.endswith(".py"):
                    seen.setdefault(name, []).append(os.path.relpath(os.path.join(dirpath, name), ROOT))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_the_test_import_finder_finds_them():
    source = """
import os, test_a
import tests.conftest
from test_b import x
from benchmarks.test_bench_e2e import y
from helpers import test_c
from . import conftest
from .c_test import z
from helpers.rl_case import make_config
import contest, testing, attest

def f():
    from test_d import w
    importlib.import_module("test_e")
    __import__("conftest")
    importlib.import_module("fastrlhf.kernels.policy_loss")
"""
    assert imports_of_test_modules(source) == [
        "line 2: import test_a",
        "line 3: import tests.conftest",
        "line 4: from test_b import x",
        "line 5: from benchmarks.test_bench_e2e import y",
        "line 6: from helpers import test_c",
        "line 7: from . import conftest",
        "line 8: from .c_test import z",
        "line 13: from test_d import w",
        "line 14: import_module('test_e')",
        "line 15: __import__('conftest')",
    ]


def test_the_tree_passes_ruff():
    """pyproject.toml's lint rules hold everywhere: a rule nothing runs stops holding (a too-long line sat in
    benchmarks/ for a session)."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert ruff, "ruff (the dev extra) is not installed"
    folders = [f for f in ("fastrlhf", "kernels", "tests", "benchmarks", "examples", "scripts", "setup.py")
               if os.path.exists(os.path.join(ROOT, f))]
    done = subprocess.run([ruff, "check", "--no-cache", *folders], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
