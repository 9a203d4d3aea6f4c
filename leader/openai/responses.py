"""OpenAI's Responses API (``POST /v1/responses``), a subset: its body as a chat body, its reply and its events.

Served: ``input`` as text or as a list of messages (text parts), ``function_call`` and
``function_call_output`` items, ``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``,
function ``tools`` with ``tool_choice`` (as chat serves them), ``text.format`` (text, json_object,
json_schema: as chat's ``response_format``) and ``stream``. Each request runs as a chat request
(same auth, admission, timing and cancels). Nothing is stored: a field that needs stored state
(``previous_response_id``, ``store: true``, ``conversation``, ``background``) or that this server cannot
honour is refused with a 400 naming it.
"""

from __future__ import annotations

import secrets
import time

import msgspec

from events.frames import DoneFrame
from leader.errors import ApiError
from leader.openai.replies import calls_reason
from leader.openai.schema import ChatBody, ContentPart, Message, ResponseFormat, decode_struct, empty_body
from leader.openai.validate import unsupported

_enc = msgspec.json.Encoder()


class ResponsesBody(msgspec.Struct, kw_only=True):
    """Every field a client may send; unknown ones are ignored, as for chat."""

    model: str
    input: str | list
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    conversation: str | dict | None = None
    background: bool | None = None
    reasoning: dict | None = None
    include: list | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    prompt: dict | None = None
    max_tool_calls: int | None = None
    metadata: dict | None = None
    user: str | None = None


_decoder = msgspec.json.Decoder(ResponsesBody)


def decode_body(body: bytes) -> ResponsesBody:
    if not body.strip():
        raise empty_body()
    return decode_struct(body, _decoder)


def _refuse_unserved(body: ResponsesBody) -> None:
    stored = {"previous_response_id": body.previous_response_id, "conversation": body.conversation,
              "background": body.background or None, "store": body.store or None}
    for name, value in stored.items():
        if value is not None:
            raise unsupported(name, "this server stores no responses (send the whole conversation as 'input', "
                                    "with store false)")
    for name in ("reasoning", "include", "prompt", "max_tool_calls"):
        if getattr(body, name):
            raise unsupported(name, "not served by this server's Responses API")
    if body.top_logprobs:
        raise unsupported("top_logprobs", "logprobs are served on /v1/chat/completions")
    if body.truncation not in (None, "disabled"):
        raise unsupported("truncation", "only 'disabled' is served: a too-long input is refused")


def _text_parts(i: int, content) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"input[{i}].content must be text or a list of text parts", code="invalid_value",
                       param=f"input[{i}].content")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise unsupported(f"input[{i}].content[{j}].type", f"only text parts are served (got '{kind}')")
        parts.append(ContentPart(type="text", text=part.get("text")))
    return parts


def _messages(body: ResponsesBody) -> list[Message]:
    out = [Message(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return out + [Message(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object", code="invalid_value", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, f"input[{i}].role must be system, developer, user or assistant",
                               code="invalid_value", param=f"input[{i}].role")
            out.append(Message(role=role, content=_text_parts(i, item.get("content"))))
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1].role == "assistant" and out[-1].tool_calls and not out[-1].content:
                out[-1].tool_calls.append(call)
            else:
                out.append(Message(role="assistant", content="", tool_calls=[call]))
        elif kind == "reasoning":  # an earlier turn's thinking: the chat template leaves it out anyway
            continue
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(Message(role="tool", tool_call_id=item.get("call_id"),
                               content=output if isinstance(output, str) else _enc.encode(output).decode()))
        else:
            raise unsupported(f"input[{i}].type", f"input items of type '{kind}' are not served")
    return out


def _tools(body: ResponsesBody) -> list | None:
    """Responses' flat function tools as chat's nested ones."""
    if not body.tools:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise unsupported(f"tools[{i}].type", f"only function tools are served (got '{kind}')")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if k in tool}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _format(text: dict | None) -> ResponseFormat | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError(400, "'text.format' must be an object with a 'type'", code="invalid_value", param="text.format")
    if fmt["type"] == "json_schema":
        return ResponseFormat(type="json_schema", json_schema={k: fmt[k] for k in ("name", "schema", "strict")
                                                               if k in fmt})
    return ResponseFormat(type=fmt["type"])


_PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "response_format.json_schema.schema": "text.format.schema",
           "response_format.json_schema.name": "text.format.name"}


def renamed(exc: ApiError) -> ApiError:
    """A chat check's error with the Responses parameter's name."""
    param = exc.param or ""
    if param in _PARAMS:
        exc.param = _PARAMS[param]
    elif param.startswith("messages"):
        exc.param = "input"
    return exc


def chat_body(body: ResponsesBody) -> ChatBody:
    """The chat body a Responses request runs as."""
    if not body.model:
        raise ApiError(400, "'model' must name a model (see GET /v1/models)", code="invalid_value", param="model")
    _refuse_unserved(body)
    return ChatBody(model=body.model, messages=_messages(body), stream=body.stream,
                    max_completion_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                    tools=_tools(body), tool_choice=_tool_choice(body.tool_choice),
                    parallel_tool_calls=body.parallel_tool_calls,
                    response_format=_format(body.text))


