"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, run as one chat request.

leader/anthropic/ translates the body and builds the reply and its events; the request itself is
chat's (leader/api/relay.py's open_relay): the same checks, admission, frames, rows and cancels.
Auth takes ``x-api-key`` as well as ``Authorization: Bearer`` (the same tokens and scopes); every
error, the guard's included, comes in Anthropic's shape.
"""

from __future__ import annotations

import msgspec
from litestar import Request, Response, Router, post
from litestar.params import JSONBody
from litestar.response import Stream
from litestar.types import ASGIApp, Receive, Scope, Send

from leader.anthropic.replies import MessageBuilder, anthropic_status, error_event, error_object
from leader.anthropic.schema import (
    CountBody,
    MessagesBody,
    chat_body,
    decode_body,
    decode_count,
    messages_of,
    thinking_of,
    tool_choice_of,
    tools_of,
)
from leader.api.body import StructBody
from leader.api.deps import Caller, ChatTimeout, LeaderDep, ServingDep, StreamsDep
from leader.api.pieces import pieces, whole
from leader.api.relay import SSE_HEADERS, open_relay
from leader.api.tokenize import model_tokenizer
from leader.errors import ApiError, exception_handlers, renamed_as
from leader.openai.schema import ChatBody, empty_body
from leader.openai.tokenizer import tokenizer_for
from leader.openai.tool_formats import check_template
from leader.openai.validate import chat_messages, check_body, request_tools

_openai_handler = exception_handlers[Exception]
CHAT_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format",
              "parallel_tool_calls": "tool_choice.disable_parallel_tool_use", "chat_template_kwargs": "thinking"}


def api_key_as_bearer(app: ASGIApp) -> ASGIApp:
    """Middleware: Anthropic's ``x-api-key`` header read as the bearer token (when no Authorization came)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            key = headers.get(b"x-api-key")
            if key and b"authorization" not in headers:
                scope["headers"] = [*scope["headers"], (b"authorization", b"Bearer " + key)]
        await app(scope, receive, send)

    return middleware


def anthropic_errors(request: Request, exc: Exception) -> Response:
    """The app's error answer (OpenAI's shape) in Anthropic's: ``{"type": "error", "error": {type, message}}``."""
    answer = _openai_handler(request, exc)
    content = answer.content if isinstance(answer.content, dict) else {}
    message = (content.get("error") or {}).get("message") or "error"
    status, message = anthropic_status(answer.status_code, getattr(exc, "code", None), message)
    return Response(error_object(status, message), status_code=status, headers=answer.headers)


class MessagesDTO(StructBody[MessagesBody]):
    decode = staticmethod(decode_body)


class CountDTO(StructBody[CountBody]):
    decode = staticmethod(decode_count)


async def _events(relay, out: MessageBuilder, model_dir: str):
    try:
        yield out.start()
        async for kind, value in pieces(relay, model_dir):
            yield out.finish(value) if kind == "done" else out.piece(kind, value)
    except ApiError as exc:
        yield error_event(exc)
    finally:  # a hang-up before the first frame cancels too (pieces closes the stream once it runs)
        relay.stream.close(cancel=True, grace_s=0)



@post("/v1/messages", opt={"scope": "operate"}, status_code=200, dto=MessagesDTO, return_dto=None,
      tags=["anthropic"], summary="Anthropic Messages, streamed as its server-sent events or in one reply")
async def messages(request: Request, leader: LeaderDep, serving: ServingDep, streams: StreamsDep, caller: Caller,
                   chat_timeout_s: ChatTimeout, data: JSONBody[MessagesBody | None] = None) -> Response[dict]:
    """The reply is a ``message``, or with ``stream`` Anthropic's events as server-sent events."""
    if data is None:
        raise empty_body()
    body = chat_body(data)
    try:
        chat_messages_ = check_body(body)
        ready = await serving.ready_load(body.model, leader.settings.leader.autoload)
        if request_tools(body)[0]:
            check_template(tokenizer_for(ready.model_dir).chat_template)
        relay = await open_relay(leader, streams, caller, chat_timeout_s, body, chat_messages_, ready,
                                 api="anthropic")
    except ApiError as exc:
        raise renamed_as(exc, CHAT_NAMES) from None
    out = MessageBuilder(body.model)
    if body.stream:
        return Stream(_events(relay, out, ready.model_dir), media_type="text/event-stream", headers=SSE_HEADERS)
    return await relay.complete(request, lambda: whole(relay, ready.model_dir, out.piece, out.whole))


@post("/v1/messages/count_tokens", opt={"scope": "operate"}, status_code=200, dto=CountDTO, return_dto=None,
      tags=["anthropic"], summary="Anthropic: the prompt's token count, as the model's template renders it")
async def count_tokens(leader: LeaderDep, serving: ServingDep, data: JSONBody[CountBody | None] = None) -> dict:
    if data is None:
        raise empty_body()
    choice, _ = tool_choice_of(data.tool_choice)
    body = ChatBody(model=data.model, messages=messages_of(data.system, data.messages), tools=tools_of(data.tools),
                    tool_choice=choice, chat_template_kwargs=thinking_of(data.thinking))
    turns = chat_messages(body.messages)
    tools, _ = request_tools(body)
    tok, _ = await model_tokenizer(serving, data.model, leader.settings.leader.autoload)
    rendered = [msgspec.to_builtins(m) for m in turns]
    kwargs = dict(body.chat_template_kwargs or {})
    if tools:
        check_template(tok.chat_template)
        kwargs["tools"] = tools
    ids = tok.encode(tok.render(rendered, True, **kwargs), add_special_tokens=False)
    return {"input_tokens": len(ids)}


ANTHROPIC = Router("/", route_handlers=[messages, count_tokens], middleware=[api_key_as_bearer],
                   exception_handlers={Exception: anthropic_errors})
