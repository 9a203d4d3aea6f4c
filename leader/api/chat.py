"""POST /v1/chat/completions (and /api/v1/…): validate, hand the request to its load, relay the frames.

Per request the gateway makes two JetStream publishes (the accepted event and the request);
per token it only decodes a frame and writes its chunk: no SQL and no JetStream round trip.
"""

from __future__ import annotations

import logging

from litestar import Request, Response, post
from litestar.params import JSONBody
from litestar.response import Stream

from leader.api.body import StructBody
from leader.api.choices import chat_choices
from leader.api.deps import Caller, ChatTimeout, LeaderDep, ServingDep, StreamsDep
from leader.api.relay import SSE_HEADERS, Relay, chunk_encoder, open_relay
from leader.openai.replies import DONE, ChatCompletion
from leader.openai.schema import ChatBody, decode_body, empty_body
from leader.openai.tokenizer import check_bias_ids, tokenizer_for
from leader.openai.tool_formats import check_template
from leader.openai.validate import check_body, request_tools
from leader.resume import resume

log = logging.getLogger(__name__)

FRAME_TIMEOUT_S = 600.0  # create_app(chat_timeout_s=...) overrides: the wait for a first (or next) frame


class ChatBodyDTO(StructBody[ChatBody]):
    decode = staticmethod(decode_body)


@post(["/v1/chat/completions", "/api/v1/chat/completions"], opt={"scope": "operate"}, status_code=200,
      dto=ChatBodyDTO, return_dto=None,
      tags=["chat"], summary="OpenAI chat completions, streamed as SSE chunks or in one reply")
async def chat_completions(request: Request, leader: LeaderDep, serving: ServingDep, streams: StreamsDep,
                           caller: Caller, chat_timeout_s: ChatTimeout,
                           data: JSONBody[ChatBody | None] = None) -> Response[ChatCompletion]:
    """The reply is a ChatCompletion, or with ``stream`` its chunks as server-sent events."""
    if data is None:
        raise empty_body()
    body = data
    if body.stream and (last_event_id := request.headers.get("last-event-id")) is not None:
        stream, chat = await resume(leader, streams, caller, last_event_id, body.model)
        if stream.ended:  # the client had every chunk but [DONE]
            stream.close(cancel=False)
            return Stream(iter([DONE]), media_type="text/event-stream", headers=SSE_HEADERS)
        relay = Relay(leader, stream, chat, chat_timeout_s)
        return Stream(relay.events(chunk_encoder(relay, body), resumed=True), media_type="text/event-stream",
                      headers=SSE_HEADERS)
    messages = check_body(body)
    ready = await serving.ready_load(body.model, leader.settings.leader.autoload)
    check_bias_ids(ready.model_dir, body.logit_bias)
    if request_tools(body)[0]:
        check_template(tokenizer_for(ready.model_dir).chat_template)
    if (body.n or 1) > 1:
        return await chat_choices(request, leader, streams, caller, chat_timeout_s, body, messages, ready)
    relay = await open_relay(leader, streams, caller, chat_timeout_s, body, messages, ready)
    if body.stream:
        return Stream(relay.events(chunk_encoder(relay, body)), media_type="text/event-stream", headers=SSE_HEADERS)
    return await relay.complete(request)


