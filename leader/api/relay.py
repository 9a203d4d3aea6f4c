"""One accepted chat request on the bus: its frames become a chat.completion or OpenAI chunks (SSE).

The chat, choices and Responses routes open their requests here (``open_relay``, ``submit``) and turn
frames into replies with ``Relay``; leader/openai/replies.py encodes the chunks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from litestar import Request, Response
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import PubAck

from core.bus import publish_struct
from core.settings import Settings
from events import subjects
from events.base import Event, new_id
from events.frames import DoneFrame, ErrorFrame, TokenFrame
from events.requests import ChatRequest, RequestAccepted, RequestFailed, request_failed_id
from leader.errors import ApiError
from leader.frames_in import event_id
from leader.openai.call_readers import LeadingCalls
from leader.openai.reasoning import Reasoning, reasoning_for
from leader.openai.replies import (
    DONE,
    Answer,
    ChunkEncoder,
    calls_reason,
    completion,
    error_event,
    frame_error,
    split_pieces,
)
from leader.openai.schema import ChatBody
from leader.openai.tool_formats import ToolSpec, request_format
from leader.openai.tools import CallStream
from leader.openai.validate import chat_request
from leader.serving.limits import check_payload
from leader.token_stream import FrameTimeout, TokenStream, TokenStreams

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Gateway(Protocol):
    """What a relay uses of the started leader (leader.context.Leader, as the handlers get it)."""

    settings: Settings
    nc: Client  # its payload limit
    js: JetStreamContext
    token_streams: TokenStreams  # keys each request's frames

    async def publish(self, evt: Event, wait: list[str] | None = None, timeout: float = 5.0) -> PubAck: ...


class Relay:
    """One accepted request: its frames become a chat.completion or a stream of chunks."""

    def __init__(self, leader: Gateway, stream: TokenStream, chat: ChatRequest, timeout: float):
        self.leader = leader
        self.stream = stream
        self.chat = chat
        self.timeout = timeout
        self.completion_id = "chatcmpl-" + chat.request_id
        self.created = int(chat.created)
        self.reasoning: bool | None = None  # how the reply's thinking is split (leader.openai.reasoning)

    async def next_frame(self):
        try:
            frame = await self.stream.next(self.timeout)
        except FrameTimeout:
            await self.failed("timeout", f"the model '{self.chat.model_id}' sent nothing for {self.timeout:g}s")
            raise ApiError(504, f"The model '{self.chat.model_id}' did not answer within {self.timeout:g}s",
                           code="timeout") from None
        if isinstance(frame, ErrorFrame) and frame.seq < 0:  # the gateway's own verdict: its load failed
            await self.failed(frame.code, frame.message)
        return frame

    async def failed(self, code: str, message: str) -> None:
        """Record a failure only the gateway saw; the id matches the serving stage's, so one wins."""
        rid = self.chat.request_id
        try:
            await self.leader.publish(RequestFailed(id=request_failed_id(rid), request_id=rid,
                                                    model_id=self.chat.model_id, load_id=self.chat.load_id,
                                                    code=code, message=message))
        except (NatsError, asyncio.TimeoutError) as exc:
            log.warning("recording request %s as failed did not reach the bus: %s", rid, exc)

    async def events(self, enc: ChunkEncoder, resumed: bool = False):
        """SSE bytes: the role chunk at once (not on a resumed stream), a chunk per frame, the finish, then
        [DONE]. Each chunk's id names the next frame, for a client that reconnects (leader.resume)."""
        rid = self.chat.request_id
        calls = spec.reader() if (spec := ToolSpec.of(self.chat)) is not None else None
        split = None if self.reasoning is None or resumed else Reasoning(self.reasoning)
        try:
            if not resumed:
                yield event_id(rid, self.stream.next_seq) + enc.role()
            while True:
                frame = await self.next_frame()
                if isinstance(frame, TokenFrame):
                    text, thought = frame.text or "".join(frame.texts), ""
                    if split is not None:
                        thought, text = split_pieces(split, frame)
                    out = settled(enc, calls, thought, text, frame.logprobs)
                    if out:
                        yield event_id(rid, self.stream.next_seq) + out
                elif isinstance(frame, DoneFrame):
                    reason = None
                    tail = settled(enc, calls, *split.flush()) if split is not None else b""
                    if calls is not None:
                        tail += tool_pieces(enc, calls, calls.flush())
                        reason = calls_reason(frame.finish_reason, calls.calls)
                    yield (event_id(rid, self.stream.next_seq) + tail
                           + enc.finish(frame, reason, None if split is None else split.tokens) + DONE)
                    return
                else:
                    yield error_event(frame_error(frame))
                    return
        except ApiError as exc:
            yield error_event(exc)
        finally:  # a hang-up cancels after a grace, unless the client resumes; a no-op once the last frame came
            self.stream.close(cancel=True, grace_s=self.leader.settings.leader.stream_resume_s)

    async def answer(self) -> Answer:
        """Every frame of the reply, collected."""
        answer = Answer(0, self.chat.sampling.logprobs is not None, reasoning=self.reasoning)
        while True:
            frame = await self.next_frame()
            if isinstance(frame, TokenFrame):
                answer.add(frame)
            elif isinstance(frame, DoneFrame):
                answer.finish(frame)
                return answer
            else:
                raise frame_error(frame)

    async def collect(self) -> Response:
        answer = await self.answer()
        body = completion(self.completion_id, self.created, self.chat.model_id, [answer], ToolSpec.of(self.chat))
        return Response(body, media_type="application/json")

    async def complete(self, request: Request, collect=None) -> Response:
        """The whole reply at once (``collect()``'s, chat's by default); a client that hangs up first
        cancels the generation."""
        collect = asyncio.ensure_future((collect or self.collect)())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
            self.stream.close(cancel=True)
        if collect.done() and not collect.cancelled():
            return collect.result()
        return Response(b"", status_code=499)  # nobody is listening any more


