"""Which tool-call format a model's chat template renders, and the reader of that format.

- ``hermes``: Qwen3 / Hermes, ``<tool_call>{"name", "arguments"}</tool_call>`` blocks anywhere in the
  reply (leader.openai.tools);
- ``llama3_json``: Llama 3.x's JSON calls, ``{"name", "parameters"}`` opening the reply, after an optional
  ``<|python_tag|>`` (leader.openai.call_readers);
- ``mistral``: ``[TOOL_CALLS][{"name", "arguments"}, ...]`` opening the reply, ids of 9 letters and digits
  as Mistral's templates check them.

The format travels with the request (``ChatRequest.tool_format``), so a resumed stream reads its calls
the same way; constrained calls (``tool_choice`` required or named) follow it (grammar.CALL_SHAPES).
"""

from __future__ import annotations

from dataclasses import dataclass

from leader.errors import ApiError
from leader.openai.call_readers import LeadingCalls, parse_leading
from leader.openai.tools import OPEN, CallStream, parse_calls

FORMATS = ("hermes", "llama3_json", "mistral")


def format_of(chat_template: str | None) -> str | None:
    """The tool format ``chat_template`` renders, or None where it renders none this server parses."""
    template = chat_template or ""
    if OPEN in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return "llama3_json"
    return None


def check_template(chat_template: str | None) -> str:
    """The template's tool format; a 400 naming ``tools`` where it has none this server parses."""
    fmt = format_of(chat_template)
    if fmt is None:
        raise ApiError(400, "'tools' is not supported for this model: its chat template has no tool-call format "
                            "this server parses (Qwen3 / Hermes <tool_call>, Llama 3.x JSON, Mistral [TOOL_CALLS])",
                       code="unsupported_parameter", param="tools")
    return fmt


def request_format(body, model_dir: str) -> str:
    """The tool format of a request's reply: its model's template's where it sends tools, else ""."""
    from leader.openai.tokenizer import tokenizer_for
    from leader.openai.validate import request_tools

    return (format_of(tokenizer_for(model_dir).chat_template) or "") if request_tools(body)[0] else ""


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools as its reply is read: the names it may call and the format they come in."""

    names: frozenset[str]
    format: str = "hermes"

    @classmethod
    def of(cls, chat) -> "ToolSpec | None":
        if not chat.tools:
            return None
        return cls(frozenset(t["function"]["name"] for t in chat.tools), chat.tool_format or "hermes")

    def reader(self):
        """A streamed reply's reader: ("text" | "start" | "args" | "end", ...) pieces."""
        names = set(self.names)
        return CallStream(names) if self.format == "hermes" else LeadingCalls(names, self.format)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole reply's (content, calls)."""
        names = set(self.names)
        return parse_calls(text, names) if self.format == "hermes" else parse_leading(text, names, self.format)
