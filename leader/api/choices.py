"""Replies of several choices (chat with ``n`` > 1, every completion): one request per choice, their frames merged.

Each choice is a request of its own on the load (choice i samples with the request's seed + i), so
the stage batches their decode like any requests in flight, and each choice is exactly what its
seed gives alone. Their frames are merged here by arrival; a choice that fails fails the reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from litestar import Request, Response
from litestar.response import Stream
from nats.errors import Error as NatsError

from events.base import new_id
from events.frames import DoneFrame, TokenFrame
from events.requests import ChatMessage, ChatRequest
from leader.api.relay import SSE_HEADERS, Gateway, Relay, disconnected, submit
from leader.errors import ApiError
from leader.openai.reasoning import reasoning_for
from leader.openai.replies import DONE, Answer, ChunkEncoder, completion, error_event, frame_error, total_usage
from leader.openai.schema import ChatBody
from leader.openai.tool_formats import ToolSpec, request_format
from leader.openai.validate import chat_request, unsupported
from leader.serving import ReadyLoad
from leader.serving.limits import check_payload
from leader.token_stream import TokenStreams


class Choices:
    """The relays of one reply's choices, index i for ``chats[i]``."""

    def __init__(self, relays: list[Relay], prefixes: list[str] | None = None, reasoning: bool | None = None):
        self.relays = relays
        logprobs = [r.chat.sampling.logprobs is not None for r in relays]
        self.answers = [Answer(i, lp, (prefixes or [""] * len(relays))[i], reasoning) for i, lp in enumerate(logprobs)]

    @classmethod
    async def open(cls, leader: Gateway, streams: TokenStreams, chats: list[ChatRequest], stream: bool, token_id: str,
                   timeout: float, prefixes: list[str] | None = None, reasoning: bool | None = None) -> "Choices":
        """Subscribe to every choice's frames, then submit them all (nothing is recorded on a bad payload)."""
        for chat in chats:
            check_payload(leader.nc, chat)
        opened: list = []
        try:
            for chat in chats:
                opened.append(await streams.open(chat.request_id, chat.load_id, chat))
        except NatsError as exc:
            for s in opened:
                s.close(cancel=True)
            raise ApiError(503, f"The message bus is unavailable: {exc or type(exc).__name__}",
                           code="bus_unavailable") from None
        try:
            await asyncio.gather(*(submit(leader, chat, stream, token_id) for chat in chats))
        except BaseException:
            for s in opened:
                s.close(cancel=True)
            raise
        return cls([Relay(leader, s, chat, timeout) for s, chat in zip(opened, chats)], prefixes, reasoning)

    def close(self) -> None:
        for relay in self.relays:
            relay.stream.close(cancel=True)  # a no-op cancel once the last frame came

    async def frames(self) -> AsyncIterator[tuple[Answer, TokenFrame | DoneFrame]]:
        """Every choice's token and done frames as they come, until each is done; a failure raises."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(answer: Answer, relay: Relay) -> None:
            try:
                while True:
                    frame = await relay.next_frame()
                    await queue.put((answer, frame))
                    if not isinstance(frame, TokenFrame):
                        return
            except Exception as exc:  # a timeout (ApiError) or the bus: the reply fails
                await queue.put((answer, exc))

        tasks = [asyncio.ensure_future(pump(a, r)) for a, r in zip(self.answers, self.relays)]
        try:
            left = len(tasks)
            while left:
                answer, frame = await queue.get()
                if isinstance(frame, BaseException):
                    raise frame
                if isinstance(frame, TokenFrame):
                    answer.add(frame)
                elif isinstance(frame, DoneFrame):
                    answer.finish(frame)
                    left -= 1
                else:
                    raise frame_error(frame)
                yield answer, frame
        finally:
            for task in tasks:
                task.cancel()

    async def events(self, first: Callable[[Answer], bytes], piece: Callable[[Answer, TokenFrame], bytes | None],
                     finish: Callable[[Answer, bool], bytes], end: Callable[[], bytes]) -> AsyncIterator[bytes]:
        """SSE bytes: ``first`` per choice at once, ``piece`` per token frame, ``finish`` per choice (True for
        the last), then ``end`` and [DONE]; a failure ends the stream with an error event."""
        frames = self.frames()
        try:
            yield b"".join(first(a) for a in self.answers)
            left = len(self.answers)
            async for answer, frame in frames:
                if isinstance(frame, TokenFrame):
                    chunk = piece(answer, frame)
                    if chunk:
                        yield chunk
                else:
                    left -= 1
                    yield finish(answer, left == 0) + (end() + DONE if left == 0 else b"")
        except ApiError as exc:
            yield error_event(exc)
        finally:
            await frames.aclose()  # its pumps stop now, not when it is collected
            self.close()

    def stream(self, *handlers) -> Stream:
        return Stream(self.events(*handlers), media_type="text/event-stream", headers=SSE_HEADERS)

    async def whole(self, request: Request, body: Callable[[list[Answer]], bytes]) -> Response:
        """Every choice at once; a client that hangs up first cancels them all."""
        async def collect() -> Response:
            async for _ in self.frames():
                pass
            return Response(body(self.answers), media_type="application/json")

        task = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
            self.close()
        if task.done() and not task.cancelled():
            return task.result()
        return Response(b"", status_code=499)


def text_of(frame: TokenFrame) -> str:
    return frame.text or "".join(frame.texts)


async def chat_choices(request: Request, leader: Gateway, streams: TokenStreams, caller, timeout: float, body: ChatBody,
                       messages: list[ChatMessage], ready: ReadyLoad) -> Response:
    """A chat reply of ``n`` choices, whole or streamed."""
    fmt = request_format(body, ready.model_dir)
    chats = [chat_request(body, messages, new_id(), ready.load_id, ready.generation, ready.context_tokens, i, fmt)
             for i in range(body.n)]
    if chats[0].tools and body.stream:
        raise unsupported("n", "streamed replies of several choices are not served together with 'tools'")
    choices = await Choices.open(leader, streams, chats, bool(body.stream), caller.token_id if caller else "", timeout,
                                 reasoning=reasoning_for(ready.model_dir, chats[0]))
    cid, created = "chatcmpl-" + chats[0].request_id, int(chats[0].created)
    if not body.stream:
        spec = ToolSpec.of(chats[0])
        return await choices.whole(request, lambda answers: completion(cid, created, body.model, answers, spec))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    enc = ChunkEncoder(cid, created, body.model, include_usage)
    return choices.stream(
        lambda a: enc.role(a.index),
        lambda a, f: enc.pieces(*a.last, a.index, f.logprobs),
        lambda a, last: enc.pieces(*a.last, a.index)
        + enc.finish_choice(a.index, a.done.finish_reason, last and not include_usage, a.done),
        lambda: enc.end(total_usage(choices.answers), choices.answers[0].done))
