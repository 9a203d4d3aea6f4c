"""No import cycle anywhere in events/, core/, leader/ and fellow/, lazy imports and imports for type checkers
only (under ``if TYPE_CHECKING:``) included: a cycle held together by a type-only import is a cycle all the
same. And each core/ module imports first in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = sorted([".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "core").glob("*.py")]
                 + ["leader.replay_cli"])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module of ours: line}, every import statement wherever it stands."""
    paths = {module_name(p): p for layer in ("events", "core", "leader", "fellow")
             for p in (ROOT / layer).rglob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for t in targets:
                if t in paths and t != name:
                    edges.setdefault(t, node.lineno)
    return graph


def cycles_through(graph: dict[str, dict[str, int]], starts: list[str]) -> list[list[str]]:
    """One shortest cycle back to each start that has one."""
    found = []
    for start in starts:
        paths, frontier, seen = {start: [start]}, [start], {start}
        while frontier and start not in [n for f in frontier for n in graph.get(f, {})]:
            nxt = []
            for f in frontier:
                for n in graph.get(f, {}):
                    if n not in seen:
                        seen.add(n)
                        paths[n] = paths[f] + [n]
                        nxt.append(n)
            frontier = nxt
        closing = [f for f in frontier if start in graph.get(f, {})]
        if closing:
            found.append(paths[closing[0]] + [start])
    return found


def describe(graph, cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_cycle_in_the_tree():
    graph = import_graph()
    assert "core.cli" in graph["leader.replay_cli"] or "core.cli_errors" in graph["leader.replay_cli"]
    assert "leader.services" in graph["leader.serving"] and "leader.serving" not in graph["leader.services"]
    bad = cycles_through(graph, sorted(graph))
    assert not bad, "import cycles:\n" + "\n".join(describe(graph, c) for c in bad)


def test_cycle_finder_sees_a_lazy_cycle_and_a_type_only_import(tmp_path, monkeypatch):
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 9}, "d": {"a": 2}}
    assert cycles_through(graph, ["a", "d"]) == [["a", "b", "c", "a"]]
    for name, text in (("a", "def f():\n    import leader.b\n"),  # lazy
                       ("b", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from leader.a import f\n")):
        (tmp_path / "leader").mkdir(exist_ok=True)
        (tmp_path / "leader" / f"{name}.py").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert cycles_through(graph, ["leader.a"]) == [["leader.a", "leader.b", "leader.a"]]


@pytest.mark.parametrize("module", CHECKED)
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_entry_point_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "core.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: swarm" in out.stdout, out.stderr
