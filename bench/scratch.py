"""A benchmark's scratch folder (checkpoints, servables, a stack's data): made under the system's
temporary folder and removed when the benchmark's process exits, however it exits short of being
killed. A matrix run writes about 4 GB of models; left behind, a few runs fill a small disk."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
