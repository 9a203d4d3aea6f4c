"""The fellow agent's command loop against a real nats-server: one load's commands in order, a handler that
raises or a loop that ends, and a stop that leaves no task behind."""

from __future__ import annotations

import asyncio

from core.bus import publish_struct
from events import subjects
from events.commands import LoadStage, UnloadStage
from events.loads import StageAssignment
from fellow.agent import FellowAgent
from fellow.main import run_fellow
from tests.conftest import make_settings


class Recorder:
    """Real handlers registered the way features register theirs; they note what ran, in order."""

    def __init__(self, agent: FellowAgent):
        self.seen: list[tuple[str, str]] = []
        self.changed = asyncio.Event()
        self.release = {"A": asyncio.Event(), "C": asyncio.Event()}
        agent.handlers.update({LoadStage: self.on_load, UnloadStage: self.on_unload})

    def note(self, what: str, load_id: str) -> None:
        self.seen.append((what, load_id))
        self.changed.set()

    async def on_load(self, cmd: LoadStage) -> None:
        self.note("load", cmd.load_id)
        try:
            if cmd.load_id in self.release:
                await self.release[cmd.load_id].wait()
        except asyncio.CancelledError:
            self.note("cancelled", cmd.load_id)
            raise
        self.note("loaded", cmd.load_id)

    async def on_unload(self, cmd: UnloadStage) -> None:
        if cmd.load_id == "boom":
            raise RuntimeError("a handler that fails\non two lines")
        self.note("unload", cmd.load_id)

    async def wait_for(self, entry: tuple[str, str], timeout: float = 20.0) -> None:
        async def seen():
            while entry not in self.seen:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(seen(), timeout)


async def send(js, fellow_id: str, cmd) -> None:
    verb = "load" if isinstance(cmd, LoadStage) else "unload"
    await publish_struct(js, subjects.command(fellow_id, verb), cmd, msg_id=cmd.id)


def load(load_id: str, fellow_id: str) -> LoadStage:
    return LoadStage(load_id=load_id, model_id="m", assignment=StageAssignment(stage=0, fellow_id=fellow_id))


def command_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("command-") and not t.done()]


async def test_one_loads_commands_apply_in_order_and_stop_leaves_no_task(tmp_path, nats_server, js, caplog):
    agent = FellowAgent(make_settings(tmp_path, nats_server.url), fellow_id="fx")
    rec = Recorder(agent)
    await agent.start()
    try:
        for cmd in (load("A", "fx"), UnloadStage(load_id="A"), load("B", "fx"), UnloadStage(load_id="boom"),
                    UnloadStage(load_id="B")):
            await send(js, "fx", cmd)
        await rec.wait_for(("unload", "B"))  # B's commands ran while A's load still waits
        assert ("unload", "A") not in rec.seen  # A's unload waits for A's load
        assert any("command UnloadStage failed: RuntimeError: a handler that fails on two lines" in r.getMessage()
                   for r in caplog.records)
        rec.release["A"].set()
        await rec.wait_for(("unload", "A"))
        a = [e for e in rec.seen if e[1] == "A"]
        assert a == [("load", "A"), ("loaded", "A"), ("unload", "A")]
        await send(js, "fx", load("C", "fx"))  # never released: stop must end it
        await rec.wait_for(("load", "C"))
        assert len(command_tasks()) == 1
    finally:
        await agent.stop()
    assert ("cancelled", "C") in rec.seen
    assert command_tasks() == []
    assert agent.failure is None


async def test_a_loop_that_ends_stops_the_fellow_with_a_non_zero_exit(tmp_path, nats_server, js):
    run = asyncio.create_task(run_fellow(make_settings(tmp_path, nats_server.url), fellow_id="fz"))

    async def commands_loop() -> asyncio.Task:
        while not (found := [t for t in asyncio.all_tasks() if t.get_name() == "commands"]):
            await asyncio.sleep(0.05)
        return found[0]

    loop = await asyncio.wait_for(commands_loop(), 30)
    # as if it had died: the fellow must not heartbeat on, obeying nothing. Cancelled until it ends:
    # Python 3.11's wait_for (inside nats-py's fetch) can swallow a cancel that lands as its wait ends
    while not loop.done():
        loop.cancel()
        await asyncio.wait([loop], timeout=1)
    assert await asyncio.wait_for(run, 30) == 1
    assert [t for t in asyncio.all_tasks() if t.get_name() in ("commands", "heartbeats")] == []