class ResponseBuilder:
    """A response's output items as frames settle, and the streamed events that build them.

    ``text(piece)`` and ``call(call)`` return the events each adds (a caller that wants the whole
    response ignores them); ``finish(done)`` closes the items and returns the last events.
    """

    def __init__(self, response_id: str, body: ResponsesBody, created: int):
        self.id = response_id
        self.body = body
        self.created = created
        self.output: list[dict] = []
        self.seq = 0
        self.message: dict | None = None  # the message item being written
        self.thought: dict | None = None  # the reasoning item being written
        self.reasoning_tokens = 0

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _enc.encode(data) + b"\n\n"

    def response(self, status: str, done: DoneFrame | None = None, reason: str | None = None) -> dict:
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": body.model, "output": self.output, "instructions": body.instructions,
               "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
               "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
               "parallel_tool_calls": body.parallel_tool_calls is not False, "text": {"format": fmt},
               "truncation": "disabled", "metadata": body.metadata or {}, "error": None,
               "incomplete_details": {"reason": reason} if reason else None, "usage": None}
        if done is not None:
            cached = (done.timing or {}).get("cached_tokens", 0)
            out["usage"] = {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                            "total_tokens": done.prompt_tokens + done.completion_tokens,
                            "input_tokens_details": {"cached_tokens": int(cached)},
                            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}
            if done.timing:
                out["swarm"] = {"timing": done.timing}
        return out

    def start(self) -> bytes:
        snapshot = self.response("in_progress")
        return self.event("response.created", response=snapshot) + self.event("response.in_progress",
                                                                               response=snapshot)

    def _open_message(self) -> bytes:
        self.message = {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "in_progress",
                        "role": "assistant", "content": []}
        self.output.append(self.message)
        index = len(self.output) - 1
        return (self.event("response.output_item.added", output_index=index, item={**self.message, "content": []})
                + self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []}))

    def _close_message(self) -> bytes:
        message, self.message = self.message, None
        if message is None:
            return b""
        text = "".join(message.pop("pieces", []))
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        message["content"] = [part]
        message["status"] = "completed"
        index = self.output.index(message)
        return (self.event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                           text=text, logprobs=[])
                + self.event("response.content_part.done", item_id=message["id"], output_index=index,
                             content_index=0, part=part)
                + self.event("response.output_item.done", output_index=index, item=message))

    def thinking(self, piece: str) -> bytes:
        """A piece of the model's thinking, in a ``reasoning`` item before the message."""
        if not piece:
            return b""
        out = b""
        if self.thought is None:
            self.thought = {"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "summary": [],
                            "content": [], "status": "in_progress"}
            self.output.append(self.thought)
            out = self.event("response.output_item.added", output_index=len(self.output) - 1,
                             item={**self.thought, "content": []})
        self.thought.setdefault("pieces", []).append(piece)
        return out + self.event("response.reasoning_text.delta", item_id=self.thought["id"],
                                output_index=self.output.index(self.thought), content_index=0, delta=piece)

    def _close_thought(self) -> bytes:
        thought = self.thought
        if thought is None or thought["status"] == "completed":
            return b""
        text = "".join(thought.pop("pieces", []))
        thought["content"] = [{"type": "reasoning_text", "text": text}]
        thought["status"] = "completed"
        index = self.output.index(thought)
        return (self.event("response.reasoning_text.done", item_id=thought["id"], output_index=index,
                           content_index=0, text=text)
                + self.event("response.output_item.done", output_index=index, item=thought))

    def text(self, piece: str) -> bytes:
        if not piece:
            return b""
        out = self._close_thought() + (b"" if self.message is not None else self._open_message())
        self.message.setdefault("pieces", []).append(piece)
        return out + self.event("response.output_text.delta", item_id=self.message["id"],
                                output_index=len(self.output) - 1, content_index=0, delta=piece, logprobs=[])

    def call(self, call: dict) -> bytes:
        """A whole call: its item, its arguments in one delta, done."""
        return self.call_start(call) + self.call_args(call["function"]["arguments"]) + self.call_end(call)

    def call_start(self, call: dict) -> bytes:
        """A streamed call's item, once its name is known (leader.openai.tools.CallStream's "start")."""
        out = self._close_thought() + self._close_message()
        self.output.append({"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": call["id"],
                            "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
        return out + self.event("response.output_item.added", output_index=len(self.output) - 1,
                                item=dict(self.output[-1]))

    def call_args(self, piece: str) -> bytes:
        item = self.output[-1]
        return self.event("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=len(self.output) - 1, delta=piece)

    def call_end(self, call: dict) -> bytes:
        item, index = self.output[-1], len(self.output) - 1
        item.update(arguments=call["function"]["arguments"], status="completed")
        return (self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"], name=item["name"])
                + self.event("response.output_item.done", output_index=index, item=item))

    def finish(self, done: DoneFrame, calls: int, reasoning_tokens: int = 0) -> tuple[bytes, dict]:
        """The closing events and the final response: "incomplete" when max_output_tokens cut it off."""
        self.reasoning_tokens = reasoning_tokens
        out = self._close_thought()
        if not any(item["type"] != "reasoning" for item in self.output):
            out += self._open_message()
        out += self._close_message()
        reason = calls_reason(done.finish_reason, calls)
        incomplete = "max_output_tokens" if reason == "length" else None
        final = self.response("incomplete" if incomplete else "completed", done, incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        return out + self.event(kind, response=final), final


def new_response(body: ResponsesBody) -> ResponseBuilder:
    return ResponseBuilder("resp_" + secrets.token_hex(16), body, int(time.time()))
