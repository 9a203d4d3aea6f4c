"""Llama 3.x JSON and Mistral [TOOL_CALLS] tool calls read from a reply (leader.openai.call_readers), whole
and streamed piece by piece, and the format told from the chat template (leader.openai.tool_formats)."""

from __future__ import annotations

import json

import pytest

from leader.errors import ApiError
from leader.openai.call_readers import LeadingCalls, parse_leading
from leader.openai.tool_formats import check_template, format_of
from tests.tool_templates import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE

NAMES = {"get_weather", "add"}
LLAMA_TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}; '
             '{"name": "add", "parameters": {"a": 1, "b": {"c": "}"}}}')
MISTRAL_TWO = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
               '{"name": "add", "arguments": {"a": 1}}]')


def test_the_format_comes_from_the_template():
    from fellow.runtime.tools.chat_tokenizer import CHAT_TEMPLATE

    assert (format_of(CHAT_TEMPLATE), format_of(LLAMA3_TEMPLATE), format_of(MISTRAL_TEMPLATE)) == (
        "hermes", "llama3_json", "mistral")
    with pytest.raises(ApiError, match="Llama 3.x JSON, Mistral"):
        check_template("{{ messages }}")


@pytest.mark.parametrize("fmt,text,want", [
    ("llama3_json", LLAMA_TWO, [("get_weather", {"city": "Oslo", "days": [1, 2]}), ("add", {"a": 1, "b": {"c": "}"}})]),
    ("llama3_json", ' {"name": "add", "arguments": {"a": 2}}', [("add", {"a": 2})]),
    ("mistral", MISTRAL_TWO, [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]),
    ("mistral", '[{"name": "add", "arguments": {}}]', [("add", {})]),  # a constrained call: no marker
])
def test_whole_replies_with_calls(fmt, text, want):
    content, calls = parse_leading(text, NAMES, fmt)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
    if fmt == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)  # as Mistral's templates check
    else:
        assert all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("fmt,text", [
    ("llama3_json", "The weather in Oslo is fine."),
    ("llama3_json", '{"name": "unknown", "parameters": {}}'),  # no listed tool: text
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and then some words'),
    ("mistral", "[TOOL_CALLS] not json"),
    ("mistral", "Sure, [TOOL_CALLS] comes later"),
])
def test_replies_that_are_text_stay_text(fmt, text):
    assert parse_leading(text, NAMES, fmt) == (text, [])


def stream(fmt: str, text: str, step: int = 3) -> list[tuple[str, object]]:
    reader = LeadingCalls(NAMES, fmt)
    pieces = []
    for i in range(0, len(text), step):
        pieces += reader.feed(text[i:i + step])
    return pieces + reader.flush()


@pytest.mark.parametrize("fmt,text", [("llama3_json", LLAMA_TWO), ("mistral", MISTRAL_TWO)])
@pytest.mark.parametrize("step", [1, 3, 50])
def test_streamed_calls_come_name_first_then_argument_pieces(fmt, text, step):
    pieces = stream(fmt, text, step)
    kinds = [k for k, _ in pieces]
    assert "text" not in kinds and kinds[0] == "start" and kinds[-1] == "end"
    _, whole = parse_leading(text, NAMES, fmt)
    calls, args = [], ""
    for kind, piece in pieces:
        if kind == "start":
            assert piece["function"]["arguments"] == "" and piece["function"]["name"] in NAMES
            calls.append(piece)
            args = ""
        elif kind == "args":
            args += piece
        elif kind == "end":
            assert json.loads(args) == json.loads(piece["function"]["arguments"]) and piece["id"] == calls[-1]["id"]
    assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in whole]
    if step == 1:
        assert kinds.count("args") > 4  # the arguments arrive as they decode, not at the end


@pytest.mark.parametrize("fmt,text", [
    ("llama3_json", "Hello there, {no call}"), ("llama3_json", '{"name": "unknown", "parameters": {"x": 1}}'),
    ("mistral", "[TOOL_CALL is not the marker"), ("mistral", "<|python_tag|> is not Mistral's"),
])
def test_streamed_text_comes_back_whole_and_unchanged(fmt, text):
    pieces = stream(fmt, text, 2)
    assert {k for k, _ in pieces} == {"text"} and "".join(p for _, p in pieces) == text


def test_the_marker_is_held_until_it_is_known():
    reader = LeadingCalls(NAMES, "mistral")
    assert reader.feed("[TOOL") == []
    assert reader.feed("_CALLS][") == []
    assert reader.feed('{"name": "add", "arguments": ') == []  # the name is out once its arguments open
    pieces = reader.feed('{"a": 1}}]')
    assert [k for k, _ in pieces] == ["start", "args", "end"] and pieces[0][1]["function"] == {"name": "add",
                                                                                             "arguments": ""}
    assert pieces[1][1] == '{"a": 1}' and pieces[2][1]["function"]["arguments"] == '{"a": 1}'
    assert reader.flush() == []
