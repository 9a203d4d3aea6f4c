"""Grammars for constrained decoding: ``response_format`` schemas and constrained tool calls.

The leader compiles each grammar with llguidance (the engine the stages use) before a request is
accepted, so a schema the engine cannot compile is a 400 naming it; the stage that samples builds
its matcher from the same grammar text (fellow.runtime.engine.processors.Constraint).

JSON is generated compact (no free whitespace between tokens, as OpenAI's structured outputs
are): a schema's own ``x-guidance`` options override that. An object schema that names its
properties and says nothing of others is closed to them (``closed``), as vLLM's default grammar
backend treats it: pydantic writes no ``additionalProperties``, and an open object lets a small
model ramble on in invented keys until ``max_tokens``.
"""

from __future__ import annotations

import json

from leader.errors import ApiError

JSON_OPTIONS = {"whitespace_flexible": False}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # Qwen3 / Hermes format


def _ll():
    from llguidance import LLMatcher

    return LLMatcher


def _checked(grammar: str, param: str, what: str) -> str:
    error = _ll().validate_grammar(grammar)
    if error:
        raise ApiError(400, f"{what} cannot be compiled into a grammar: {error.strip()}", code="invalid_schema",
                       param=param)
    return grammar


def schema_grammar(schema, param: str) -> str:
    """The grammar of JSON that follows ``schema``; a 400 naming ``param`` if it does not compile."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"'{param}' must be a JSON Schema object", code="invalid_schema", param=param)
    try:
        grammar = _ll().grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"'{param}' is not a JSON Schema llguidance takes: {exc}", code="invalid_schema",
                       param=param) from None
    return _checked(grammar, param, f"The schema in '{param}'")


def response_format_schema(response_format) -> dict | None:
    """``response_format``'s JSON schema (None for text): json_object is any JSON object, json_schema
    its schema, closed (``closed``)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        if not isinstance(spec, dict):
            raise ApiError(400, "'response_format.json_schema' must be an object with 'name' and 'schema'",
                           code="invalid_value", param="response_format.json_schema")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ApiError(400, "'response_format.json_schema.name' must name the schema", code="invalid_value",
                           param="response_format.json_schema.name")
        return closed(spec.get("schema", {}))
    raise ApiError(400, f"'response_format.type' must be text, json_object or json_schema "
                        f"(got '{response_format.type}')", code="invalid_value", param="response_format.type")


def response_format_grammar(response_format) -> str:
    """``response_format`` as a grammar ("" for text)."""
    schema = response_format_schema(response_format)
    if schema is None:
        return ""
    param = "response_format.json_schema.schema" if response_format.type == "json_schema" else "response_format"
    return schema_grammar(schema, param)


def closed(schema):
    """``schema`` with every object that names its properties and says nothing of others closed to them
    (``additionalProperties: false``; an explicit ``true`` or a schema keeps it open), as OpenAI's strict
    mode and vLLM's default have it: a reply then holds the keys its schema names, and a small model
    cannot ramble on in extra keys until ``max_tokens`` cuts it off."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) if key not in ("const", "enum", "default", "examples") else value
           for key, value in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: closed(value) for name, value in schema["properties"].items()}
        if "additionalProperties" not in out and "patternProperties" not in out:
            out["additionalProperties"] = False
    return out


# how one constrained call is written, by the template's tool format (leader.openai.tool_formats): the text
# around it, the key of its arguments, and whether it sits in a JSON array
CALL_SHAPES = {"hermes": (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "arguments", False),
               "llama3_json": ("", "", "parameters", False),  # a bare JSON object, as vLLM's llama3_json reads
               "mistral": ("", "", "arguments", True)}  # [{...}] (the [TOOL_CALLS] marker is not forced)


def _call_rules(tools: list[dict], fmt: str = "hermes") -> str:
    """The Lark rules of one call (``call_block``) naming one of ``tools``, in the format ``fmt``."""
    opener, closer, key, array = CALL_SHAPES[fmt]
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               key: closed(t["function"].get("parameters") or {"type": "object"})},
              "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = {"anyOf": calls}
    if array:
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    around = [json.dumps(opener)] * bool(opener) + ["call"] + [json.dumps(closer)] * bool(closer)
    return f"call_block: {' '.join(around)}\ncall: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def tool_call_grammar(tools: list[dict], fmt: str = "hermes") -> str:
    """One tool call, in the Hermes format ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
    or ``fmt``'s (CALL_SHAPES), naming one of ``tools`` (checked OpenAI tool objects) with arguments that
    follow its parameters, closed to keys they do not name (``closed``)."""
    return _checked(_ll().grammar_from_lark("start: call_block\n" + _call_rules(tools, fmt)), "tools",
                    "The tools' parameters")


def call_or_answer_grammar(tools: list[dict], response_format, fmt: str = "hermes") -> str:
    """tool_choice "auto" beside a ``response_format``: one call of ``tools``, or the answer in that format
    (an agent that calls tools and then answers in a schema, as the Agents SDK's ``output_type`` asks)."""
    response_format_grammar(response_format)  # a schema that does not compile alone is a 400 naming it
    answer = {**response_format_schema(response_format), "x-guidance": JSON_OPTIONS}
    lark = f"start: call_block | answer\n{_call_rules(tools, fmt)}\nanswer: %json {json.dumps(answer)}"
    return _checked(_ll().grammar_from_lark(lark), "response_format", "The tools and the response format")
