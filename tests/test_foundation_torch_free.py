"""The leader (and the torch-free halves of core/ and fellow/) never import torch or transformers."""

from __future__ import annotations

import subprocess
import sys

WALK = r"""
import importlib, pkgutil, sys
import {pkg}
failed = []
for m in pkgutil.walk_packages({pkg}.__path__, "{pkg}."):
    if any(m.name.startswith(p) for p in {skip!r}):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as exc:
        failed.append(f"{{m.name}}: {{exc}}")
leaked = sorted(k for k in ("torch", "transformers") if k in sys.modules)
print("LEAKED", leaked)
print("FAILED", failed)
"""


def walk(pkg: str, skip: tuple[str, ...] = ()) -> str:
    out = subprocess.run([sys.executable, "-c", WALK.format(pkg=pkg, skip=list(skip))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_every_leader_module_never_imports_torch():
    out = walk("leader")
    assert "LEAKED []" in out, out
    assert "FAILED []" in out, out


def test_core_events_and_the_fellow_agent_are_torch_free():
    for pkg, skip in (("core", ()), ("events", ()), ("fellow", ("fellow.runtime",))):
        out = walk(pkg, skip)
        assert "LEAKED []" in out, (pkg, out)
        assert "FAILED []" in out, (pkg, out)


def test_the_walk_can_see_a_leak():
    """The check itself works: walking fellow.runtime does pull torch in."""
    assert "'torch'" in walk("fellow")
