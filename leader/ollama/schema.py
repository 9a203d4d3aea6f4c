"""Ollama's ``/api/chat`` and ``/api/generate`` bodies as a chat body: the same checks, admission and frames as
``/v1/chat/completions`` once translated here.

Served: ``messages`` (system, user, assistant with ``tool_calls``, tool with ``tool_name``), ``prompt`` and
``system`` (generate), ``options`` (temperature, top_p, top_k, min_p, seed, num_predict, stop,
repeat_penalty, presence_penalty, frequency_penalty), ``format`` ("json" or a JSON schema), ``tools``,
``think`` (the model's ``enable_thinking``) and ``stream`` (true by default). Images (and image
generation's ``width``, ``height``, ``steps``), raw prompts, ``suffix``, ``template``, ``context``,
``logprobs`` (served on /v1/chat/completions) and ``keep_alive`` (the idle unload is the server's
SWARM_MODEL_IDLE_UNLOAD_S) are refused with a 400; so is an option this server does not apply.
"""

from __future__ import annotations

import msgspec

from leader.errors import ApiError, renamed_as
from leader.openai.schema import ChatBody, Message, ResponseFormat, decode_struct, empty_body

_enc = msgspec.json.Encoder()
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


class OllamaBody(msgspec.Struct, kw_only=True):
    """Both routes' fields (``messages`` for chat, ``prompt`` for generate); unknown ones are ignored."""

    model: str
    messages: list[dict] | None = None
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    raw: bool | None = None
    context: list | None = None
    images: list | None = None
    tools: list | None = None
    format: str | dict | None = None
    options: dict | None = None
    stream: bool = True
    think: bool | str | None = None
    keep_alive: str | int | float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None


_decoder = msgspec.json.Decoder(OllamaBody)


def decode_body(body: bytes) -> OllamaBody:
    if not body.strip():
        raise empty_body()
    return decode_struct(body, _decoder)


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def _refuse(body: OllamaBody) -> None:
    for name in ("suffix", "template", "context", "images", "logprobs", "top_logprobs", "width", "height", "steps"):
        if getattr(body, name):
            raise bad(name, f"'{name}' is not served by this server", code="unsupported_parameter")
    if body.raw:
        raise bad("raw", "'raw' is not served here: send the prompt to /v1/completions", code="unsupported_parameter")
    if body.keep_alive is not None:
        raise bad("keep_alive", "'keep_alive' is not served: a model unloads after SWARM_MODEL_IDLE_UNLOAD_S idle "
                                "(the server's setting), or by POST /api/v1/models/{id}/unload",
                  code="unsupported_parameter")


def _messages(raw: list) -> list[Message]:
    out, calls_by_name = [], {}
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(where, f"{where} must be an object with 'role' and 'content'")
        role, content = msg.get("role"), msg.get("content", "")
        if content is not None and not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content must be a string")
        if msg.get("images"):
            raise bad(f"{where}.images", "images are not served by this server", code="unsupported_parameter")
        if role == "tool":
            name = msg.get("tool_name") or msg.get("name")
            call_id = calls_by_name.get(name) or msg.get("tool_call_id")
            if not call_id:
                raise bad(f"{where}.tool_name", f"{where} (tool) must name the called tool ('tool_name') of an "
                                                "earlier assistant message")
            out.append(Message(role="tool", content=content or "", tool_call_id=call_id))
            continue
        calls = None
        if msg.get("tool_calls"):
            if role != "assistant" or not isinstance(msg["tool_calls"], list):
                raise bad(f"{where}.tool_calls", f"{where}: only an assistant message holds a list of tool_calls")
            calls = []
            for j, call in enumerate(msg["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad(f"{where}.tool_calls[{j}]", f"{where}.tool_calls[{j}] needs function.name")
                args = fn.get("arguments") or {}
                call_id = call.get("id") or f"call_{i}_{j}"
                calls_by_name[fn["name"]] = call_id
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": fn["name"], "arguments": args if isinstance(args, str) else _enc.encode(args).decode()}})
        out.append(Message(role=role if isinstance(role, str) else "", content=content, tool_calls=calls))
    return out


def _format(fmt) -> ResponseFormat | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ResponseFormat(type="json_object")
    if isinstance(fmt, dict):
        return ResponseFormat(type="json_schema", json_schema={"name": "format", "schema": fmt})
    raise bad("format", "'format' must be \"json\" or a JSON schema object")


def _think(think) -> dict | None:
    if think is None:
        return None
    if isinstance(think, bool):
        return {"enable_thinking": think}
    raise bad("think", "'think' must be true or false on this server (thinking levels are not served)",
              code="unsupported_parameter")


def _options(options: dict | None) -> dict:
    out = {}
    for key, value in (options or {}).items():
        if key not in OPTIONS:
            raise bad(f"options.{key}", f"the option '{key}' is not served by this server (served: "
                                        f"{', '.join(OPTIONS)})", code="unsupported_parameter")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "stop":
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise bad("options.stop", "options.stop must be a list of strings")
        elif not number or (key in ("top_k", "seed", "num_predict") and not isinstance(value, int)):
            raise bad(f"options.{key}", f"options.{key} must be a number")
        if key == "num_predict" and value < 0:
            continue  # -1: until the model stops (the server's bound)
        out[OPTIONS[key]] = value
    return out


_NAMES = {chat: f"options.{name}" for name, chat in OPTIONS.items()} | {"response_format": "format",
                                                                        "chat_template_kwargs": "think"}


def renamed(exc: ApiError) -> ApiError:
    """A chat check's error with Ollama's names (``'max_tokens'`` is ``'options.num_predict'`` here)."""
    return renamed_as(exc, _NAMES)


def chat_body(body: OllamaBody, generate: bool) -> ChatBody:
    """The chat body an Ollama request runs as."""
    if not body.model:
        raise bad("model", "'model' must name a model (see GET /api/tags)")
    _refuse(body)
    if generate:
        messages = ([Message(role="system", content=body.system)] if body.system else []) + [
            Message(role="user", content=body.prompt or "")]
    else:
        if body.messages is None:
            raise bad("messages", "'messages' is required")
        messages = _messages(body.messages)
    tools = body.tools or None
    if generate and tools:
        raise bad("tools", "'tools' are served on /api/chat", code="unsupported_parameter")
    return ChatBody(model=body.model, messages=messages, stream=body.stream, tools=tools,
                    response_format=_format(body.format), chat_template_kwargs=_think(body.think),
                    **_options(body.options))
