"""The C kernels on a CPU kind this machine is not: an AMD EPYC with AVX2 and FMA and no AVX-512, the kind whose
clean clone once died with SIGILL in the AVX-512 kernel test. qemu-user (Debian's qemu-user, which .ci/run
installs) runs the test process on an emulated EPYC-Rome: CPUID answers without AVX-512 while /proc/cpuinfo is
still the host's, so the kernels must ask what the process can run, not the file. What the tests start as
subprocesses runs on the host again; the in-process builds, loads and checks run on the emulated CPU."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QEMU = shutil.which("qemu-x86_64")
CPU = "EPYC-Rome"  # Zen 2: AVX2, FMA, no AVX-512
KERNEL_TESTS = ["tests/test_kernel_sources.py", "tests/test_attend_kernel.py", "tests/test_int8_gemv.py",
                "tests/test_native_step.py"]

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or QEMU is None,
                                reason="needs qemu-x86_64 (Debian's qemu-user) on an x86-64 host")


def on_epyc_rome(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}  # torch picks by what CPUID says
    return subprocess.run([QEMU, "-cpu", CPU, sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_emulated_cpu_has_avx2_and_the_kernels_are_built_without_avx512():
    done = on_epyc_rome("-c", "import torch\nfrom fellow.runtime.kernels import native\n"
                              "print(torch.backends.cpu.get_cpu_capability(), sorted(native._cpu_flags()))\n"
                              "print(' '.join(native.flags()))", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    capability, flags = done.stdout.strip().splitlines()[-2:]
    assert capability == "AVX2 ['avx2', 'fma']", capability  # the host's /proc/cpuinfo lists AVX-512: not taken
    assert "-mavx2" in flags.split() and not any(f.startswith("-mavx512") for f in flags.split())


def test_the_kernels_tests_pass_on_it_and_its_avx512_builds_skip():
    done = on_epyc_rome("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *KERNEL_TESTS, timeout=1200)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail  # a SIGILL anywhere in the process fails it (returncode -4)
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
    assert "lacks avx512bw avx512dq avx512f avx512vl, which avx512 needs" in done.stdout, tail
