"""The layers import only downwards. Read from the syntax tree, so an import inside a function counts too.

- events/ imports nothing of ours;
- core/ imports no leader/ or fellow/ (the CLI reaches them by name: pyproject's swarm.parts entry points);
- leader/ imports no fellow/, and fellow/ imports no leader/;
- torch and transformers are imported only under fellow/runtime/;
- inside fellow/runtime/ the arrows run down: ring -> server -> engine -> model -> kernels -> steps (a package
  imports its own modules and the ones below it); tools (export, calibration, the demo model) sits beside them on top,
  and none of them imports it;
- no module is over 350 lines unless its docstring has a line saying why (``Over 350 lines: ...``).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("events", "core", "leader", "fellow")
OURS = set(LAYERS)
TORCH = {"torch", "transformers"}
# each imports only itself and what is left of it
RUNTIME_ORDER = ("steps", "kernels", "model", "engine", "server", "ring", "tools")
MAX_LINES = 350


class Import(NamedTuple):
    module: str  # dotted name as imported
    line: int
    lazy: bool  # inside a function


class Violation(NamedTuple):
    path: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}"


def imports(tree: ast.AST, package: str) -> Iterator[Import]:
    """Every import statement, `__import__("x")` and `importlib.import_module("x")`, with whether it is lazy."""

    def walk(node: ast.AST, lazy: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                yield from (Import(a.name, child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this file's package
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(p for p in [*parts, base] if p)
                yield Import(base, child.lineno, lazy)
            elif isinstance(child, ast.Call) and _dynamic_name(child):
                yield Import(_dynamic_name(child), child.lineno, lazy)
            yield from walk(child, inner)

    yield from walk(tree, False)


def _dynamic_name(call: ast.Call) -> str | None:
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    if name in ("__import__", "import_module") and call.args and isinstance(call.args[0], ast.Constant) \
            and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def parse(path: Path) -> ast.AST:
    """The file's syntax tree. CPython 3.11's parser once raised ``SystemError: AST constructor
    recursion depth mismatch`` on a file it parsed fine when run again (a clean-clone CI): one retry."""
    text = path.read_text()
    try:
        return ast.parse(text, str(path))
    except SystemError:
        return ast.parse(text, str(path))


def check_file(root: Path, path: Path) -> list[Violation]:
    rel = path.relative_to(root)
    layer = rel.parts[0]
    package = ".".join(rel.with_suffix("").parts[:-1] if rel.name != "__init__.py" else rel.parts[:-1])
    found = []
    for imp in imports(parse(path), package):
        top = imp.module.split(".")[0]
        why = None
        if top in TORCH and rel.parts[:2] != ("fellow", "runtime"):
            why = f"imports {imp.module}: torch and transformers belong under fellow/runtime/ only"
        elif layer == "events" and top in OURS - {"events"}:
            why = f"imports {imp.module}: events/ imports nothing of ours"
        elif layer == "core" and top in ("leader", "fellow"):
            why = f"imports {imp.module}: core/ imports no {top}/ (the CLI reaches it by name: core.cli_errors.part)"
        elif layer == "leader" and top == "fellow":
            why = f"imports {imp.module}: leader/ imports no fellow/"
        elif layer == "fellow" and top == "leader":
            why = f"imports {imp.module}: fellow/ imports no leader/"
        elif (up := _runtime_upward(rel, imp.module)) is not None:
            why = f"imports {imp.module}: fellow/runtime/{rel.parts[2]} is below {up}"
        if why:
            found.append(Violation(str(rel), imp.line, why))
    return found


def _runtime_upward(rel: Path, module: str) -> str | None:
    """The runtime package ``module`` belongs to when it sits above ``rel``'s (an arrow up), else None."""
    parts = module.split(".")
    if rel.parts[:2] != ("fellow", "runtime") or len(rel.parts) < 4 or parts[:2] != ["fellow", "runtime"]:
        return None
    here, there = rel.parts[2], parts[2] if len(parts) > 2 else ""
    if here in RUNTIME_ORDER and there in RUNTIME_ORDER and RUNTIME_ORDER.index(there) > RUNTIME_ORDER.index(here):
        return there
    return None


def oversized(root: Path) -> list[str]:
    """Modules of more than MAX_LINES lines whose docstring does not say why."""
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") > MAX_LINES and "Over 350 lines:" not in (ast.get_docstring(parse(path)) or ""):
                found.append(f"{path.relative_to(root)}: {text.count(chr(10))} lines")
    return found


def check_tree(root: Path) -> list[Violation]:
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            found += check_file(root, path)
    return found


def test_the_tree_keeps_its_layers():
    runtime = [imp.module for path in (ROOT / "fellow" / "runtime").rglob("*.py")
               for imp in imports(parse(path), "fellow.runtime")]
    assert "torch" in runtime  # the walk reads the real tree
    violations = check_tree(ROOT)
    assert not violations, "layering violations:\n" + "\n".join(map(str, violations))


def test_no_module_is_over_350_lines_without_saying_why():
    assert not oversized(ROOT), ("split these by concern, or say why not in their docstring:\n"
                                 + "\n".join(oversized(ROOT)))


def test_the_checker_sees_each_kind_of_violation(tmp_path):
    files = {
        "events/bad.py": "from core.settings import Settings\n",
        "core/bad.py": "def f():\n    import leader.app\n",
        "core/cli_bad.py": "from fellow.main import run_fellow\n",
        "core/cli.py": "def ok():\n    from fellow.main import run_fellow\n",  # lazy in the CLI: no more
        "leader/bad.py": "import os\n\n\nclass A:\n    def f(self):\n        return __import__('fellow.agent')\n",
        "fellow/bad.py": "from leader import serving\n",
        "fellow/sub/rel.py": "from ...leader import app\n",
        "fellow/cpu.py": "import importlib\nimportlib.import_module('transformers')\n",
        "leader/t.py": "async def f():\n    import torch.nn\n",
        "fellow/runtime/fine.py": "import torch\nfrom transformers import AutoConfig\n",
        "fellow/runtime/model/up.py": "from fellow.runtime.engine.session import Session\n",
        "fellow/runtime/engine/up.py": "import os\nfrom fellow.runtime.ring import head\n",
        "fellow/runtime/ring/down.py": ("from fellow.runtime.server.base import report\n"
                                        "from fellow.runtime.model import stage\n"),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = {(v.path, v.line) for v in check_tree(tmp_path)}
    assert found == {("events/bad.py", 1), ("core/bad.py", 2), ("core/cli_bad.py", 1), ("core/cli.py", 2),
                     ("leader/bad.py", 6),
                     ("fellow/bad.py", 1), ("fellow/sub/rel.py", 1), ("fellow/cpu.py", 2), ("leader/t.py", 2),
                     ("fellow/runtime/model/up.py", 1), ("fellow/runtime/engine/up.py", 2)}
    (tmp_path / "core" / "long.py").write_text('"""A module."""\n' + "x = 1\n" * 400)
    (tmp_path / "core" / "said.py").write_text('"""A module.\n\nOver 350 lines: one table."""\n' + "x = 1\n" * 400)
    assert oversized(tmp_path) == ["core/long.py: 401 lines"]
