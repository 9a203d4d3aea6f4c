"""Anthropic's Messages replies: the whole ``message``, or its stream of server-sent events
(message_start, ping, content_block_start / _delta / _stop, message_delta, message_stop), built from
the settled pieces of leader.api.pieces. Errors in Anthropic's shape, with its status codes."""

from __future__ import annotations

import secrets

import msgspec

from leader.api.pieces import Ending, call_input
from leader.errors import ApiError

_enc = msgspec.json.Encoder()
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error",
               413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
STATUS = {503: 529}  # Anthropic answers an overloaded server with 529


def error_object(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_status(status: int, code: str | None, message: str) -> tuple[int, str]:
    """Anthropic's status and message for one of ours: a conversation longer than the model holds is its
    400 "prompt is too long" (what Claude Code reads to compact), not a 413 (a body too large); overloaded
    is 529."""
    if code == "context_length_exceeded":
        return 400, f"prompt is too long: {message}"
    return STATUS.get(status, status), message


def sse(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _enc.encode(data) + b"\n\n"


def error_event(exc: ApiError) -> bytes:
    return sse("error", error_object(*anthropic_status(exc.status_code, exc.code, exc.detail)))



class MessageBuilder:
    """One reply's content blocks as pieces settle; each method returns the events it adds."""

    def __init__(self, model: str):
        self.id = "msg_" + secrets.token_hex(12)
        self.model = model
        self.content: list[dict] = []
        self.open: str | None = None  # the type of the block being written, if one is open

    def message(self, ending: Ending | None = None) -> dict:
        stop = None if ending is None else _STOP.get(ending.reason, "end_turn")
        if ending is not None and ending.stop_sequence is not None and stop == "end_turn":
            stop = "stop_sequence"
        done = ending.done if ending is not None else None
        cached = int((done.timing or {}).get("cached_tokens", 0)) if done is not None else 0
        usage = {"input_tokens": done.prompt_tokens if done else 0, "output_tokens": done.completion_tokens if done
                 else 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": stop,
                "stop_sequence": ending.stop_sequence if stop == "stop_sequence" else None, "usage": usage}

    def start(self) -> bytes:
        return sse("message_start", {"type": "message_start", "message": {**self.message(), "content": []}}) + sse(
            "ping", {"type": "ping"})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        block = self.content[-1]
        if block["type"] == "tool_use":
            block["input"] = call_input(block.pop("_args", ""))
        return sse("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})

    def _begin(self, block: dict) -> bytes:
        out = self._close()
        self.content.append(block)
        self.open = block["type"]
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        shown.pop("_args", None)
        if block["type"] == "text":
            shown["text"] = ""
        elif block["type"] == "thinking":
            shown["thinking"] = ""
        return out + sse("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                                 "content_block": shown})

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                           "delta": delta})

    def piece(self, kind: str, value) -> bytes:
        """One settled piece (leader.api.pieces): its events."""
        if kind == "thinking":
            out = b"" if self.open == "thinking" else self._begin({"type": "thinking", "thinking": "",
                                                                   "signature": ""})
            self.content[-1]["thinking"] += value
            return out + self._delta({"type": "thinking_delta", "thinking": value})
        if kind == "text":
            out = b"" if self.open == "text" else self._begin({"type": "text", "text": ""})
            self.content[-1]["text"] += value
            return out + self._delta({"type": "text_delta", "text": value})
        if kind == "start":
            return self._begin({"type": "tool_use", "id": value["id"], "name": value["function"]["name"],
                                "input": {}, "_args": ""})
        if kind == "args":
            self.content[-1]["_args"] += value
            return self._delta({"type": "input_json_delta", "partial_json": value})
        if kind == "end":  # the whole arguments: what was not streamed yet goes out now
            block = self.content[-1]
            whole = value["function"]["arguments"] or "{}"
            rest = whole[len(block["_args"]):] if whole.startswith(block["_args"]) else ""
            block["_args"] = whole
            return (self._delta({"type": "input_json_delta", "partial_json": rest}) if rest else b"") + self._close()
        raise ValueError(kind)

    def finish(self, ending: Ending) -> bytes:
        out = b"" if self.content else self._begin({"type": "text", "text": ""})  # as whole() answers
        out += self._close()
        final = self.message(ending)
        usage = {"input_tokens": final["usage"]["input_tokens"], "output_tokens": final["usage"]["output_tokens"]}
        return out + sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}, "usage": usage}) + sse(
            "message_stop", {"type": "message_stop"})

    def whole(self, ending: Ending) -> dict:
        self._close()
        if not self.content:
            self.content.append({"type": "text", "text": ""})
        return self.message(ending)
