"""The package's import graph has no circle, deferred and type-checking imports included.

Every `import` / `from ... import` statement anywhere in a module (inside functions and under
TYPE_CHECKING too) is an edge; importing a module also runs its parent packages' __init__, so those
are edges as well. A circle is a strongly connected component with more than one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "engine": "minibatch.engine",
    "daemon": "minibatch.daemon",
    "tui": "minibatch.tui",
    "kernels": "minibatch.kernels",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, dotted in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((dotted, *rel[:-1])) if rel[-1] == "__init__" else ".".join((dotted, *rel))
            mods[name] = path
    return mods


def _edges(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        for t in targets:
            while t and t not in mods:  # `import a.b.c` of a non-module attribute: its module
                t = t.rpartition(".")[0]
            parts = t.split(".")
            out.update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in mods)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_import_graph_finds_a_planted_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_anywhere():
    mods = _modules()
    assert "minibatch.engine.core.scheduler" in mods and "minibatch.daemon.app" in mods
    graph = {name: _edges(name, path, mods) for name, path in mods.items()}
    assert "minibatch.engine.core.request" in graph["minibatch.engine.core.scheduler"]
    assert _cycles(graph) == []


def _imports_anywhere(path: Path) -> set[str]:
    """Every module name an import statement in `path` names (absolute forms only; relative ones stay inside)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def test_only_the_cluster_package_imports_ray_and_nothing_imports_it():
    mods = _modules()
    assert "minibatch.daemon.cluster.router" in mods
    for name, path in mods.items():
        if name.startswith("minibatch.daemon.cluster"):
            continue
        names = _imports_anywhere(path)
        assert not any(n == "ray" or n.startswith("ray.") for n in names), f"{name} imports Ray"
        graph_edges = _edges(name, path, mods)
        assert not any(e.startswith("minibatch.daemon.cluster") for e in graph_edges), f"{name} imports the cluster"
