"""Tool calls read out of a model's text (Qwen3 / Hermes format), whole and as streamed pieces."""

from __future__ import annotations

import json

from leader.openai.tools import CallStream, parse_calls

NAMES = {"get_time", "get_weather"}
TEXT = ('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>')


def test_whole_text_splits_into_content_and_calls():
    content, calls = parse_calls(TEXT, NAMES)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_calls("plain text", NAMES) == ("plain text", [])
    for bad in ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "<tool_call>{nope</tool_call>",
                '<tool_call>{"name": "get_time", "arguments": 3}</tool_call>'):
        assert parse_calls("a " + bad, NAMES) == ("a " + bad, [])  # no valid call: the text stays text


def test_streamed_pieces_give_the_same_calls_whatever_the_cut():
    """As OpenAI streams them: a call's head (id, type, name) first, then its arguments in pieces."""
    for size in (1, 2, 5, 13, len(TEXT)):
        stream, pieces = CallStream(NAMES), []
        for i in range(0, len(TEXT), size):
            pieces += stream.feed(TEXT[i:i + size])
        pieces += stream.flush()
        text = "".join(p for kind, p in pieces if kind == "text")
        kinds = [kind for kind, _ in pieces if kind != "text"]
        assert text == "Let me look.\n" and stream.calls == 2, (size, pieces)
        first, second = kinds.index("start"), kinds.index("start", 1)
        assert kinds[first + 1:second - 1] == ["args"] * (second - first - 2) and kinds[second - 1] == "end"
        assert (size > 8) or second - first > 3  # small cuts stream the arguments in several pieces
        starts = [p for kind, p in pieces if kind == "start"]
        ends = [p for kind, p in pieces if kind == "end"]
        assert [c["function"]["name"] for c in starts] == ["get_time", "get_weather"]
        assert all(c["function"]["arguments"] == "" for c in starts)
        assert [c["id"] for c in starts] == [c["id"] for c in ends]
        args = "".join(p for kind, p in pieces[pieces.index(("start", starts[1])):] if kind == "args")
        assert args == ends[1]["function"]["arguments"] == '{"city":"Oslo"}'
        assert json.loads(ends[0]["function"]["arguments"]) == {"zone": "UTC"}
    other = CallStream(NAMES)  # keys in another order: settled whole when the block closes
    pieces = other.feed('<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>')
    assert [kind for kind, _ in pieces] == ["start", "args", "end"] and pieces[2][1]["function"]["name"] == "get_time"
    stream = CallStream(NAMES)
    assert stream.feed("a <tool_") == [("text", "a ")]  # a possible opening is held back
    assert stream.feed("call>\n{\"name\": \"get_time\"") == []
    assert stream.flush() == [("text", '<tool_call>\n{"name": "get_time"')]  # cut off: it was text after all


def test_a_constrained_calls_arguments_are_closed_to_keys_the_tool_does_not_name():
    """Objects that name their properties and leave others open are closed (OpenAI's strict calls);
    an explicit choice, enums and constants stay as written."""
    from llguidance import LLMatcher

    from leader.openai.grammar import closed, tool_call_grammar

    params = {"type": "object", "properties": {
        "zone": {"enum": [{"properties": {"x": 1}}, "UTC"]},
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "extra": {"type": "object", "properties": {"k": {}}, "additionalProperties": True}}}
    out = closed(params)
    assert out["additionalProperties"] is False
    assert out["properties"]["where"]["additionalProperties"] is False
    assert out["properties"]["extra"]["additionalProperties"] is True
    assert out["properties"]["zone"] == params["properties"]["zone"] and "additionalProperties" not in params
    grammar = tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": params}}])
    assert LLMatcher.validate_grammar(grammar) == ""
