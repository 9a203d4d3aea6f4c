"""Anthropic's Messages request (``POST /v1/messages``) as a chat body: the same checks, admission and
frames as ``/v1/chat/completions`` (leader/api/chat.py) once translated here.

Served: ``system`` (text or text blocks), ``messages`` with ``text``, ``tool_use`` and ``tool_result``
blocks (``thinking`` blocks of earlier turns are left out, as the chat template leaves them out),
``max_tokens`` (required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``metadata``, ``tools``
with ``tool_choice`` (auto, any, tool, none), ``thinking`` (enabled or disabled: the model's
``enable_thinking``; so is ``output_config.effort``: low is off), ``output_config.format`` (a JSON
schema the reply follows) and ``stream``. ``cache_control`` needs nothing: the prefix cache is
automatic. Anything else that would change the reply is refused with a 400.
"""

from __future__ import annotations

import msgspec

from leader.errors import ApiError
from leader.openai.schema import ChatBody, Message, ResponseFormat, decode_struct, empty_body

MAX_STOP = 4  # the chat path's bound on stop strings
_enc = msgspec.json.Encoder()


class MessagesBody(msgspec.Struct, kw_only=True):
    """Every field the Messages API takes that this server reads; unknown ones are ignored."""

    model: str
    messages: list[dict]
    max_tokens: int
    system: str | list | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    stream: bool | None = None
    service_tier: str | None = None
    container: str | dict | None = None
    mcp_servers: list | None = None
    output_config: dict | None = None
    speed: str | None = None
    inference_geo: str | None = None


class CountBody(msgspec.Struct, kw_only=True):
    """``/v1/messages/count_tokens``: the prompt's fields only."""

    model: str
    messages: list[dict]
    system: str | list | None = None
    tools: list | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None


_decoder = msgspec.json.Decoder(MessagesBody)
_count_decoder = msgspec.json.Decoder(CountBody)


def decode_body(body: bytes) -> MessagesBody:
    if not body.strip():
        raise empty_body()
    return decode_struct(body, _decoder)


def decode_count(body: bytes) -> CountBody:
    if not body.strip():
        raise empty_body()
    return decode_struct(body, _count_decoder)


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


def _block_type(param: str, block) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(param, f"{param} must be a content block: an object with a 'type'")
    return block["type"]


def _text_of(param: str, block: dict) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{param}.text", f"{param}.text must be a string")
    return text


def _unserved(param: str, kind: str) -> ApiError:
    what = "image and document input" if kind in ("image", "document") else f"'{kind}' blocks"
    return ApiError(400, f"{param}: {what} are not served by this server (text, tool_use and tool_result "
                         "blocks are)", code="unsupported_parameter", param=param)


def _system(system) -> list[Message]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [Message(role="system", content=system)]
    texts = []
    for i, block in enumerate(system):
        if _block_type(f"system[{i}]", block) != "text":
            raise _unserved(f"system[{i}]", block["type"])
        texts.append(_text_of(f"system[{i}]", block))
    return [Message(role="system", content="\n\n".join(texts))]


