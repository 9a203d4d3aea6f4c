"""The C kernels live in files (fellow/runtime/kernels/csrc), not in Python strings; the ctypes mirrors of their
structs agree with the header; and ``make kernels`` compiles every source warning-free (``-Werror``)."""

from __future__ import annotations

import ast
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fellow.runtime import kernels

ROOT = Path(__file__).resolve().parents[1]
CC = os.environ.get("CC") or "cc"
needs_cc = pytest.mark.skipif(shutil.which(CC) is None, reason=f"no C compiler ({CC})")
C_MARKERS = ("#include", "static inline")


def c_in_strings(tree: ast.AST) -> list[int]:
    """The lines of string constants that hold C (an ``#include`` or a ``static inline``)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and any(marker in node.value for marker in C_MARKERS)]


def test_no_python_module_under_fellow_holds_c_source():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "fellow").rglob("*.py"))
             for line in c_in_strings(ast.parse(path.read_text(), str(path)))]
    assert found == [], f"C source in Python strings (move it to fellow/runtime/kernels/csrc): {found}"
    assert c_in_strings(ast.parse('X = """\n#include <stdint.h>\n"""')) == [1]  # the check sees one


def test_every_library_source_is_shipped():
    from fellow.runtime.kernels import attend_kernel, f32_gemv, step_kernel
    from fellow.runtime.model.quant import int8_gemv

    names = {k.source for k in (step_kernel.STEP, f32_gemv.KERNEL, attend_kernel.KERNEL, int8_gemv.KERNEL)}
    assert names == {p.name for p in kernels.sources() if p.suffix == ".c"}
    text = (ROOT / "pyproject.toml").read_text()
    assert '"fellow.runtime.kernels" = ["csrc/*.c", "csrc/*.h"]' in text


def structs() -> dict[str, type[ctypes.Structure]]:
    """Each ctypes mirror of a C struct, by its C name."""
    from fellow.runtime.kernels import step_kernel

    return {"Lin": step_kernel.Lin, "Layer": step_kernel.Layer, "Model": step_kernel.Model}


def probe_source(mirrors: dict[str, type[ctypes.Structure]]) -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "step_structs.h"', "int main(void) {"]
    for name, mirror in mirrors.items():
        lines.append(f'    printf("{name} sizeof %zu\\n", sizeof({name}));')
        lines += [f'    printf("{name} {field} %zu\\n", offsetof({name}, {field}));'
                  for field, *_ in mirror._fields_]
    return "\n".join([*lines, "    return 0;", "}", ""])


def layout_in_c(tmp_path: Path, csrc: Path, mirrors: dict[str, type[ctypes.Structure]]) -> dict[str, int]:
    (tmp_path / "probe.c").write_text(probe_source(mirrors))
    subprocess.run([CC, f"-I{csrc}", str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe")], check=True,
                   capture_output=True, timeout=120)
    out = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True).stdout
    return {f"{s}.{f}": int(v) for s, f, v in (line.split() for line in out.splitlines())}


def layout_in_ctypes(mirrors: dict[str, type[ctypes.Structure]]) -> dict[str, int]:
    found = {}
    for name, mirror in mirrors.items():
        found[f"{name}.sizeof"] = ctypes.sizeof(mirror)
        found.update({f"{name}.{field}": getattr(mirror, field).offset for field, *_ in mirror._fields_})
    return found


@needs_cc
def test_the_ctypes_mirrors_agree_with_the_header(tmp_path):
    mirrors = structs()
    assert layout_in_c(tmp_path, kernels.csrc(), mirrors) == layout_in_ctypes(mirrors)


@needs_cc
def test_the_probe_sees_a_field_moved_in_the_header(tmp_path):
    """A header whose Layer has ``window`` first no longer agrees with the mirror."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernels.csrc(), csrc)
    header = csrc / "step_structs.h"
    text = header.read_text()
    moved = text.replace("    Lin qkv, o, gate_up, down;", "    int64_t window;\n    Lin qkv, o, gate_up, down;", 1)
    moved = moved.replace("    int64_t window;       /* 0: every position */\n", "", 1)
    assert moved != text
    header.write_text(moved)
    mirrors = structs()
    assert layout_in_c(tmp_path, csrc, mirrors) != layout_in_ctypes(mirrors)


@needs_cc
def test_make_kernels_compiles_every_source_warning_free(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make")
    done = subprocess.run(["make", "-s", "kernels", f"CC={CC}", f"KERNELS_OUT={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(list(tmp_path.glob("*.so"))) == 3 * len([p for p in kernels.sources() if p.suffix == ".c"])


def test_make_kernels_uses_the_flags_native_builds_with():
    from fellow.runtime.kernels import native

    values = dict(line.split(" := ", 1) for line in (ROOT / "Makefile").read_text().splitlines() if " := " in line)
    assert values["KERNEL_FLAGS"].split() == native.FLAGS
    assert values["KERNEL_AVX512"].split() == native.AVX512


def libraries():
    from fellow.runtime.kernels import attend_kernel, f32_gemv, step_kernel
    from fellow.runtime.model.quant import int8_gemv

    return [step_kernel.STEP, f32_gemv.KERNEL, attend_kernel.KERNEL, int8_gemv.KERNEL]


@needs_cc
@pytest.mark.parametrize("index", range(4))
def test_every_kernel_builds_where_a_compiler_and_avx2_are(index):
    """Fails, not skips, where the build fails: a kernel's own tests skip only without compiler or AVX2."""
    from fellow.runtime.kernels import native

    if not native.cpu_has_avx2_fma():
        pytest.skip("this CPU lacks AVX2 or FMA")
    kernel = libraries()[index]
    assert kernel.available(), kernel.unavailable_reason()


@needs_cc
def test_a_failed_build_logs_the_compilers_whole_stderr_and_returns_one_line(tmp_path, monkeypatch, caplog):
    from fellow.runtime.kernels import native

    if not native.cpu_has_avx2_fma():
        pytest.skip("this CPU lacks AVX2 or FMA")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "bad.c").write_text("void f(void) { undeclared_a = 1; }\nvoid g(void) { undeclared_b = 2; }\n")
    with caplog.at_level("WARNING", logger=native.__name__):
        lib, why = native.build("bad", tmp_path / "bad.c", "the bad kernel")
    assert lib is None and why.startswith("the bad kernel did not build: ") and "\n" not in why
    assert "undeclared_a" in caplog.text and "undeclared_b" in caplog.text  # every error, not the first alone
    assert "undeclared_a" in why and "error" in why


def test_the_cache_key_holds_the_compiler_flags_and_sources(monkeypatch):
    from fellow.runtime.kernels import native

    key = native.cache_key("f32_gemv.c", native.FLAGS, "cc")
    assert key == native.cache_key("f32_gemv.c", native.FLAGS, "cc")
    assert key != native.cache_key("f32_gemv.c", native.FLAGS + ["-mavx512f"], "cc")
    assert key != native.cache_key("int8_gemv.c", native.FLAGS, "cc")
    monkeypatch.setattr(native, "compiler_identity", lambda cc: "cc: another compiler 1.0")
    assert key != native.cache_key("f32_gemv.c", native.FLAGS, "cc")