def settled(enc: ChunkEncoder, calls: CallStream | LeadingCalls | None, thought: str, text: str,
            logprobs=None) -> bytes:
    """The chunks of text that settled: thinking, then answer text or (with tools) text and whole calls."""
    if calls is None:
        return enc.pieces(thought, text, logprobs=logprobs)
    return enc.pieces(thought, "") + tool_pieces(enc, calls, calls.feed(text))


def tool_pieces(enc: ChunkEncoder, calls: CallStream | LeadingCalls, pieces: list) -> bytes:
    """Settled text, and tool calls as they stream: a call's head, then its arguments in pieces (a call's
    number counts the calls before it)."""
    out, number = [], calls.calls - sum(1 for kind, _ in pieces if kind == "start")
    current = number - 1  # a call whose head went out with earlier pieces
    for kind, piece in pieces:
        if kind == "text":
            out.append(enc.text(piece))
        elif kind == "start":
            current, number = number, number + 1
            out.append(enc.tool_delta(current, piece))
        elif kind == "args":
            out.append(enc.tool_delta(current, {"function": {"arguments": piece}}))
    return b"".join(out)


async def disconnected(request: Request) -> None:
    """Return once the client hangs up (the body is already read, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def submit(leader: Gateway, chat: ChatRequest, stream: bool, token_id: str, api: str = "openai") -> None:
    chat = leader.token_streams.keyed(chat)  # only the stage that takes it can sign its frames
    accepted = RequestAccepted(id=f"acc-{chat.request_id}", request_id=chat.request_id, model_id=chat.model_id,
                               load_id=chat.load_id, stream=stream, max_tokens=chat.max_tokens,
                               token_id=token_id, api=api)
    try:
        await asyncio.gather(publish_struct(leader.js, subjects.request(chat.load_id), chat, msg_id=chat.request_id),
                             leader.publish(accepted))  # the request first: its stage waits for it
    except (NatsError, asyncio.TimeoutError) as exc:
        raise ApiError(503, f"The message bus did not take the request: {exc or type(exc).__name__}",
                       code="bus_unavailable") from None


def chunk_encoder(relay: Relay, body: ChatBody) -> ChunkEncoder:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return ChunkEncoder(relay.completion_id, relay.created, relay.chat.model_id, include_usage)


async def open_relay(leader: Gateway, streams: TokenStreams, caller, timeout: float, body: ChatBody, messages: list,
                     ready, api: str = "openai") -> Relay:
    """One checked chat body as an accepted request on ``ready``'s load, its frames subscribed first;
    ``api`` names the HTTP API it came through (the audit's ``requests.api``)."""
    chat = chat_request(body, messages, new_id(), ready.load_id, ready.generation, ready.context_tokens,
                        tool_format=request_format(body, ready.model_dir))
    check_payload(leader.nc, chat)  # a 413 before anything is recorded
    try:
        stream = await streams.open(chat.request_id, chat.load_id, chat)  # before the request: no frame is missed
    except NatsError as exc:
        raise ApiError(503, f"The message bus is unavailable: {exc or type(exc).__name__}",
                       code="bus_unavailable") from None
    try:
        await submit(leader, chat, bool(body.stream), caller.token_id if caller else "", api)
    except BaseException:
        stream.close(cancel=True)
        raise
    relay = Relay(leader, stream, chat, timeout)
    relay.reasoning = reasoning_for(ready.model_dir, chat)
    return relay
