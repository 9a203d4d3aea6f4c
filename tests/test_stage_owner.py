"""``StageModel`` has one owner: its attributes are written by its own module and its builder (model/load/)
alone, and its status report (``kernels``) is a typed ``StageKernels`` written only through ``note``."""

import ast
from pathlib import Path

import msgspec
import pytest

from events.stage import ReadyReport, decode_report, encode
from events.stage_kernels import StageKernels, as_json

ROOT = Path(__file__).resolve().parent.parent
OWNER = Path("fellow/runtime/model/stage.py")
BUILDER = Path("fellow/runtime/model/load")


def _is_stage(node: ast.expr) -> bool:
    """``stage``, ``self.stage``, ``loaded.stage``: how the fellow's code names a StageModel."""
    return (isinstance(node, ast.Name) and node.id == "stage") or (isinstance(node, ast.Attribute)
                                                                   and node.attr == "stage")


def _targets(node: ast.AST) -> list[ast.expr]:
    targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
               if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    flat = []
    for target in targets:
        flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
    return flat


def stage_writes(path: Path) -> list[tuple[int, str]]:
    """Each line of ``path`` that assigns to a StageModel's attribute (or into one: ``stage.kernels["x"] = ...``),
    or calls ``setattr`` on one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        for target in _targets(node):
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and _is_stage(target.value):
                found.append((node.lineno, ast.unparse(target)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and _is_stage(node.args[0])):
            found.append((node.lineno, ast.unparse(node)))
    return found


def outside_the_owner(root: Path) -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in sorted((root / "fellow").rglob("*.py")):
        rel = path.relative_to(root)
        writes = stage_writes(path)
        if rel == OWNER:
            continue
        if BUILDER in rel.parents:  # the builder sets what it builds, but the report goes through ``note``
            writes = [(line, what) for line, what in writes if what.split(".")[-1] == "kernels"]
        if writes:
            found[str(rel)] = writes
    return found


def test_no_module_but_the_stage_and_its_builder_writes_a_stage(tmp_path):
    assert outside_the_owner(ROOT) == {}
    # the test sees a write: the patterns the code had before it went through ``note`` and its owner's methods
    sneaky = tmp_path / "fellow" / "runtime" / "server" / "sneaky.py"
    sneaky.parent.mkdir(parents=True)
    sneaky.write_text("def f(self, stage):\n    self.stage.kernels = {**self.stage.kernels, 'kv': 1}\n"
                      "    stage.plain_weights = None\n    stage.kernels['head'] = 'x'\n"
                      "    setattr(stage, 'head', None)\n")
    builder = tmp_path / BUILDER / "loader.py"
    builder.parent.mkdir(parents=True)
    builder.write_text("def build(stage):\n    stage.head = 1\n    stage.kernels = {}\n")
    assert outside_the_owner(tmp_path) == {
        "fellow/runtime/server/sneaky.py": [(2, "self.stage.kernels"), (3, "stage.plain_weights"),
                                            (4, "stage.kernels"), (5, "setattr(stage, 'head', None)")],
        "fellow/runtime/model/load/loader.py": [(3, "stage.kernels")]}


def test_the_report_is_typed_and_travels_as_the_status_showed_it():
    kernels = StageKernels(path="fused", rows=[1, 8], fourbit_rows={"row_limit": 3}, kv={"held": 512})
    with pytest.raises(TypeError):
        msgspec.structs.replace(kernels, no_such_field=1)  # what ``StageModel.note`` does: unknown fields refused
    ready = ReadyReport(kv_tokens=512, kv_tokens_planned=512, max_in_flight=4, vram_bytes=0, load_s=1.0,
                        kernels=kernels)
    back = decode_report(encode(ready))
    assert back.kernels == kernels
    # the row's JSON: the keys a status always showed ("4bit_rows"), and nothing that was not noted
    assert as_json(back.kernels) == {"path": "fused", "rows": [1, 8], "4bit_rows": {"row_limit": 3},
                                     "kv": {"held": 512}}
    # a ready event stored before the report was typed (a dict, a key since dropped) still decodes
    old = msgspec.json.encode({"path": "hf", "why": "moe", "gone": 1})
    assert msgspec.json.decode(old, type=StageKernels) == StageKernels(path="hf", why="moe")
