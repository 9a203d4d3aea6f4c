"""C kernels of the project's own, built on first use with the host's C compiler and loaded with ctypes.

As inductor compiles its kernels: the source is compiled (``CC``, else ``cc``) into a file named by its
hash under ``swarm-kernels`` beside inductor's cache (about 1.5 s, once per cache), with OpenMP from the
``libgomp`` torch loaded, so a kernel and torch share one thread pool and its thread count. Where there is
no compiler, no AVX2 or FMA, or the build fails, ``build`` says why and the caller keeps torch's kernels.
The sources are files under ``fellow/runtime/kernels/csrc`` (package data), compiled with ``-I`` that folder;
the cache key holds the compiler's identity (``cc --version``'s first line), the flags and every source's
text, and a failed build logs the compiler's whole stderr. Used by ``quant.int8_gemv`` (int8 rows),
``attend_kernel`` (one session's decode attention), ``f32_gemv`` and ``step_kernel`` (the native step).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from collections import Counter
from functools import cache, cached_property
from pathlib import Path

import torch

from fellow.runtime import kernels

log = logging.getLogger(__name__)

# -fno-math-errno: lrintf (the inputs' quantization) becomes one instruction and its loops vectorize
FLAGS = ["-O3", "-Wall", "-Wextra", "-mavx2", "-mfma", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
# where torch dispatches its AVX-512 kernels the sources are built for AVX-512 too (their ``__AVX512F__``
# paths: 16 floats a register, and VNNI's int8 products where the CPU has them); ATEN_CPU_CAPABILITY=avx2
# therefore gives the AVX2 build on the same machine, as it gives torch's AVX2 kernels
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
def cache_dir() -> Path:
    """Beside inductor's cache where it has one (a fellow points it under its data dir), else the user's."""
    base = (os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
            or os.path.join(os.path.expanduser("~"), ".cache"))
    return Path(base) / "swarm-kernels"


# CPUID's names (torch's cpuinfo) -> /proc/cpuinfo's, for the instruction sets the kernels' builds use
CPUID_FLAGS = {"avx2": "avx2", "fma3": "fma", "avx512_f": "avx512f", "avx512_bw": "avx512bw",
               "avx512_vl": "avx512vl", "avx512_dq": "avx512dq", "avx512_vnni": "avx512_vnni"}


@cache
def _cpu_flags() -> frozenset[str]:
    """The instruction sets this process can run, in /proc/cpuinfo's names, read once a process (each build
    and each capability check asks): what CPUID answers this process (torch's cpuinfo; under an emulator or
    a VM, the CPU it presents), and where /proc/cpuinfo is readable only what it lists too. /proc/cpuinfo
    alone is not enough: an emulator such as qemu-user passes the host's through, AVX-512 included."""
    caps = torch.cpu.get_capabilities()
    have = frozenset(flag for name, flag in CPUID_FLAGS.items() if caps.get(name))
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return have
    listed = frozenset(line.partition(":")[2].split())
    return have & listed if listed else have


def cpu_has_avx2_fma() -> bool:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    return {"avx2", "fma"} <= _cpu_flags()


def flags() -> list[str]:
    """The compiler's flags here: AVX2 and FMA, with AVX-512 (and VNNI) where torch dispatches AVX-512."""
    have = _cpu_flags()
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not {"avx512f", "avx512bw", "avx512vl",
                                                                     "avx512dq"} <= have:
        return FLAGS
    return FLAGS + AVX512 + (["-mavx512vnni"] if "avx512_vnni" in have else [])


def compiler() -> str:
    return os.environ.get("CC") or "cc"


@cache
def compiler_identity(cc: str) -> str:
    """``cc --version``'s first line (once a process a compiler): part of the cache key, so a library another
    compiler built is not taken for this one's."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc
    return f"{cc}: {(out.splitlines() or [''])[0]}"


def _source(source: str | Path) -> Path:
    """A library's main file: a name under the csrc folder, or a path (tests)."""
    return source if isinstance(source, Path) else kernels.csrc() / source


def cache_key(source: str | Path, chosen: list[str], cc: str) -> str:
    """The hash of the compiler's identity, the flags and the text of the source and of every csrc file."""
    h = hashlib.sha256()
    for part in (compiler_identity(cc), " ".join(chosen), _source(source).read_text()):
        h.update(part.encode() + b"\0")
    for path in kernels.sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


COMPILED: Counter = Counter()  # libraries this process ran the C compiler for, by name (not those in the cache)


def build(name: str, source: str | Path, what: str) -> tuple[ctypes.CDLL | None, str]:
    """(the library ``name`` built from ``source``: a file of the csrc folder, "") or (None, why not: one line,
    naming ``what``; the compiler's whole output goes to the log)."""
    if not cpu_has_avx2_fma():
        return None, "this CPU lacks AVX2 or FMA"
    chosen, cc = flags(), compiler()
    try:
        digest = cache_key(source, chosen, cc)
    except OSError as exc:
        return None, f"{what} did not build: its source is unreadable ({exc})"
    target = cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / f"{name}.so"
                subprocess.run([cc, *chosen, f"-I{kernels.csrc()}", str(_source(source)), "-o", str(built)],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: another process building at once is harmless
                COMPILED[name] += 1
        except (OSError, subprocess.SubprocessError) as exc:
            stderr = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()
            log.warning("%s did not build (%s): %s\n%s", what, exc, " ".join([cc, *chosen]), stderr)
            why = [line for line in stderr.splitlines() if "error" in line][:1] or stderr.splitlines()[:1] or [str(exc)]
            return None, f"{what} did not build: {why[0][:200]}"
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as exc:
        return None, f"{what} did not load: {exc}"


class Kernel:
    """One C function (``symbol``, returning nothing, of ``argtypes``) of a library ``build`` makes from
    ``source`` (a file of the csrc folder) on first use."""

    def __init__(self, name: str, source: str | Path, what: str, symbol: str, argtypes: list) -> None:
        self.name, self.source, self.what, self.symbol, self.argtypes = name, source, what, symbol, argtypes

    @cached_property
    def _built(self) -> tuple:
        lib, why = build(self.name, self.source, self.what)
        if lib is None:
            return None, why
        fn = getattr(lib, self.symbol)
        fn.restype, fn.argtypes = None, self.argtypes
        return fn, ""

    @property
    def fn(self):
        """The function (only where ``available()``)."""
        return self._built[0]

    def available(self) -> bool:
        return self._built[0] is not None

    def failed(self) -> bool:
        """Whether a build was tried here and failed (cheap: never builds)."""
        return "_built" in vars(self) and self._built[0] is None

    def unavailable_reason(self) -> str:
        return self._built[1]
