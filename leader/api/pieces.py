"""A relay's frames as settled pieces, for the APIs that translate onto the chat request path
(Anthropic's Messages, Ollama's chat and generate): thinking, answer text and tool calls, split as the
chat route splits them (leader.openai.reasoning, leader.openai.tools), then how the reply ended."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from litestar import Response

from events.frames import DoneFrame, TokenFrame
from leader.api.relay import Relay
from leader.errors import ApiError
from leader.openai.reasoning import Reasoning
from leader.openai.replies import calls_reason, frame_error, split_pieces
from leader.openai.tokenizer import tokenizer_for
from leader.openai.tool_formats import ToolSpec


@dataclass
class Ending:
    """How a reply ended: its done frame, the reason as chat names it (stop, length, tool_calls), the stop
    sequence that ended it (None: none did) and the tokens spent thinking."""

    done: DoneFrame
    reason: str
    stop_sequence: str | None
    reasoning_tokens: int


def matched_stop(model_dir: str, ids: list[int], stops: list[str]) -> str | None:
    """The stop sequence a reply ended on: a stage leaves it out of the text and names no reason but
    "stop", so the reply's token ids (the last one holds the sequence) are decoded and searched."""
    if not stops or not ids or not model_dir:
        return None
    text = tokenizer_for(model_dir).decode(ids)
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None


async def pieces(relay: Relay, model_dir: str = ""):
    """("thinking", str), ("text", str), ("start", call), ("args", str), ("end", call) as they settle, then
    ("done", Ending); an error frame raises its ApiError. The stream is closed (with a cancel) at the end."""
    spec = ToolSpec.of(relay.chat)
    calls = spec.reader() if spec is not None else None
    split = None if relay.reasoning is None else Reasoning(relay.reasoning)
    ids: list[int] = []

    def settle(thought: str, text: str) -> list:
        out = [("thinking", thought)] if thought else []
        if calls is not None:
            return out + calls.feed(text)
        return out + ([("text", text)] if text else [])

    try:
        while True:
            frame = await relay.next_frame()
            if isinstance(frame, TokenFrame):
                ids.extend(frame.token_ids)
                if split is not None:
                    out = settle(*split_pieces(split, frame))
                else:
                    out = settle("", frame.text or "".join(frame.texts))
                for piece in out:
                    yield piece
            elif isinstance(frame, DoneFrame):
                tail = settle(*split.flush()) if split is not None else []
                tail += calls.flush() if calls is not None else []
                for piece in tail:
                    yield piece
                reason = calls_reason(frame.finish_reason, calls.calls if calls is not None else 0)
                stop = matched_stop(model_dir, ids, relay.chat.stop) if reason == "stop" else None
                yield "done", Ending(frame, reason, stop, split.tokens if split is not None else 0)
                return
            else:
                raise frame_error(frame)
    finally:
        relay.stream.close(cancel=True, grace_s=0)


def call_input(arguments: str) -> dict:
    """A call's arguments text as the object both APIs send (a call cut off mid-way: ``{}``)."""
    try:
        value = msgspec.json.decode(arguments or "{}")
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


async def whole(relay: Relay, model_dir: str, take, reply) -> Response:
    """The whole reply as one JSON object: each piece to ``take(kind, value)``, then ``reply(ending)``."""
    async for kind, value in pieces(relay, model_dir):
        if kind == "done":
            return Response(reply(value), media_type="application/json")
        take(kind, value)
    raise ApiError(500, "the reply ended without its last frame", code="internal_error")
