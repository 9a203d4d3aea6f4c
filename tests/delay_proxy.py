"""A TCP proxy on loopback that delays what it forwards: a simulated WAN link for tests and benchmarks.

This kernel has no netem, so links between fellows, or between a fellow and nats-server, go through
one of these: every chunk read on one side is written on the other ``delay_s`` later (plus up to
``jitter_s``, never out of order), and at most ``bandwidth`` bytes a second leave in each direction
(0: no limit). It runs its own event loop on a thread, so synchronous and async callers can use it.

    with DelayProxy(("127.0.0.1", 4222), delay_s=0.025) as proxy:
        connect(f"nats://127.0.0.1:{proxy.port}")

``SpawnedProxy`` runs one in a process of its own (``python -m tests.delay_proxy``), so that a
benchmark's own threads do not hold up its timing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import threading


class DelayProxy:
    def __init__(self, target: tuple[str, int] | None, delay_s: float = 0.0, jitter_s: float = 0.0,
                 bandwidth: float = 0.0, host: str = "127.0.0.1", port: int = 0, seed: int = 0):
        """``target`` None: connections wait until ``aim`` gives one."""
        if delay_s < 0 or jitter_s < 0 or bandwidth < 0:
            raise ValueError("delay, jitter and bandwidth must be >= 0")
        self.target, self.delay_s, self.jitter_s, self.bandwidth = target, delay_s, jitter_s, bandwidth
        self.host, self.port = host, port
        self.random = random.Random(seed)
        self.bytes = 0  # forwarded, both directions
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._aimed = asyncio.Event()  # a connection waits for a target given later (``aim``)
        if target is not None:
            self._aimed.set()

    def start(self) -> "DelayProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, self.host, self.port), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def aim(self, target: tuple[str, int]) -> None:
        """Forward to ``target`` from now on: a proxy started before what it fronts has bound its port."""
        self.target = target
        self._loop.call_soon_threadsafe(self._aimed.set)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def cut(self) -> None:
        """Break every connection through the proxy now (a link that fails mid-session)."""
        def close_all():
            for writer in list(self._writers):
                writer.transport.abort()
        self._loop.call_soon_threadsafe(close_all)

    def stop(self) -> None:
        if not self._thread.is_alive():  # stopped already (or never started)
            return

        async def close():
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(self._aimed.wait(), 10)
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        pumps = [asyncio.create_task(self._pump(reader, up_writer)), asyncio.create_task(self._pump(up_reader, writer))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read as it comes; deliver each chunk at its time, in order, on a second task."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(queue, writer))
        last_due = 0.0
        wire_free = 0.0  # when the simulated wire has sent what came before
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                now = loop.time()
                if self.bandwidth:
                    wire_free = max(wire_free, now) + len(data) / self.bandwidth
                    sent = wire_free
                else:
                    sent = now
                jitter = self.random.uniform(0, self.jitter_s) if self.jitter_s else 0
                due = max(last_due, sent + self.delay_s + jitter)
                last_due = due
                queue.put_nowait((due, data))
        finally:
            queue.put_nowait((None, None))
            await deliver

    async def _deliver(self, queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            if data is None:
                return
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, RuntimeError):
                return
            self.bytes += len(data)


class SpawnedProxy:
    """A DelayProxy in a child process: ``address`` once started; ``stop()`` ends it."""

    def __init__(self, target: tuple[str, int], delay_s: float = 0.0, jitter_s: float = 0.0, bandwidth: float = 0.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.delay_proxy", f"{target[0]}:{target[1]}",
                                      "--delay-s", str(delay_s), "--jitter-s", str(jitter_s),
                                      "--bandwidth", str(bandwidth)], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line:
            self.proc.kill()
            raise RuntimeError("the delay proxy did not start")
        self.address = line
        self.port = int(line.rsplit(":", 1)[1])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description="Forward a local port to TARGET, delayed (prints host:port, runs "
                                             "until stdin closes or it is terminated)")
    ap.add_argument("target", help="host:port")
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--jitter-s", type=float, default=0.0)
    ap.add_argument("--bandwidth", type=float, default=0.0, help="bytes per second each way; 0: no limit")
    args = ap.parse_args()
    host, port = args.target.rsplit(":", 1)
    proxy = DelayProxy((host, int(port)), delay_s=args.delay_s, jitter_s=args.jitter_s,
                       bandwidth=args.bandwidth).start()
    print(proxy.address, flush=True)
    try:
        proxy._thread.join()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
