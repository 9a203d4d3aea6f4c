"""The chat completions request body as msgspec Structs, decoded once with OpenAI-style 400s."""

from __future__ import annotations

import re

import msgspec

from leader.errors import ApiError

MAX_LOGPROBS = 20  # top candidates per token (OpenAI's top_logprobs bound; vLLM's default cap)


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: dict | None = None  # {"name", "schema", "strict", "description"} for type json_schema


class ChatBody(msgspec.Struct, kw_only=True):
    """Every field a client may send; unknown ones are ignored, as OpenAI-compatible servers do.

    Fields that SDKs send at their defaults (``user``, ``store``, ``metadata`` ...) need no
    declaration: nothing here depends on them.
    """

    model: str
    messages: list[Message]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    chat_template_kwargs: dict | None = None


_decoder = msgspec.json.Decoder(ChatBody)
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def _param(path: str, message: str) -> str | None:
    """msgspec's ``$.messages[0].role`` path as OpenAI's ``param`` (``messages[0].role``)."""
    path = path.lstrip(".")
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing['field']}" if path else missing["field"]
    return path or None


def decode_struct(body: bytes, decoder: msgspec.json.Decoder):
    """Decode a JSON body with `decoder`; a syntax or type error becomes a 400 that names the parameter."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        found = _AT.match(str(exc))
        message, path = found["msg"], found["path"] or ""
        param = _param(path, message)
        if param is None:
            raise ApiError(400, f"Invalid request body: {message}", code="invalid_request") from None
        raise ApiError(400, f"Invalid value for '{param}': {message}", code="invalid_value",
                       param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "The request body nests too deeply", code="invalid_json") from None


def empty_body() -> ApiError:
    return ApiError(400, "The request body is empty: send a JSON object with 'model' and 'messages'",
                    code="invalid_json")


def decode_body(body: bytes) -> ChatBody:
    """The chat body; an empty one is refused like any other bad body."""
    if not body.strip():
        raise empty_body()
    return decode_struct(body, _decoder)
