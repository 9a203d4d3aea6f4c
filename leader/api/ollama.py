"""Ollama's API on the same port: ``/api/chat`` and ``/api/generate`` run as one chat request each (the body
translated by leader/ollama/schema.py, the request opened by leader/api/relay.py's open_relay: the same
checks, admission, frames, rows and cancels), streamed as newline-delimited JSON by default; the model
routes (``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``, ``/api/pull``, ``/api/delete``) are in
leader/api/ollama_models.py. Every error comes as Ollama's ``{"error": message}``."""

from __future__ import annotations

from litestar import Request, Response, post
from litestar.params import JSONBody
from litestar.response import Stream

from leader.api.body import StructBody
from leader.api.deps import Caller, ChatTimeout, LeaderDep, ServingDep, StreamsDep
from leader.api.pieces import pieces, whole
from leader.api.relay import open_relay
from leader.errors import ApiError, exception_handlers
from leader.ollama.replies import OllamaReply, line, loaded
from leader.ollama.schema import OllamaBody, chat_body, decode_body, renamed
from leader.openai.schema import empty_body
from leader.openai.tokenizer import tokenizer_for
from leader.openai.tool_formats import check_template
from leader.openai.validate import check_body, request_tools

NDJSON = "application/x-ndjson"
_openai_handler = exception_handlers[Exception]


def ollama_errors(request: Request, exc: Exception) -> Response:
    """The app's error answer (OpenAI's shape) as Ollama's ``{"error": message}``, the same status."""
    answer = _openai_handler(request, exc)
    content = answer.content if isinstance(answer.content, dict) else {}
    message = (content.get("error") or {}).get("message") or "error"
    return Response({"error": message}, status_code=answer.status_code, headers=answer.headers)


class OllamaDTO(StructBody[OllamaBody]):
    decode = staticmethod(decode_body)


async def _lines(relay, out: OllamaReply, model_dir: str):
    try:
        async for kind, value in pieces(relay, model_dir):
            if kind == "done":
                yield line(out.last(value))
            elif (obj := out.piece(kind, value)) is not None:
                yield line(obj)
    except ApiError as exc:
        yield line({"error": exc.detail})
    finally:  # a hang-up before the first frame cancels too
        relay.stream.close(cancel=True, grace_s=0)



async def _serve(request: Request, leader, serving, streams, caller, chat_timeout_s, data: OllamaBody | None,
                 generate: bool) -> Response:
    if data is None:
        raise empty_body()
    body = chat_body(data, generate)
    if (generate and not data.prompt) or (not generate and not data.messages):  # Ollama's "load the model"
        await serving.ready_load(body.model, leader.settings.leader.autoload)
        return Response(loaded(body.model, generate), media_type="application/json")
    try:
        messages = check_body(body)
        ready = await serving.ready_load(body.model, leader.settings.leader.autoload)
        if request_tools(body)[0]:
            check_template(tokenizer_for(ready.model_dir).chat_template)
        relay = await open_relay(leader, streams, caller, chat_timeout_s, body, messages, ready, api="ollama")
    except ApiError as exc:
        raise renamed(exc) from None
    out = OllamaReply(body.model, generate)
    if body.stream:
        return Stream(_lines(relay, out, ready.model_dir), media_type=NDJSON)
    return await relay.complete(request, lambda: whole(relay, ready.model_dir, out.piece, out.whole))


@post("/api/chat", opt={"scope": "operate"}, status_code=200, dto=OllamaDTO, return_dto=None, tags=["ollama"],
      summary="Ollama chat: newline-delimited JSON by default, one object with stream false")
async def ollama_chat(request: Request, leader: LeaderDep, serving: ServingDep, streams: StreamsDep,
                      caller: Caller, chat_timeout_s: ChatTimeout,
                      data: JSONBody[OllamaBody | None] = None) -> Response[dict]:
    return await _serve(request, leader, serving, streams, caller, chat_timeout_s, data, generate=False)


@post("/api/generate", opt={"scope": "operate"}, status_code=200, dto=OllamaDTO, return_dto=None, tags=["ollama"],
      summary="Ollama generate: a prompt (and system) through the model's chat template")
async def ollama_generate(request: Request, leader: LeaderDep, serving: ServingDep, streams: StreamsDep,
                          caller: Caller, chat_timeout_s: ChatTimeout,
                          data: JSONBody[OllamaBody | None] = None) -> Response[dict]:
    return await _serve(request, leader, serving, streams, caller, chat_timeout_s, data, generate=True)
