"""The GPU races' modules (``benchmarks/gpu``) and the tests that stand in for their parts. A monkeypatch of a module's
attribute changes only what that module's own functions read: a name patched on a module that merely imports it from
another (``benchmarks/gpu/races.py`` keeps the races by name) would be patched there and read elsewhere, and the
stand-in would silently never run."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every test file that patches an attribute of a benchmarks.gpu module.
PATCHING = ["benchmarks/gpu/test_races_cpu.py", "tests/test_benchmarks_audit.py"]


def _read_globals(module) -> set[str]:
    """The names the functions and methods defined in ``module`` read (``co_names``: globals and attributes)."""
    names: set[str] = set()

    def walk(code: types.CodeType) -> None:
        names.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)

    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            walk(obj.__code__)
        elif inspect.isclass(obj):
            for member in vars(obj).values():
                if inspect.isfunction(member):
                    walk(member.__code__)
    return names


def _patches(path: str) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` of each ``monkeypatch.setattr(<benchmarks.gpu module>, "<name>", ...)`` in ``path``."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    modules = {alias.asname or alias.name: f"benchmarks.gpu.{alias.name}" for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module == "benchmarks.gpu" for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in modules
                and isinstance(node.args[1], ast.Constant)):
            found.append((modules[node.args[0].id], node.args[1].value, node.lineno))
    return found


@pytest.mark.parametrize("path", PATCHING)
def test_each_patched_attribute_is_read_by_the_module_it_is_patched_on(path):
    patches = _patches(path)
    assert patches, f"{path}: no monkeypatch of a benchmarks.gpu module found (the parser missed its imports?)"
    unread = [f"{path}:{line}: {module}.{name}" for module, name, line in patches
              if name not in _read_globals(importlib.import_module(module))]
    assert unread == [], "patched where no function reads it, so the stand-in never runs: " + ", ".join(unread)


def test_a_re_exported_name_is_not_counted_as_read():
    """The check itself: ``races`` imports ``measure`` for scripts/gpu_probe.py and never calls it, and ``grpo_ours``
    calls ``run_command``, which ``children`` defines and ``grpo_ours`` imports."""
    races = importlib.import_module("benchmarks.gpu.races")
    assert hasattr(races, "measure") and "measure" not in _read_globals(races)
    assert "run_command" in _read_globals(importlib.import_module("benchmarks.gpu.grpo_ours"))


def test_the_races_modules_stay_small_and_the_child_command_knows_every_race():
    folder = os.path.join(ROOT, "benchmarks", "gpu")
    sizes = {f: sum(1 for _ in open(os.path.join(folder, f))) for f in os.listdir(folder) if f.endswith(".py")}
    assert {f: n for f, n in sizes.items() if n > 500} == {}, sizes
    races = importlib.import_module("benchmarks.gpu.races")
    assert set(races.RACES) == {"lm_head", "rl_update", "grpo_vs_trl", "save_model", "trl_grpo", "layouts",
                                "grpo_engines"}
