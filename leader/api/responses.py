"""POST /v1/responses (and /api/v1/…): OpenAI's Responses API, a subset, run as one chat request.

leader/openai/responses.py turns the body into a chat body and builds the reply and its events;
the request itself is chat's (leader/api/chat.py): the same checks, admission, frames and cancels.
"""

from __future__ import annotations

from litestar import Request, Response, post
from litestar.params import JSONBody
from litestar.response import Stream

from events.frames import DoneFrame, TokenFrame
from leader.api.body import StructBody
from leader.api.deps import Caller, ChatTimeout, LeaderDep, ServingDep, StreamsDep
from leader.api.relay import SSE_HEADERS, Relay, open_relay
from leader.errors import ApiError
from leader.openai.reasoning import Reasoning
from leader.openai.replies import error_event, frame_error, split_pieces
from leader.openai.responses import ResponseBuilder, ResponsesBody, chat_body, decode_body, new_response, renamed
from leader.openai.schema import empty_body
from leader.openai.tokenizer import tokenizer_for
from leader.openai.tool_formats import ToolSpec, check_template
from leader.openai.validate import check_body, request_tools


class ResponsesBodyDTO(StructBody[ResponsesBody]):
    decode = staticmethod(decode_body)


async def _events(relay: Relay, out: ResponseBuilder):
    """The Responses events of one reply: created, the items as their text and calls settle, completed."""
    calls = spec.reader() if (spec := ToolSpec.of(relay.chat)) is not None else None
    split = None if relay.reasoning is None else Reasoning(relay.reasoning)

    def settled(thought: str, text: str) -> bytes:
        return out.thinking(thought) + (_pieces(out, calls.feed(text)) if calls is not None else out.text(text))

    try:
        yield out.start()
        while True:
            frame = await relay.next_frame()
            if isinstance(frame, TokenFrame):
                text = frame.text or "".join(frame.texts)
                yield settled(*split_pieces(split, frame)) if split is not None else settled("", text)
            elif isinstance(frame, DoneFrame):
                tail = settled(*split.flush()) if split is not None else b""
                tail += _pieces(out, calls.flush()) if calls is not None else b""
                events, _ = out.finish(frame, calls.calls if calls is not None else 0,
                                       split.tokens if split is not None else 0)
                yield tail + events
                return
            else:
                raise frame_error(frame)
    except ApiError as exc:
        yield error_event(exc)
    finally:
        relay.stream.close(cancel=True, grace_s=0)


def _pieces(out: ResponseBuilder, pieces: list) -> bytes:
    """Settled text, and calls as they stream (leader.openai.tools.CallStream's pieces)."""
    emit = {"text": out.text, "start": out.call_start, "args": out.call_args, "end": out.call_end}
    return b"".join(emit[kind](p) for kind, p in pieces)


async def _whole(relay: Relay, out: ResponseBuilder) -> Response:
    answer = await relay.answer()
    spec = ToolSpec.of(relay.chat)
    content, calls = spec.parse(answer.text) if spec is not None else (answer.text, [])
    out.thinking(answer.thinking or "")
    out.text(content or "")
    for call in calls:
        out.call(call)
    _, final = out.finish(answer.done, len(calls), answer.reasoning_tokens)
    return Response(final, media_type="application/json")


@post(["/v1/responses", "/api/v1/responses"], opt={"scope": "operate"}, status_code=200,
      dto=ResponsesBodyDTO, return_dto=None,
      tags=["chat"], summary="OpenAI Responses (a subset), streamed as SSE events or in one reply")
async def responses(request: Request, leader: LeaderDep, serving: ServingDep, streams: StreamsDep, caller: Caller,
                    chat_timeout_s: ChatTimeout, data: JSONBody[ResponsesBody | None] = None) -> Response[dict]:
    """The reply is a ``response`` object, or with ``stream`` the Responses events as server-sent events."""
    if data is None:
        raise empty_body()
    try:
        body = chat_body(data)
        messages = check_body(body)
    except ApiError as exc:
        raise renamed(exc) from None
    ready = await serving.ready_load(body.model, leader.settings.leader.autoload)
    if request_tools(body)[0]:
        check_template(tokenizer_for(ready.model_dir).chat_template)
    relay = await open_relay(leader, streams, caller, chat_timeout_s, body, messages, ready)
    out = new_response(data)
    if body.stream:
        return Stream(_events(relay, out), media_type="text/event-stream", headers=SSE_HEADERS)
    return await relay.complete(request, lambda: _whole(relay, out))
