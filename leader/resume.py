"""Resuming a streamed reply: a client that lost its connection posts the same body again with the
Last-Event-ID of the last chunk it got, and gets the rest of the reply from SWARM_TOKENS.

The request must be a streamed one of the same model, and (with API tokens) of the same token;
anything else is a 404, so a request id alone reveals nothing.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import async_sessionmaker

from events import subjects
from events.frames import ErrorFrame
from events.requests import ChatRequest
from leader.db.tables import Request
from leader.errors import ApiError
from leader.frames_in import parse_event_id
from leader.projectors.runner import ProjectionLagging, ProjectionRunner
from leader.token_stream import TokenStream, TokenStreams

ROW_WAIT_S = 5.0  # a request accepted a moment ago may not be projected yet


class Records(Protocol):
    """Where a resumed request's row is read (leader.context.Leader, as the handlers get it)."""

    sessions: async_sessionmaker
    js: JetStreamContext
    projections: ProjectionRunner  # the requests projection, waited for when the row is not there yet


async def _row(leader: Records, request_id: str) -> Request | None:
    async with leader.sessions() as session:
        row = await session.get(Request, request_id)
    if row is not None:
        return row
    try:
        info = await leader.js.stream_info(subjects.EVENTS_STREAM)
        await leader.projections.wait_for(info.state.last_seq, ["requests"], timeout=ROW_WAIT_S)
    except (NatsError, asyncio.TimeoutError, ProjectionLagging):
        return None
    async with leader.sessions() as session:
        return await session.get(Request, request_id)


async def resume(leader: Records, streams: TokenStreams, caller, last_event_id: str, model: str) -> tuple[TokenStream,
                                                                                                ChatRequest]:
    """The stream of the reply `last_event_id` names, from the frame after it, and the request it
    belongs to (enough of it for the relay). The stream is `ended` when the reply's last frame came
    before it (the client lost the connection just before [DONE])."""
    parsed = parse_event_id(last_event_id)
    if parsed is None:
        raise ApiError(400, "Last-Event-ID is not the id of a chunk of this API", code="invalid_last_event_id")
    rid, next_seq = parsed
    row = await _row(leader, rid)
    if (row is None or not row.stream or row.model_id != model
            or (caller is not None and row.token_id != caller.token_id)):
        raise ApiError(404, f"No streamed reply of '{model}' has the event id {last_event_id!r} to resume",
                       code="stream_not_found")
    try:
        stream = await streams.resume(rid, row.load_id, next_seq)
    except NatsError as exc:
        raise ApiError(503, f"The message bus is unavailable: {exc or type(exc).__name__}",
                       code="bus_unavailable") from None
    # after the frames the stream holds, if they do not end it themselves
    if row.status == "failed" and not stream.ended:
        stream.fail(ErrorFrame(request_id=rid, seq=-1, code=row.error_code or "load_failed",
                               message=row.error_message or "the request failed"))
    chat = ChatRequest(request_id=rid, load_id=row.load_id, model_id=row.model_id, messages=[],
                       max_tokens=row.max_tokens, created=row.accepted_at)
    return stream, chat
