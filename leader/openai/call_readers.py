"""Tool calls that open a reply, as Llama 3.x and Mistral models write them (vLLM's ``llama3_json`` and
``mistral`` parsers): the whole reply is the calls, or it is text.

- Llama 3.x (JSON): ``{"name": ..., "parameters": {...}}`` (``arguments`` taken too), after an optional
  ``<|python_tag|>``, several separated by ``;``.
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; a bare JSON array of calls too (what a
  constrained call decodes to: the grammar writes no marker, which some tokenizers hold as a special token).

``parse_leading`` reads a whole reply; ``LeadingCalls`` a streamed one, piece by piece as
leader.openai.tools.CallStream does for the Hermes format: ("text", str), ("start", call), ("args", str),
("end", call). A reply whose opening is no valid call of a listed tool stays text, all of it.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from leader.openai.tools import object_end

MARKERS = {"llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
OPENERS = {"llama3_json": "{", "mistral": "["}  # what a bare call (no marker) starts with
_SEPARATORS = " \t\r\n;,[]"
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


def call_id(fmt: str) -> str:
    """A call's id: Mistral's templates take 9 letters and digits; OpenAI's shape elsewhere."""
    if fmt == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def _call(obj, names: set[str], fmt: str) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return {"id": call_id(fmt), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _body(text: str, fmt: str) -> str | None:
    """The reply after its marker, where it opens with one or with a bare call; else None."""
    body = text.lstrip()
    if body.startswith(MARKERS[fmt]):
        return body[len(MARKERS[fmt]):]
    return body if body.startswith(OPENERS[fmt]) else None


def parse_leading(text: str, names: set[str], fmt: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole reply: every call, or the text as it is."""
    body = _body(text, fmt)
    if body is None:
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while True:
            while at < len(body) and body[at] in _SEPARATORS:
                at += 1
            if at == len(body):
                break
            obj, at = decoder.raw_decode(body, at)
            call = _call(obj, names, fmt)
            if call is None:
                return text, []
            calls.append(call)
    except ValueError:
        return text, []
    return (None, calls) if calls else (text, [])


class LeadingCalls:
    """A streamed reply's calls as they decode (see the module's docstring); text if it opens otherwise."""

    def __init__(self, names: set[str], fmt: str):
        self.names, self.fmt = names, fmt
        self.raw = ""  # all of it, for a reply that turns out to be text
        self.buf = ""
        self.mode: str | None = None  # None: not known yet; "calls"; "text"
        self.pos = 0
        self.calls = 0
        self.call: dict | None = None
        self.at = 0  # where the streamed call's arguments start in buf
        self.sent = 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.raw += text
        self.buf += text
        out: list[tuple[str, object]] = []
        if self.mode is None:
            opening = self.buf.lstrip()
            marker = MARKERS[self.fmt]
            if not opening or (marker.startswith(opening) and opening != marker):
                return out  # it may be the marker: held
            body = _body(self.buf, self.fmt)
            self.mode = "text" if body is None else "calls"
            self.buf = self.raw if body is None else body
        if self.mode == "text":
            self._text(out, self.buf)
            self.buf = ""
            return out
        self._calls(out)
        return out

    def _calls(self, out: list) -> None:
        while True:
            i = self.pos
            while self.call is None and i < len(self.buf) and self.buf[i] in _SEPARATORS:
                i += 1
            self.pos = i
            if i >= len(self.buf):
                return
            if self.call is None:
                if self.buf[i] != "{":
                    return self._junk(out)
                head, end = _HEAD.match(self.buf, i), object_end(self.buf, i)
                if head and head[1] in self.names and self.buf[head.end():head.end() + 1] == "{":
                    self.call = {"id": call_id(self.fmt), "type": "function",
                                 "function": {"name": head[1], "arguments": ""}}
                    self.at, self.sent, self.calls = head.end(), 0, self.calls + 1
                    out.append(("start", {**self.call, "function": {**self.call["function"]}}))
                elif end is None:
                    return  # not known yet
                else:
                    try:
                        call = _call(json.loads(self.buf[i:end]), self.names, self.fmt)
                    except ValueError:
                        call = None
                    if call is None:
                        return self._junk(out)
                    self.calls += 1
                    out += [("start", {**call, "function": {**call["function"], "arguments": ""}}),
                            ("args", call["function"]["arguments"]), ("end", call)]
                    self.pos = end
                    continue
            args_end = object_end(self.buf, self.at)
            args = self.buf[self.at:len(self.buf) if args_end is None else args_end]
            if len(args) > self.sent:
                out.append(("args", args[self.sent:]))
                self.call["function"]["arguments"] = args
                self.sent = len(args)
            end = object_end(self.buf, self.pos) if args_end is not None else None
            if end is None:
                return
            self._end(out)
            self.pos = end

    def _end(self, out: list) -> None:
        call, self.call = self.call, None
        out.append(("end", call))

    def _junk(self, out: list) -> None:
        """What follows is no call: all of the reply is text if no call came yet, else the rest is."""
        self._text(out, self.raw if not self.calls else self.buf[self.pos:])
        self.mode, self.buf, self.pos = "text", "", 0

    def flush(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if self.mode is None:
            self._text(out, self.buf)
        elif self.mode == "calls":
            if self.call is not None:
                self._end(out)
            elif self.buf[self.pos:].strip(_SEPARATORS):
                self._junk(out)
            elif not self.calls:
                self._text(out, self.raw)
        self.buf = ""
        return out

    def _text(self, out: list, text: str) -> None:
        if text:
            out.append(("text", text))
