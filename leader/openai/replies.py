"""OpenAI replies: one ``chat.completion``, or SSE ``chat.completion.chunk`` bytes built once per frame.

A streamed chunk differs from the last only in its text, so each request encodes the shared
head once and a frame costs one msgspec encode of its text.
"""

from __future__ import annotations

import logging

import msgspec
from msgspec import UNSET, UnsetType

from events.frames import DoneFrame, ErrorFrame, TokenFrame, TokenLogprob
from leader.errors import ApiError, error_body
from leader.openai.reasoning import Reasoning
from leader.openai.tool_formats import ToolSpec

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"

# An ErrorFrame's code as the HTTP status and OpenAI code the client sees.
_FRAME_ERRORS = {
    "context_too_long": (413, "context_length_exceeded", "messages"),
    "invalid_request": (400, "invalid_request", None),
    "load_failed": (503, "load_failed", None),
    "fellow_lost": (503, "load_failed", None),
    "model_unloaded": (503, "model_not_loaded", None),
    "timeout": (504, "timeout", None),
    "frames_lost": (502, "frames_lost", None),
}


def frame_error(frame: ErrorFrame) -> ApiError:
    """The client's error for a frame; a code not listed above carries a stage's own exception text,
    which goes to the leader's log, never to the client."""
    known = _FRAME_ERRORS.get(frame.code)
    if known is None:
        log.warning("request %s failed in its stage (%s): %s", frame.request_id, frame.code, frame.message)
        return ApiError(500, "The model failed while serving this request; the leader's log has the details",
                        code=frame.code or "internal_error")
    status, code, param = known
    return ApiError(status, frame.message or "the model failed to answer", code=code, param=param)


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None  # {"cached_tokens": n}: prompt positions the prefix cache served
    completion_tokens_details: dict | None = None  # {"reasoning_tokens": n}: of a model that thinks


def _cached(done: DoneFrame) -> int | None:
    cached = (done.timing or {}).get("cached_tokens")
    return None if cached is None else int(cached)


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    reasoning_content: str | None | UnsetType = UNSET  # a thinking model's thinking (vLLM's field)
    refusal: str | None = None
    tool_calls: list[dict] | UnsetType = UNSET


class Choice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: str


class Reply(msgspec.Struct, kw_only=True):
    """What OpenAI's whole replies share (a ``chat.completion``, a ``text_completion``); ``swarm.timing``
    holds the spec's per-token time split."""

    id: str
    object: str
    created: int
    model: str
    usage: Usage
    system_fingerprint: str | None = None
    swarm: dict | UnsetType = UNSET


class ChatCompletion(Reply, kw_only=True):
    """OpenAI's ``chat.completion``."""

    object: str = "chat.completion"
    choices: list[Choice]


class Answer:
    """One choice as its frames arrive: text pieces, logprobs (when asked for) and its done frame.

    With ``reasoning`` (leader.openai.reasoning.reasoning_for's answer) the thinking goes apart:
    ``text`` is the answer, ``thinking`` the thought, ``last`` what the latest frame settled of each.
    """

    def __init__(self, index: int, logprobs: bool = False, prefix: str = "", reasoning: bool | None = None):
        self.index = index
        self.texts: list[str] = [prefix] if prefix else []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.prompt_logprobs: list[TokenLogprob | None] = []  # the prompt's, where the request asked
        self.done: DoneFrame | None = None
        self.split = None if reasoning is None else Reasoning(reasoning)
        self.thoughts: list[str] = []
        self.last = ("", "")

    def add(self, frame: TokenFrame) -> None:
        """Take a token frame."""
        text = frame.text or "".join(frame.texts)
        if self.logprobs is not None:
            self.logprobs.extend(frame.logprobs)
        self.prompt_logprobs.extend(frame.prompt_logprobs)
        if self.split is None:
            self.last = ("", text)
        else:
            self.last = split_pieces(self.split, frame)
        self.thoughts.append(self.last[0])
        self.texts.append(self.last[1])

    def finish(self, done: DoneFrame) -> None:
        """Take the done frame; ``last`` is then what the split still held."""
        self.last = ("", "") if self.split is None else self.split.flush()
        self.thoughts.append(self.last[0])
        self.texts.append(self.last[1])
        self.done = done

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def thinking(self) -> str | None | UnsetType:
        """The thought (None if the model thought nothing), UNSET for a model that does not think."""
        return UNSET if self.split is None else "".join(self.thoughts) or None

    @property
    def reasoning_tokens(self) -> int:
        return 0 if self.split is None else self.split.tokens


def split_pieces(split: Reasoning, frame: TokenFrame) -> tuple[str, str]:
    """The (thinking, answer) text that a frame's token texts settle. Its texts are one per token id, then
    at most one piece of no token; a frame without ids (a peer that sends text only) counts each a token."""
    texts = frame.texts or ([frame.text] if frame.text else [])
    tokens = len(frame.token_ids) if frame.token_ids else len(texts)
    thought, answer = [], []
    for i, piece in enumerate(texts):
        t, a = split.feed(piece, token=i < tokens)
        thought.append(t)
        answer.append(a)
    return "".join(thought), "".join(answer)


def usage(done: DoneFrame, reasoning_tokens: int | None = None) -> Usage:
    """One reply's usage; ``reasoning_tokens`` for a model that thinks (None: it does not)."""
    cached = _cached(done)
    return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                 total_tokens=done.prompt_tokens + done.completion_tokens,
                 prompt_tokens_details=None if cached is None else {"cached_tokens": cached},
                 completion_tokens_details=None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens})


