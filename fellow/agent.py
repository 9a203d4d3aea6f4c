"""The fellow agent: connects outbound to NATS, publishes heartbeats, consumes its commands."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Awaitable, Callable

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from core.bus import close_quietly, connect, ensure_streams, publish_struct, wait_streams
from core.procs import run_hooks
from core.settings import Settings
from core.tasks import cancel_and_wait
from events import subjects
from events.commands import Command, StopFellow, command_decoder
from events.fellow import Heartbeat, LoadedModel
from events.subjects import COMMANDS_STREAM
from fellow import hardware
from fellow.logs import FellowLogs

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
        self.failure: str | None = None  # why the agent stopped on its own, if a loop of it ended
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        self._loops: list[asyncio.Task] = []  # heartbeats and commands: while the fellow lives, they run
        self._running: set[asyncio.Task] = set()  # commands being applied
        self._latest: dict[str, asyncio.Task] = {}  # load id -> its newest command, which runs after the one before
        self._stopping = False
        self.logs = FellowLogs(self)  # answers swarm.logs.<fellow> with its log tails

    async def start(self) -> None:
        self.nc = await connect(self.settings.nats.url or "nats://127.0.0.1:4222",
                                name=f"swarm-fellow-{self.fellow_id}", credentials=self.settings.nats.credentials)
        self.js = self.nc.jetstream()
        if self.settings.nats.credentials is None:
            await ensure_streams(self.js, self.settings.nats.replicas)
        else:  # a fellow's NATS user may not create streams: the leader does
            await wait_streams(self.js)
        await self.logs.start()
        await self.beat()
        self._loops = [self._supervised(self._heartbeats(), "heartbeats"),
                       self._supervised(self._commands(), "commands")]
        log.info("fellow %s up, capabilities %s", self.fellow_id, ",".join(self.capabilities) or "-")

    def heartbeat(self) -> Heartbeat:
        total, free = hardware.memory_bytes()
        self.seq += 1
        return Heartbeat(fellow_id=self.fellow_id, hostname=socket.gethostname(), seq=self.seq,
                         interval_s=self.settings.fellow.heartbeat_s, version=VERSION, gpus=hardware.gpus(),
                         memory_total_bytes=total, memory_free_bytes=free,
                         capabilities=self.capabilities, loaded_models=self.loaded_models(),
                         started_at=self.started_at)

    async def beat(self) -> None:
        hb = self.heartbeat()
        await publish_struct(self.js, subjects.heartbeat(self.fellow_id), hb,
                             msg_id=f"hb-{self.fellow_id}-{self.started_at!r}-{hb.seq}")

    def _supervised(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._loop_ended)
        return task

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A loop that ends before stop is a dead fellow, not a zombie: stop it, with a non-zero exit."""
        if self._stopping:
            return
        how = "cancelled" if task.cancelled() else f"raised {task.exception()!r}" if task.exception() else "returned"
        self.failure = f"the {task.get_name()} loop ended ({how})"
        log.error("%s; the fellow stops", self.failure)
        self.stopped.set()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.fellow.heartbeat_s)
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
                try:
                    await self._take(msg)
                except Exception as exc:  # whatever the message: one line, and on to the next
                    log.warning("dropped a command on %s: %s", msg.subject, _one_line(exc))

    async def _take(self, msg) -> None:
        await msg.ack()  # a command runs at most once; its outcome is reported as events
        cmd = command_decoder.decode(msg.data)
        handler = self.handlers.get(type(cmd))
        if handler is None:
            log.warning("no handler for command %s", type(cmd).__name__)
            return
        load_id = getattr(cmd, "load_id", None)
        before = self._latest.get(load_id) if load_id else None
        task = asyncio.create_task(self._run(handler, cmd, before), name=f"command-{type(cmd).__name__}")
        self._running.add(task)
        task.add_done_callback(self._done)
        if load_id:
            self._latest[load_id] = task

    def _done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        for load_id in [k for k, t in self._latest.items() if t is task]:
            del self._latest[load_id]

    async def _run(self, handler: Handler, cmd: Command, before: asyncio.Task | None) -> None:
        if before is not None:  # one load's commands apply in the order they came
            await asyncio.wait([before])
        try:
            await handler(cmd)
        except Exception as exc:
            log.error("command %s failed: %s", type(cmd).__name__, _one_line(exc))
            log.debug("command %s failed", type(cmd).__name__, exc_info=True)

    async def _on_stop(self, cmd: StopFellow) -> None:
        self.stopped.set()

    async def stop(self) -> None:
        """The loops and the commands still running end first, then the stop hooks run, then NATS closes."""
        self._stopping = True
        here = asyncio.current_task()  # stop may be called from a command (update): not cancelled
        tasks = [t for t in [*self._loops, *self._running] if t is not here]
        await cancel_and_wait(*tasks)
        await run_hooks(self.on_stop, log)
        self.logs.close()
        if self.nc is not None and not self.nc.is_closed:
            await close_quietly(self.nc)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
