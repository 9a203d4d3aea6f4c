"""A real fellow keeps obeying after poisoned commands, and unload/load/unload in quick succession leaves
no stage process behind (issue 21, items 3 and 4)."""

from __future__ import annotations

import asyncio

import pytest

from core.bus import publish_struct
from events import subjects
from events.commands import LoadStage
from events.loads import StageAssignment
from events.subjects import COMMANDS_STREAM
from tests.processes import children_of, pid_alive, wait_until
from tests.serving_fixtures import Stack, make_servable

MODEL = "tiny-a"


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_servable(root, MODEL, layers=2, hidden=64, stages=1, seed=1)
    return root / "servables"


def nested(depth: int) -> bytes:
    return b'{"verb":"load","x":' + b"[" * depth + b"]" * depth + b"}"


POISON = [b"not json", nested(100_000), b'{"verb":"load","load_id":5}', b'{"verb":"nope"}', b"\xff\xfe"]


def stage_processes(stack: Stack) -> list[int]:
    return [c for c in children_of(stack.fellows[0].proc.pid) if pid_alive(c)]


def state_of(stack: Stack) -> str:
    return stack.get(f"/api/v1/models/{MODEL}").json()["load_state"]


def fellow_view(stack: Stack) -> dict:
    return next(f for f in stack.get("/api/v1/fellows").json()["data"] if f["id"] == "f0")


def unload(stack: Stack) -> None:
    r = stack.post(f"/api/v1/models/{MODEL}/unload")
    assert r.status_code == 200, r.text


async def test_poisoned_commands_leave_the_fellow_obeying(tmp_path, nats_server, js, servables):
    stack = await asyncio.to_thread(lambda: Stack(tmp_path, nats_server.url, servables).start())
    try:
        for verb in ("load", "unload"):
            for i, data in enumerate(POISON):
                await js.publish(subjects.command("f0", verb), data, headers={"Nats-Msg-Id": f"poison-{verb}-{i}"})
        # a handler that raises: a load whose log file cannot be opened
        raising = LoadStage(load_id="no/such-dir", model_id=MODEL, assignment=StageAssignment(stage=0, fellow_id="f0"),
                            model_path=str(servables / MODEL))
        ack = await publish_struct(js, subjects.command("f0", "load"), raising, msg_id="poison-raises")

        async def taken() -> bool:
            info = await js.consumer_info(COMMANDS_STREAM, subjects.command_consumer("f0"))
            return info.delivered.stream_seq >= ack.seq and info.num_ack_pending == 0

        while not await taken():
            await asyncio.sleep(0.05)
        await asyncio.to_thread(wait_until, lambda: "command LoadStage failed" in stack.fellows[0].tail(10**6),
                                30, "the raising handler logged")
        # a real load and unload still work
        load = await asyncio.to_thread(stack.load, MODEL)
        pid = load["stages"][0]["pid"]
        await asyncio.to_thread(unload, stack)
        await asyncio.to_thread(wait_until, lambda: not pid_alive(pid), 30, "the stage stopped on unload")
        await asyncio.to_thread(wait_until, lambda: state_of(stack) == "unloaded", 30, "the load unloaded")
        assert stack.fellows[0].proc.poll() is None
        log = stack.fellows[0].tail(10**6)
        assert log.count("dropped a command") == 2 * len(POISON), log
        assert "RecursionError" in log and "Traceback" not in log
        assert stage_processes(stack) == []
    finally:
        await asyncio.to_thread(stack.stop)


def load_at_once(stack: Stack) -> None:
    r = stack.post(f"/api/v1/models/{MODEL}/load", {})  # a new load, not waited for
    assert r.status_code == 200 and r.json()["state"] in ("requested", "loading"), r.text


def test_unload_load_unload_leaves_no_stage_process(tmp_path, nats_server, servables):
    stack = Stack(tmp_path, nats_server.url, servables, SWARM_MODEL_IDLE_UNLOAD_S=0).start()
    try:
        rounds = 8
        for i in range(rounds):
            if i % 4 == 0:
                stack.load(MODEL)  # now and then from a ready load, otherwise from one still loading
            else:
                load_at_once(stack)
            unload(stack)
            load_at_once(stack)
            unload(stack)  # at once: the fellow may not have started its stage yet
        wait_until(lambda: stage_processes(stack) == [], 60, "every stage process gone")
        wait_until(lambda: state_of(stack) == "unloaded", 60, "the model unloaded")
        ended = lambda: stack.sql("SELECT state, count(*) FROM loads GROUP BY state")  # noqa: E731
        wait_until(lambda: ended() == [("unloaded", 2 * rounds)], 60, f"all {2 * rounds} loads unloaded")
        assert stack.sql("SELECT DISTINCT state FROM load_stages") == [("unloaded",)]
        wait_until(lambda: fellow_view(stack)["loaded_models"] == [], 30, "the heartbeat lists nothing")
        assert fellow_view(stack)["status"] == "online"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.sql('SELECT load_id, state, reason FROM loads')}") from None
    finally:
        stack.stop()