def total_usage(answers: list[Answer], prompts: int = 1) -> Usage:
    """Every choice's completion tokens; each prompt's tokens once (answers come grouped by prompt)."""
    per = max(1, len(answers) // prompts)
    prompt = sum(a.done.prompt_tokens for a in answers[::per])
    completion = sum(a.done.completion_tokens for a in answers)
    cached = [_cached(a.done) for a in answers[::per]]
    details = None if None in cached else {"cached_tokens": sum(cached)}
    thinks = any(a.split is not None for a in answers)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=details,
                 completion_tokens_details={"reasoning_tokens": sum(a.reasoning_tokens for a in answers)}
                 if thinks else None)


def _top(entry) -> dict:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """OpenAI's ``choice.logprobs`` of a chat completion (or of one chunk)."""
    return {"content": [{**_top(e), "top_logprobs": [_top(t) for t in e.top_logprobs]} for e in entries],
            "refusal": None}


def timing_of(done: DoneFrame) -> dict | UnsetType:
    return {"timing": done.timing} if done.timing else UNSET


def calls_reason(reason: str, calls: int) -> str:
    """OpenAI's finish_reason for a reply that called tools: "tool_calls", unless it was cut off."""
    return "tool_calls" if calls and reason == "stop" else reason


def _choice(a: Answer, tools: ToolSpec | None) -> Choice:
    content, calls = tools.parse(a.text) if tools is not None else (a.text, [])
    return Choice(index=a.index, message=AssistantMessage(content=content, reasoning_content=a.thinking,
                                                          tool_calls=calls or UNSET),
                  finish_reason=calls_reason(a.done.finish_reason, len(calls)),
                  logprobs=None if a.logprobs is None else chat_logprobs(a.logprobs))


def completion(completion_id: str, created: int, model: str, answers: list[Answer],
               tools: ToolSpec | None = None) -> bytes:
    """The chat.completion; with ``tools`` (their names and format), tool calls are parsed out of each
    choice's text."""
    return _enc.encode(ChatCompletion(
        id=completion_id, created=created, model=model, usage=total_usage(answers),
        choices=[_choice(a, tools) for a in answers], swarm=timing_of(answers[0].done)))


class ChunkEncoder:
    """SSE events of one streamed completion, as bytes ready to send."""

    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool):
        self._head = (b'data: {"id":' + _enc.encode(completion_id) + b',"object":"chat.completion.chunk",'
                      b'"created":' + _enc.encode(created) + b',"model":' + _enc.encode(model)
                      + b',"system_fingerprint":null,"choices":')
        self._no_usage = b',"usage":null' if include_usage else b""
        self.include_usage = include_usage

    def _choice(self, delta: bytes, finish_reason: bytes = b"null", index: int = 0, logprobs: bytes = b"null") -> bytes:
        return (b'[{"index":' + str(index).encode() + b',"delta":' + delta + b',"logprobs":' + logprobs
                + b',"finish_reason":' + finish_reason + b"}]")

    def role(self, index: int = 0) -> bytes:
        """OpenAI's first chunk: the assistant's role with empty content."""
        return self._head + self._choice(b'{"role":"assistant","content":""}', index=index) + self._no_usage + b"}\n\n"

    def text(self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None) -> bytes:
        lp = _enc.encode(chat_logprobs(logprobs)) if logprobs else b"null"
        return (self._head + self._choice(b'{"content":' + _enc.encode(text) + b"}", index=index, logprobs=lp)
                + self._no_usage + b"}\n\n")

    def pieces(self, thought: str, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None) -> bytes:
        """A frame's settled thinking (as ``delta.reasoning_content``) and answer, as chunks (maybe none)."""
        out = b""
        if thought:
            out = (self._head + self._choice(b'{"reasoning_content":' + _enc.encode(thought) + b"}", index=index)
                   + self._no_usage + b"}\n\n")
        if text or logprobs:
            out += self.text(text, index, logprobs)
        return out

    def tool_delta(self, number: int, entry: dict, index: int = 0) -> bytes:
        """A ``delta.tool_calls`` entry of the reply's call ``number``: its head (id, type, name), or a
        piece of its arguments, as OpenAI streams them."""
        delta = _enc.encode({"tool_calls": [{"index": number, **entry}]})
        return self._head + self._choice(delta, index=index) + self._no_usage + b"}\n\n"

    def finish(self, done: DoneFrame, reason: str | None = None, reasoning_tokens: int | None = None) -> bytes:
        """The chunk with finish_reason, then (with include_usage) one with usage and no choices.

        swarm.timing rides on whichever is last, as the spec asks of the reply's last chunk.
        """
        return self.finish_choice(0, reason or done.finish_reason, last=not self.include_usage, done=done) + self.end(
            usage(done, reasoning_tokens), done)

    def finish_choice(self, index: int, reason: str, last: bool = False, done: DoneFrame | None = None) -> bytes:
        swarm = b',"swarm":' + _enc.encode({"timing": done.timing}) if last and done and done.timing else b""
        return self._head + self._choice(b"{}", _enc.encode(reason), index) + self._no_usage + swarm + b"}\n\n"

    def end(self, total: Usage, done: DoneFrame) -> bytes:
        """With include_usage, the chunk with usage and no choices (and swarm.timing); else nothing."""
        if not self.include_usage:
            return b""
        swarm = b',"swarm":' + _enc.encode({"timing": done.timing}) if done.timing else b""
        return self._head + b'[],"usage":' + _enc.encode(total) + swarm + b"}\n\n"


def error_event(exc: ApiError) -> bytes:
    """A failure after the stream began: OpenAI's error object as one event, then [DONE]."""
    return b"data: " + _enc.encode(error_body(exc.detail, exc.type_, exc.code, exc.param)) + b"\n\n" + DONE
