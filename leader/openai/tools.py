"""Tools on chat: checking ``tools`` / ``tool_choice``, and reading tool calls out of the model's text.

The tools are rendered by the model's own chat template. This module reads the Qwen3 / Hermes format
(the model calls one by writing ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``);
Llama 3.x JSON and Mistral calls are read by leader.openai.call_readers, the format chosen from the
template by leader.openai.tool_formats (a 400 names ``tools`` for a template with none of them).

- ``tool_choice`` "auto": the model decides freely; its calls are parsed from its text. A block
  that is not a valid call of a listed tool stays in the content, as text.
- "required" or a named function: decoding is constrained by a grammar (leader.openai.grammar)
  to exactly one well-formed call, of the named tool if one is named, with arguments that follow
  that tool's parameters schema.
- "none": the tools are left out of the prompt, and the reply is plain text.

``parallel_tool_calls`` false is served where decoding is constrained (one call); with "auto" it
is refused, since nothing would stop the model from writing several calls.
"""

from __future__ import annotations

import json
import re
import secrets

from leader.errors import ApiError
from leader.openai.grammar import tool_call_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def check_tools(tools: list | None) -> list[dict]:
    """OpenAI function tools, checked: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    out, names = [], set()
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _bad(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}} "
                                      "(only function tools are served)")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"tools[{i}].function.name", f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                                                    "'_' or '-'")
        if name in names:
            raise _bad(f"tools[{i}].function.name", f"tools[{i}].function.name '{name}' is listed twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters must be a JSON Schema "
                                                          "object")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if fn.get(k) is not None}})
    return out


def choice_of(tool_choice, tools: list[dict]) -> str:
    """``tool_choice`` as "none", "auto", "required" or the named function's name."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"'tool_choice' must be none, auto, required or a named function "
                                      f"(got '{tool_choice}')")
        if tool_choice != "none" and not tools:
            raise _bad("tool_choice", f"'tool_choice' '{tool_choice}' needs 'tools'")
        return tool_choice
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", "'tool_choice' must be {'type': 'function', 'function': {'name': ...}} "
                                  "to name a function")
    if name not in {t["function"]["name"] for t in tools}:
        raise _bad("tool_choice.function.name", f"'tool_choice' names '{name}', which is not in 'tools'")
    return name


def grammar_for(choice: str, tools: list[dict], fmt: str = "hermes") -> str:
    """The grammar a choice constrains decoding to: one call (in the template's format ``fmt``) for
    required or a named function, else none."""
    if choice in ("none", "auto"):
        return ""
    picked = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
    return tool_call_grammar(picked, fmt)


def call_arguments(i: int, j: int, call) -> dict:
    """An assistant message's tool call as the chat template takes it: arguments as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"messages[{i}].tool_calls[{j}]", f"messages[{i}].tool_calls[{j}] must be "
                                                     "{'id', 'type': 'function', 'function': {'name', 'arguments'}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments",
                       f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
    return {"id": str(call.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _call(body: str, names: set[str]) -> dict | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments", {}), dict):
        return None
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}}


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole reply; a block that is no valid call leaves the text as it is."""
    calls = []
    for block in _BLOCK.finditer(text):
        call = _call(block.group(1).strip(), names)
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')


def object_end(text: str, start: int) -> int | None:
    """The index after the JSON object that opens at ``text[start]``, or None while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class CallStream:
    """A streamed reply's text split into content pieces and tool calls as they decode, as OpenAI and
    vLLM stream them: ("text", str) pieces, then per call ("start", call) once its name is known (its
    id, type and name, arguments ""), ("args", str) pieces of its arguments as they come, and
    ("end", call) with the whole arguments.

    Text that may be the start of ``<tool_call>`` is held back until it is known. A block whose name
    is no listed tool, or whose keys come in another order, is settled when it closes: a valid call
    then, else text.
    """

    def __init__(self, names: set[str]):
        self.names = names
        self.buf = ""
        self.calls = 0
        self.call: dict | None = None  # the call being streamed: its head is sent
        self.sent = 0  # characters of its arguments sent

    def feed(self, text: str) -> list[tuple[str, object]]:
        """The pieces that are settled."""
        self.buf += text
        out: list[tuple[str, object]] = []
        while True:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(OPEN[:k])), 0)
                self._text(out, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            self._text(out, self.buf[:start])
            self.buf = self.buf[start:]
            body = self.buf[len(OPEN):]
            end = body.find(CLOSE)
            self._stream(out, body if end < 0 else body[:end])
            if end < 0:
                return out
            self._close(out, body[:end])
            self.buf = body[end + len(CLOSE):]

    def _stream(self, out: list, body: str) -> None:
        """The head of the call in ``body`` once its name is known, then its arguments as they grow."""
        if self.call is None:
            head = _HEAD.match(body)
            if head is None or head[1] not in self.names or not body[head.end():].startswith("{"):
                return
            self.call = {"id": "call_" + secrets.token_hex(12), "type": "function",
                         "function": {"name": head[1], "arguments": ""}, "_at": head.end()}
            self.calls += 1
            out.append(("start", {"id": self.call["id"], "type": "function",
                                  "function": {"name": head[1], "arguments": ""}}))
        at = self.call["_at"]
        end = object_end(body, at)
        args = body[at:len(body) if end is None else end]
        if len(args) > self.sent:
            out.append(("args", args[self.sent:]))
            self.call["function"]["arguments"] = args
            self.sent = len(args)

    def _close(self, out: list, body: str) -> None:
        if self.call is not None:
            self._end(out)
            return
        call = _call(body.strip(), self.names)
        if call is None:
            self._text(out, OPEN + body + CLOSE)
            return
        self.calls += 1
        out += [("start", {**call, "function": {**call["function"], "arguments": ""}}),
                ("args", call["function"]["arguments"]), ("end", call)]

    def _end(self, out: list) -> None:
        call, self.call, self.sent = self.call, None, 0
        call.pop("_at")
        out.append(("end", call))

    def flush(self) -> list[tuple[str, object]]:
        """At the reply's end: a call cut off ends as it stands; other held text is text."""
        out: list[tuple[str, object]] = []
        if self.call is not None:
            self._end(out)
        else:
            self._text(out, self.buf)
        self.buf = ""
        return out

    def _text(self, out: list, text: str) -> None:
        if text and not (self.calls and not text.strip()):  # no whitespace-only content between calls
            out.append(("text", text))
