"""C kernels of the project's own, built on first use with the host's C compiler and loaded with ctypes.

As inductor compiles its kernels: the source is compiled (``CC``, else ``cc``) into a file named by its
hash under ``swarm-kernels`` beside inductor's cache (about 1.5 s, once per cache), with OpenMP from the
``libgomp`` torch loaded, so a kernel and torch share one thread pool and its thread count. Where there is
no compiler, no AVX2 or FMA, or the build fails, ``build`` says why and the caller keeps torch's kernels.
Used by ``quant.int8_gemv`` (int8 rows) and ``attend_kernel`` (one session's decode attention).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from functools import cache, cached_property
from pathlib import Path

import torch

# -fno-math-errno: lrintf (the inputs' quantization) becomes one instruction and its loops vectorize
FLAGS = ["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
# where torch dispatches its AVX-512 kernels the sources are built for AVX-512 too (their ``__AVX512F__``
# paths: 16 floats a register, and VNNI's int8 products where the CPU has them); ATEN_CPU_CAPABILITY=avx2
# therefore gives the AVX2 build on the same machine, as it gives torch's AVX2 kernels
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# C: the sum of an AVX register's eight floats (the kernels' sources start with it)
HSUM = r"""
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
"""
# C: a dot product of two float rows (the kernels that need one add it after HSUM)
DOT = r"""
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float r = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}
"""
# C: an int8 weight row by an int8-quantized input row over nb blocks of 32 (each block's products summed in
# integers, then scaled by the input block's scale d[b]); the weight row's own scale is the caller's
INT8_DOT = r"""
static inline float int8_dot(const int8_t *wr, const int8_t *xr, const float *dr, int64_t nb) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + b * 32));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dr[b]), acc0);
        __m256i wv2 = _mm256_loadu_si256((const __m256i *)(wr + b * 32 + 32));
        __m256i xv2 = _mm256_loadu_si256((const __m256i *)(xr + b * 32 + 32));
        __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv2, wv2), _mm256_sign_epi8(xv2, wv2)), ones);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2), _mm256_set1_ps(dr[b + 1]), acc1);
    }
    for (; b < nb; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + b * 32));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dr[b]), acc0);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}
"""


def cache_dir() -> Path:
    """Beside inductor's cache where it has one (a fellow points it under its data dir), else the user's."""
    base = (os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
            or os.path.join(os.path.expanduser("~"), ".cache"))
    return Path(base) / "swarm-kernels"


@cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's flags, read once a process (each build and each capability check asks)."""
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


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


def build(name: str, source: str, what: str) -> tuple[ctypes.CDLL | None, str]:
    """(the library ``name`` built from ``source``, "") or (None, why not: one line, naming ``what``)."""
    if not cpu_has_avx2_fma():
        return None, "this CPU lacks AVX2 or FMA"
    chosen = flags()
    digest = hashlib.sha256((source + " ".join(chosen)).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / f"{name}.c"
                src.write_text(source)
                built = Path(tmp) / f"{name}.so"
                compiler = os.environ.get("CC") or "cc"
                subprocess.run([compiler, *chosen, str(src), "-o", str(built)], check=True, capture_output=True,
                               timeout=120)
                os.replace(built, target)  # atomic: another process building at once is harmless
        except (OSError, subprocess.SubprocessError) as exc:
            stderr = getattr(exc, "stderr", b"") or b""
            why = stderr.decode(errors="replace").strip().splitlines()[:1] or [str(exc)]
            return None, f"{what} did not build: {why[0][:200]}"
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as exc:
        return None, f"{what} did not load: {exc}"


class Kernel:
    """One C function (``symbol``, returning nothing, of ``argtypes``) of a library ``build`` makes from
    ``source`` on first use."""

    def __init__(self, name: str, source: str, what: str, symbol: str, argtypes: list) -> None:
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