def _result_text(param: str, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad(param, f"{param} must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(content):
        if _block_type(f"{param}[{i}]", block) != "text":
            raise _unserved(f"{param}[{i}]", block["type"])
        texts.append(_text_of(f"{param}[{i}]", block))
    return "".join(texts)


def _turn(i: int, msg) -> list[Message]:
    param = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad(param, f"{param} must be an object with 'role' and 'content'")
    role, content = msg.get("role"), msg.get("content")
    if role == "system":  # a system turn among the messages (Claude Code sends them): text only
        return _system(content)
    if role not in ("user", "assistant"):
        raise bad(f"{param}.role", f"{param}.role must be 'user', 'assistant' or 'system'")
    if isinstance(content, str):
        return [Message(role=role, content=content)]
    if not isinstance(content, list):
        raise bad(f"{param}.content", f"{param}.content must be a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = _block_type(where, block)
        if kind == "text":
            texts.append(_text_of(where, block))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's thinking: the chat template leaves it out anyway
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad(where, f"{where} (tool_use) needs a string 'id' and 'name'")
            if not isinstance(block.get("input"), dict):
                raise bad(f"{where}.input", f"{where}.input must be an object")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": _enc.encode(block["input"]).decode()}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{where}.tool_use_id", f"{where} (tool_result) needs the 'tool_use_id' it answers")
            text = _result_text(f"{where}.content", block.get("content"))
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(Message(role="tool", tool_call_id=block["tool_use_id"], content=text))
        elif kind in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
            raise bad(f"{where}.type", f"{where}: a '{kind}' block cannot be in a {role} message")
        else:
            raise _unserved(f"{where}.type", kind)
    text = "".join(texts)
    if role == "assistant":
        return [Message(role="assistant", content=text, tool_calls=calls or None)]
    return results + ([Message(role="user", content=text)] if texts or not results else [])


def messages_of(system, messages: list) -> list[Message]:
    if not messages:
        raise bad("messages", "'messages' must hold at least one message")
    out = _system(system)
    for i, msg in enumerate(messages):
        out.extend(_turn(i, msg))
    return out


def tools_of(tools: list | None) -> list | None:
    """Anthropic's client tools as chat's function tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}]", f"tools[{i}] must be an object")
        if tool.get("type") not in (None, "custom"):
            raise ApiError(400, f"tools[{i}]: server tools ('{tool.get('type')}') are not served; only client "
                                "tools with an input_schema are", code="unsupported_parameter", param=f"tools[{i}]")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise bad(f"tools[{i}]", f"tools[{i}] needs a string 'name' and an object 'input_schema'")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_of(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "tool_choice of type 'tool' needs the tool's 'name'")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad("tool_choice.type", "tool_choice.type must be one of auto, any, tool, none")


def thinking_of(thinking: dict | None, max_tokens: int | None = None) -> dict | None:
    """The chat template's ``enable_thinking``; ``budget_tokens`` is checked as Anthropic checks it (at
    least 1024, below max_tokens): the thinking and the answer share ``max_tokens``."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind not in ("enabled", "adaptive"):
        raise bad("thinking.type", "thinking.type must be 'enabled' or 'disabled'")
    budget = thinking.get("budget_tokens")
    if kind == "enabled":
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise bad("thinking.budget_tokens", "thinking.budget_tokens must be an integer of at least 1024")
        if max_tokens is not None and budget >= max_tokens:
            raise bad("thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens")
    return {"enable_thinking": True}


def _refuse(body: MessagesBody) -> None:
    if body.max_tokens < 1:
        raise bad("max_tokens", f"max_tokens must be at least 1 (got {body.max_tokens})")
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise bad("temperature", f"temperature must be between 0 and 1 (got {body.temperature:g})")
    if body.stop_sequences and len(body.stop_sequences) > MAX_STOP:
        raise bad("stop_sequences", f"stop_sequences holds at most {MAX_STOP} sequences on this server")
    if body.stop_sequences and any(s == "" for s in body.stop_sequences):
        raise bad("stop_sequences", "stop_sequences must not be empty strings")
    if body.container or body.mcp_servers:
        raise ApiError(400, "'container' and 'mcp_servers' are not served by this server",
                       code="unsupported_parameter", param="container" if body.container else "mcp_servers")
    for name in ("speed", "inference_geo"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"'{name}' is not served by this server", code="unsupported_parameter", param=name)
    if body.service_tier not in (None, "auto", "standard_only"):
        raise bad("service_tier", "service_tier must be 'auto' or 'standard_only'")


EFFORTS = ("low", "medium", "high", "xhigh", "max")


def effort_thinking(config: dict | None, thinking: dict | None) -> dict | None:
    """``output_config.effort`` where ``thinking`` is not given: "low" is no thinking, the others think
    (the model's ``enable_thinking``); how long it thinks is the model's, within ``max_tokens``."""
    effort = (config or {}).get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad("output_config.effort", f"output_config.effort must be one of {', '.join(EFFORTS)}")
    return None if thinking is not None else {"enable_thinking": effort != "low"}


def output_format(config: dict | None) -> ResponseFormat | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": ...}``) as chat's response_format."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("output_config.format", "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": fmt["schema"]})


def chat_body(body: MessagesBody) -> ChatBody:
    """The chat body a Messages request runs as."""
    if not body.model:
        raise bad("model", "'model' must name a model (see GET /v1/models)")
    _refuse(body)
    choice, parallel = tool_choice_of(body.tool_choice)
    return ChatBody(model=body.model, messages=messages_of(body.system, body.messages), stream=body.stream,
                    max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    stop=body.stop_sequences or None, tools=tools_of(body.tools), tool_choice=choice,
                    parallel_tool_calls=parallel, response_format=output_format(body.output_config),
                    chat_template_kwargs=thinking_of(body.thinking, body.max_tokens)
                    or effort_thinking(body.output_config, body.thinking))
