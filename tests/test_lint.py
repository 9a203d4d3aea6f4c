"""The repository passes ruff's lint (pyproject.toml's [tool.ruff]: E, F, W, I at 120 columns)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_passes():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff check found errors:\n{done.stdout}{done.stderr}"
