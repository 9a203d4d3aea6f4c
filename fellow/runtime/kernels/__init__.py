"""The C sources of the fellow's own CPU kernels, shipped as package data and compiled on first use by
``fellow.runtime.kernels.native.build`` (``make kernels`` compiles them all with ``-Werror``).

``csrc/*.c`` are the libraries (one each: ``step_kernel.c``, ``f32_gemv.c``, ``attend_one.c``,
``int8_gemv.c``); ``csrc/*.h`` the pieces they share, included (``-I`` the csrc folder). Each struct is
declared once, in a header; its ctypes mirror is checked against it by ``tests/test_kernel_sources.py``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def csrc() -> Path:
    """The folder of the C sources (a real directory: the package is installed as files, or editable)."""
    return Path(str(files(__name__).joinpath("csrc")))


def sources() -> list[Path]:
    """Every C source and header, in name order (what a build's cache key hashes)."""
    return sorted(p for p in csrc().iterdir() if p.suffix in (".c", ".h"))
