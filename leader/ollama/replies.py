"""Ollama's replies: newline-delimited JSON objects (one per settled piece, then the last with ``done`` and
the counts), or one object with ``stream: false``; built from leader.api.pieces."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import msgspec

from leader.api.pieces import Ending, call_input

_enc = msgspec.json.Encoder()
_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length", "cancelled": "stop"}


def iso(at: float | None = None) -> str:
    return datetime.fromtimestamp(at if at is not None else time.time(), timezone.utc).isoformat().replace(
        "+00:00", "Z")


def line(obj: dict) -> bytes:
    return _enc.encode(obj) + b"\n"



class OllamaReply:
    """One reply to /api/chat (``generate`` False) or /api/generate, as pieces settle."""

    def __init__(self, model: str, generate: bool):
        self.model = model
        self.generate = generate
        self.started = time.monotonic()
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[dict] = []

    def _part(self, text: str = "", thinking: str = "", calls: list | None = None) -> dict:
        if self.generate:
            out = {"model": self.model, "created_at": iso(), "response": text}
            if thinking:
                out["thinking"] = thinking
            return out
        message = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"model": self.model, "created_at": iso(), "message": message}

    def piece(self, kind: str, value) -> dict | None:
        """One settled piece's object for the stream (None: nothing to send yet)."""
        if kind == "text":
            self.text.append(value)
            return {**self._part(text=value), "done": False}
        if kind == "thinking":
            self.thinking.append(value)
            return {**self._part(thinking=value), "done": False}
        if kind == "end":  # Ollama sends a call whole
            call = {"id": value["id"], "function": {"name": value["function"]["name"],
                                                    "arguments": call_input(value["function"]["arguments"])}}
            self.calls.append(call)
            return {**self._part(calls=[call]), "done": False}
        return None  # a call's head and argument pieces: sent whole at its end

    def _counts(self, ending: Ending) -> dict:
        done, timing = ending.done, ending.done.timing or {}
        total = int((time.monotonic() - self.started) * 1e9)
        prefill = timing.get("prefill_ms")
        prompt_ns = int(prefill * 1e6) if isinstance(prefill, (int, float)) else 0
        return {"done": True, "done_reason": _REASONS.get(ending.reason, "stop"), "total_duration": total,
                "load_duration": 0, "prompt_eval_count": done.prompt_tokens, "prompt_eval_duration": prompt_ns,
                "eval_count": done.completion_tokens, "eval_duration": max(total - prompt_ns, 0)}

    def last(self, ending: Ending) -> dict:
        """The stream's closing object: no text, the counts."""
        return {**self._part(), **self._counts(ending)}

    def whole(self, ending: Ending) -> dict:
        return {**self._part("".join(self.text), "".join(self.thinking), self.calls), **self._counts(ending)}


def loaded(model: str, generate: bool) -> dict:
    """Ollama's answer to an empty prompt: the model is loaded, nothing generated."""
    base = {"model": model, "created_at": iso(), "done": True, "done_reason": "load"}
    return {**base, "response": ""} if generate else {**base, "message": {"role": "assistant", "content": ""}}
