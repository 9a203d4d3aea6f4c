"""For the request-ending and fault tests: a one-stage tiny servable, chats over HTTP, a stream known to
have started, SSE events with their ids, the request rows."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Callable

import httpx
import pytest

from tests.processes import wait_until
from tests.serving_fixtures import Stack, make_servable

FINAL = ("finished", "failed", "too_long")


@pytest.fixture(scope="module")
def servables(tmp_path_factory):
    """A servables root with "tiny-a", one stage (import the fixture into the test module)."""
    root = tmp_path_factory.mktemp("models")
    make_servable(root, "tiny-a", layers=2, hidden=64, stages=1, seed=1)
    return root / "servables"


def chat(content: str, **body) -> dict:
    return {"model": "tiny-a", "messages": [{"role": "user", "content": content}], **body}


async def start_stream(http: httpx.AsyncClient, body: dict) -> asyncio.Task:
    """A streamed chat, returned once its first token came (a stage serves it); the task reads the rest."""
    started = asyncio.get_running_loop().create_future()

    async def read() -> list[dict]:
        events = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                events.append(json.loads(line[6:]))
                if not started.done() and events[-1].get("choices", [{}])[0].get("delta", {}).get("content"):
                    started.set_result(None)
        return events

    task = asyncio.ensure_future(read())
    await asyncio.wait((task, started), return_when=asyncio.FIRST_COMPLETED, timeout=60)
    assert started.done(), task.result() if task.done() else "no token in 60s"
    return task


def rows(stack: Stack) -> list[tuple]:
    return stack.sql("SELECT request_id, status, error_code, finish_reason FROM requests")


def all_final(stack: Stack) -> list[tuple] | None:
    """The request rows once every one has ended, else None."""
    got = rows(stack)
    return got if got and all(status in FINAL for _, status, _, _ in got) else None


def kill_stage_and_wait_restart(stack: Stack, load_id: str, pid: int) -> int:
    """SIGKILL a one-stage load's stage process; the pid of the one its fellow started again, once ready."""
    os.kill(pid, signal.SIGKILL)
    query = "SELECT pid FROM load_stages WHERE load_id = ? AND state = 'ready'"
    return wait_until(lambda: (p := stack.sql(query, load_id)) and p[0][0] != pid and p[0][0], 60,
                      "the stage restarted")


async def read_events(response: httpx.Response, until: str | None = None, out: list | None = None,
                      on_first_text: Callable[[], object] | None = None) -> list[tuple[str | None, dict | str]]:
    """(id, data) of each SSE event, appended to `out` as they come; stops after [DONE], or after the
    chunk whose content is `until`. ``on_first_text`` is called as the first chunk with content comes in,
    before the next is read (a fault injected while the reply is surely under way)."""
    out, event_id = [] if out is None else out, None
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            out.append((event_id, data))
            if on_first_text is not None and content([out[-1]]):
                on_first_text()
                on_first_text = None
            if data == "[DONE]" or (until is not None and content([out[-1]]) == until):
                return out
    return out


def content(events) -> str:
    return "".join(d["choices"][0]["delta"].get("content") or "" for _, d in events
                   if isinstance(d, dict) and d.get("choices"))
