"""No import circle among the leader's modules, counting every import statement: module level, inside
functions (lazy), and under ``if TYPE_CHECKING:`` (a circle closed only for type checkers is still a circle
of dependencies).

Edges: ``import leader.x`` and ``from leader.x import y`` give ``leader.x``, and ``leader.x.y`` too where y
is a submodule; relative imports (``from .x import y``, ``from . import y``) resolve against the importing
module's package. An import of ``leader.a.b`` gives no edge to the package ``leader.a`` that Python runs
first (each subpackage's ``__init__`` would otherwise sit in a circle with every module under it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "leader"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def leader_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imported(node: ast.AST, name: str, is_package: bool) -> list[str]:
    """The absolute module names one import statement of module `name` may name."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module, *(f"{module}.{a.name}" for a in node.names)]


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {leader module it imports: first line}, every import statement wherever it stands."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # module level, functions, classes, TYPE_CHECKING blocks alike
            for target in imported(node, name, path.name == "__init__.py"):
                if target in modules and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first member, staying inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for f in frontier:
            for n in sorted(graph[f]):
                if n == start:
                    return paths[f] + [start]
                if n in members and n not in paths:
                    paths[n] = paths[f] + [n]
                    nxt.append(n)
        frontier = nxt
    return component


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    cycle = one_cycle(graph, component)
    path = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
    return f"{len(component)} modules: {', '.join(component)}\n    e.g. {path}"


def test_no_import_circle_in_the_leader():
    modules = leader_modules()
    graph = import_graph(modules)
    assert "leader.context" in graph and "leader.serving" in graph["leader.context"]  # the graph sees imports
    circles = strongly_connected(graph)
    for c in circles:
        print(describe(graph, c))
    assert not circles, (f"{len(circles)} import circle(s) in leader/:\n"
                         + "\n".join(describe(graph, c) for c in circles))


def test_the_graph_counts_type_checking_lazy_and_relative_imports():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from leader.b import B\n"
              "def f():\n    import leader.c\nfrom . import d\nfrom .e import thing\n")
    tree = ast.parse(source)
    names = [t for n in ast.walk(tree) for t in imported(n, "leader.pkg.a", False)]
    assert {"leader.b", "leader.c", "leader.pkg.d", "leader.pkg.e"} <= set(names)
    assert "leader.pkg" in imported(ast.parse("from .. import x").body[0], "leader.pkg.sub", True)


def test_tarjan_finds_each_circle_and_no_chain():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {"f": 1}, "f": {"e": 1}, "g": {}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["e", "f"]]
    assert one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b": 1}, "b": {}}) == []
