"""The shape of the package: no import circles in fastrlhf/ or kernels/ (imports inside functions
included), no module above 500 lines, at most 14 entries at fastrlhf's top level."""

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
