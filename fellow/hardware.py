"""What this node has, read without torch: GPUs via nvidia-smi, system memory via /proc/meminfo."""

from __future__ import annotations

import shutil
import subprocess

from events.fellow import Gpu


def memory_bytes() -> tuple[int, int]:
    """(total, available) system memory in bytes; (0, 0) where /proc/meminfo is missing."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    values[key] = int(parts[0]) * 1024
    except OSError:
        return 0, 0
    return values.get("MemTotal", 0), values.get("MemAvailable", values.get("MemFree", 0))


def gpus() -> list[Gpu]:
    """Every CUDA device nvidia-smi reports; none on a CPU-only node (reported honestly as none)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total,memory.free,compute_cap",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 5:
            continue
        try:
            found.append(Gpu(index=int(cells[0]), name=cells[1], total_bytes=int(float(cells[2])) << 20,
                             free_bytes=int(float(cells[3])) << 20, compute_capability=cells[4]))
        except ValueError:
            continue
    return found
