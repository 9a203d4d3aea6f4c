"""The fellow agent: connects outbound to NATS, publishes heartbeats, consumes its commands."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Awaitable, Callable

import msgspec
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from core.bus import close_quietly, connect, ensure_streams, publish_struct
from core.procs import run_hooks
from core.settings import Settings
from events import subjects
from events.commands import Command, StopFellow, command_decoder
from events.fellow import Heartbeat, LoadedModel
from events.subjects import COMMANDS_STREAM
from fellow import hardware

log = logging.getLogger(__name__)

VERSION = "0.1.0"
Handler = Callable[[Command], Awaitable[None]]


def default_fellow_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}".replace(".", "-")


class FellowAgent:
    """Torch-free. Features register command handlers and loaded-model reporters."""

    def __init__(self, settings: Settings, fellow_id: str | None = None,
                 capabilities: list[str] | None = None):
        self.settings = settings
        self.fellow_id = (fellow_id or default_fellow_id()).replace(".", "-")
        self.capabilities = sorted(capabilities or [])
        self.started_at = time.time()
        self.nc = None
        self.js = None
        self.seq = 0
        self.handlers: dict[type, Handler] = {StopFellow: self._on_stop}
        self.loaded_models: Callable[[], list[LoadedModel]] = lambda: []
        self.stopped = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.on_stop: list[Callable[[], Awaitable[None]]] = []

    async def start(self) -> None:
        self.nc = await connect(self.settings.nats_url or "nats://127.0.0.1:4222",
                                name=f"swarm-fellow-{self.fellow_id}")
        self.js = self.nc.jetstream()
        await ensure_streams(self.js)
        await self.beat()
        self._tasks = [asyncio.create_task(self._heartbeats(), name="heartbeats"),
                       asyncio.create_task(self._commands(), name="commands")]
        log.info("fellow %s up, capabilities %s", self.fellow_id, ",".join(self.capabilities) or "-")

    def heartbeat(self) -> Heartbeat:
        total, free = hardware.memory_bytes()
        self.seq += 1
        return Heartbeat(fellow_id=self.fellow_id, hostname=socket.gethostname(), seq=self.seq,
                         interval_s=self.settings.heartbeat_s, version=VERSION, gpus=hardware.gpus(),
                         memory_total_bytes=total, memory_free_bytes=free,
                         capabilities=self.capabilities, loaded_models=self.loaded_models(),
                         started_at=self.started_at)

    async def beat(self) -> None:
        hb = self.heartbeat()
        await publish_struct(self.js, subjects.heartbeat(self.fellow_id), hb,
                             msg_id=f"hb-{self.fellow_id}-{self.started_at!r}-{hb.seq}")

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self.beat()
            except Exception as exc:  # NATS away for a moment: the next beat tries again
                log.warning("heartbeat not published: %s", exc)

    async def _commands(self) -> None:
        durable = subjects.command_consumer(self.fellow_id)
        sub = await self.js.pull_subscribe(
            subjects.commands_for(self.fellow_id), durable=durable, stream=COMMANDS_STREAM,
            config=ConsumerConfig(durable_name=durable, deliver_policy=DeliverPolicy.ALL,
                                  ack_policy=AckPolicy.EXPLICIT, ack_wait=60,
                                  inactive_threshold=24 * 3600.0),
        )
        while True:
            try:
                msgs = await sub.fetch(16, timeout=5)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            except Exception as exc:
                log.warning("command fetch failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                await msg.ack()  # a command runs at most once; its outcome is reported as events
                try:
                    cmd = command_decoder.decode(msg.data)
                except msgspec.DecodeError as exc:
                    log.warning("dropped a malformed command on %s: %s", msg.subject, exc)
                    continue
                handler = self.handlers.get(type(cmd))
                if handler is None:
                    log.warning("no handler for command %s", type(cmd).__name__)
                    continue
                asyncio.create_task(self._run(handler, cmd))

    async def _run(self, handler: Handler, cmd: Command) -> None:
        try:
            await handler(cmd)
        except Exception:
            log.exception("command %s failed", type(cmd).__name__)

    async def _on_stop(self, cmd: StopFellow) -> None:
        self.stopped.set()

    async def stop(self) -> None:
        await run_hooks(self.on_stop, log)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc is not None and not self.nc.is_closed:
            await close_quietly(self.nc)

    async def run_until_stopped(self) -> None:
        await self.start()
        try:
            await self.stopped.wait()
        finally:
            await self.stop()
