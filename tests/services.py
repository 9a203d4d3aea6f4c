"""Real services for tests: a throwaway PostgreSQL cluster from Debian's binaries."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.processes import free_port


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class Postgres:
    """initdb + pg_ctl on a loopback port; as root it runs as the `postgres` user."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        if self.bin is None:
            raise RuntimeError("PostgreSQL server binaries not found (apt-get install postgresql)")
        self.dir = Path(tempfile.mkdtemp(prefix="swarm-pg-"))
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else None

    def _run(self, *args: str) -> None:
        cmd = list(args)
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True)

    def start(self) -> "Postgres":
        data = self.dir / "data"
        if self.user:
            shutil.chown(self.dir, self.user)
            os.chmod(self.dir, 0o700)
        self._run(str(self.bin / "initdb"), "-D", str(data), "-A", "trust", "-U", "swarm", "--no-sync")
        self.resume()
        return self

    def url(self, db: str = "postgres") -> str:
        return f"postgresql+asyncpg://swarm@127.0.0.1:{self.port}/{db}"

    def create_db(self, name: str) -> str:
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "swarm", name)
        return self.url(name)

    def halt(self) -> None:
        """Stop the server at once (a crash, for what its clients see); `resume` starts it again."""
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "stop")
        except subprocess.CalledProcessError:
            pass

    def resume(self) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        self.halt()
        shutil.rmtree(self.dir, ignore_errors=True)
