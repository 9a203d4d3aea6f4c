"""A real stage process on the bus: it survives messages that do not decode (issue 21, item 3) and
requests it cannot serve (item 2), serves the next one, and records every request before it exits."""

from __future__ import annotations

import asyncio
import json

import pytest

from core.bus import settle
from events import subjects
from events.frames import DoneFrame, ErrorFrame
from events.requests import RequestFinished
from events.stage import ReadyReport, StageConfig, StageOptions
from events.union import decode_event
from fellow.stage_process import StageProcess
from tests.processes import free_port, pid_alive
from tests.serving_fixtures import chat_over_bus, make_servable

POISON = [b"not json", json.dumps({"request_id": 5, "messages": "hi"}).encode(),
          b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"]  # msgspec raises RecursionError on this one


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    return make_servable(tmp_path_factory.mktemp("models"), "tiny", layers=2, hidden=64)[1]


async def test_a_stage_skips_what_does_not_decode_and_serves_on(tmp_path, nats_server, nc, js, servable):
    reports, exits = [], []

    async def on_report(proc, report):
        reports.append(report)

    async def on_exit(proc, code):
        exits.append(code)

    cfg = StageConfig(load_id="ld-intake", model_id="tiny", model_dir=str(servable), nats_url=nats_server.url,
                      fellow_id="f-test", options=StageOptions(kv_tokens=2048), report_s=0.2)
    log_path = tmp_path / "stage.log"
    proc = StageProcess(cfg, on_report, on_exit, log_path=log_path)
    await proc.start()
    try:
        while proc.ready is None:
            assert not proc.exited.is_set(), log_path.read_text()
            await asyncio.sleep(0.05)
        assert isinstance(reports[0], ReadyReport) and reports[0].kv_tokens <= 2048
        for i, data in enumerate(POISON):
            await js.publish(subjects.request(cfg.load_id), data, headers={"Nats-Msg-Id": f"poison-{i}"})
        _, frames, _, _ = await chat_over_bus(nc, js, cfg.load_id, "tiny", "Hi", max_tokens=6, temperature=-1.0,
                                              timeout=60)  # decodes, and Sampling refuses it
        assert isinstance(frames[-1], ErrorFrame) and frames[-1].code == "invalid_request", frames
        _, frames, _, _ = await chat_over_bus(nc, js, cfg.load_id, "tiny", "Hi", max_tokens=6, temperature=0.8,
                                              seed=2**64, timeout=60)  # torch refuses the seed at admission
        assert isinstance(frames[-1], ErrorFrame) and frames[-1].code == "admission_failed", frames
        # a client that hung up before the stage took its request: the cancel came first, and is kept
        await nc.publish(subjects.cancel(cfg.load_id, "rq-early"), b"")
        await settle(nc)  # through the server before the request is: the stage's connection gets it first
        _, frames, early, _ = await chat_over_bus(nc, js, cfg.load_id, "tiny", "Hello there", max_tokens=500,
                                                  request_id="rq-early", timeout=60)
        assert isinstance(frames[-1], DoneFrame) and frames[-1].finish_reason == "cancelled", frames
        assert len(early) < 500
        rid, frames, tokens, _ = await chat_over_bus(nc, js, cfg.load_id, "tiny", "Hello there", max_tokens=6,
                                                     timeout=60)
        assert isinstance(frames[-1], DoneFrame) and tokens and pid_alive(proc.pid)
        info = await js.consumer_info(subjects.REQUESTS_STREAM, subjects.request_consumer(cfg.load_id))
        assert info.num_pending == 0 and info.num_ack_pending == 0  # the poison was acked, not redelivered
        await proc.stop("requested")  # right after the done frame: its RequestFinished must not be lost
    finally:
        await proc.stop("requested")
    assert exits == [0]
    skipped = [line for line in log_path.read_text().splitlines() if "does not decode" in line]
    assert len(skipped) == len(POISON), log_path.read_text()
    assert "RecursionError" in skipped[2]
    finished = await js.get_last_msg(subjects.EVENTS_STREAM, subjects.event("request.finished"))
    evt = decode_event(finished.data)
    assert isinstance(evt, RequestFinished) and evt.request_id == rid and evt.completion_tokens == len(tokens)


async def run_to_exit(cfg: StageConfig, log_path) -> tuple[list[int], list]:
    """Start a stage process with ``cfg`` and wait for it to exit: (exit codes, reports)."""
    exits, reports = [], []

    async def on_report(proc, report):
        reports.append(report)

    async def on_exit(proc, code):
        exits.append(code)

    proc = StageProcess(cfg, on_report, on_exit, log_path=log_path)
    await proc.start()
    await asyncio.wait_for(proc.exited.wait(), 120)
    return exits, reports


async def test_a_stage_whose_bus_side_dies_exits_non_zero(tmp_path, servable):
    cfg = StageConfig(load_id="ld-nobus", model_id="tiny", model_dir=str(servable),
                      nats_url=f"nats://127.0.0.1:{free_port()}", fellow_id="f-test")  # nobody listens there
    exits, reports = await run_to_exit(cfg, tmp_path / "stage.log")
    assert exits == [1] and reports == [], (tmp_path / "stage.log").read_text()


async def test_a_stage_that_cannot_hold_one_planned_session_refuses_the_load_naming_itself(tmp_path, servable):
    """Placement planned more KV tokens a request than the stage holds in all: it reports why and exits."""
    cfg = StageConfig(load_id="ld-small", model_id="tiny", model_dir=str(servable),
                      nats_url=f"nats://127.0.0.1:{free_port()}", fellow_id="f-small",
                      options=StageOptions(max_in_flight=1, kv_tokens=10_000_000))  # past any CPU stage's cap
    exits, reports = await run_to_exit(cfg, tmp_path / "stage.log")
    assert exits == [1], (tmp_path / "stage.log").read_text()
    reason = reports[0].reason
    assert reason.startswith("stage 0 on fellow f-small holds ") and "less than one session (10000000" in reason, reason
