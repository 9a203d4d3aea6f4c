"""Reasoning kept apart: a thinking model's ``<think>…</think>`` split from its answer, as vLLM's
reasoning parsers do (``reasoning_content`` beside ``content``; a ``reasoning`` item in Responses).

A model thinks when its chat template takes ``enable_thinking`` (Qwen3: the reply opens the block
itself, ``<think>\\n…\\n</think>\\n\\nanswer``) or its generation prompt opens a ``<think>`` block
(DeepSeek-R1, QwQ, Qwen3's thinking-only models: the reply starts inside the thinking).
``enable_thinking: false`` renders a closed, empty block into the prompt, so the reply is answer
only. A reply constrained by a grammar (structured outputs, constrained tool calls) is all answer.
"""

from __future__ import annotations

from leader.errors import ApiError
from leader.openai.tokenizer import tokenizer_for

OPEN, CLOSE = "<think>", "</think>"
START_HOLD = 8  # leading whitespace held while a reply may still open its thinking; past it, it is answer
_PROBE = [{"role": "user", "content": "hi"}]


def reply_starts_inside(tok, enable_thinking: bool | None) -> bool | None:
    """None when ``tok``'s chat template does not think; else whether its generation prompt leaves a
    ``<think>`` block open (the reply then starts in its thinking). Rendered once per setting."""
    template = tok.chat_template or ""
    if CLOSE not in template:
        return None
    cache = tok.__dict__.setdefault("_reasoning_inside", {})
    if enable_thinking not in cache:
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        prompt = tok.render(_PROBE, True, **kwargs)
        opened = prompt[prompt.rfind(OPEN):] if OPEN in prompt else ""
        inside = bool(opened) and CLOSE not in opened
        cache[enable_thinking] = inside if inside or "enable_thinking" in template else None
    return cache[enable_thinking]


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class Reasoning:
    """One reply's token texts split into (thinking, answer) pieces as they settle.

    Whitespace around the thinking and before the answer is dropped (the template's newlines);
    ``tokens`` counts the tokens spent thinking, its tags included.
    """

    def __init__(self, inside: bool):
        self.state = "thinking" if inside else "start"  # start -> thinking -> lead -> answer, or start -> answer
        self.buf = ""
        self.tokens = 0
        self.thought = inside  # a think block was opened
        self._said = False  # some thinking was handed out (its leading whitespace is gone)
        self._blank = False  # the reply's leading whitespace ran past START_HOLD and went out as answer

    def feed(self, text: str, token: bool = True) -> tuple[str, str]:
        """One token's text ("" for a token that completes no character yet), or with ``token`` False a
        piece of no token; the (thinking, answer) text it settles."""
        was = self.state
        out = self._step(text)
        if token and "thinking" in (was, self.state):
            self.tokens += 1
        return out

    def _step(self, text: str) -> tuple[str, str]:
        self.buf += text
        blank = ""  # leading whitespace past START_HOLD: answer, out as it comes; a block may still open after it
        if self.state == "start":
            head = self.buf.lstrip()
            if self._blank or len(self.buf) - len(head) > START_HOLD:
                self._blank, blank, self.buf = True, self.buf[:len(self.buf) - len(head)], head
            if not head or (OPEN.startswith(head) and head != OPEN):
                return "", blank  # not known yet
            if not head.startswith(OPEN):
                self.state, out, self.buf = "answer", blank + self.buf, ""
                return "", out
            self.state, self.thought, self.buf = "thinking", True, head[len(OPEN):]
        thinking = ""
        if self.state == "thinking":
            end = self.buf.find(CLOSE)
            if end < 0:  # hold trailing whitespace and what may begin </think>
                body = self.buf.rstrip()
                settled = body[:len(body) - _held(body, CLOSE)].rstrip()
                self.buf = self.buf[len(settled):]
                return self._thinking(settled), blank
            thinking = self._thinking(self.buf[:end].rstrip())
            self.state, self.buf = "lead", self.buf[end + len(CLOSE):]
        if self.state == "lead":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return thinking, blank
            self.state = "answer"
        out, self.buf = self.buf, ""
        return thinking, blank + out

    def _thinking(self, piece: str) -> str:
        if not self._said:
            piece = piece.lstrip()
            self._said = bool(piece)
        return piece

    def flush(self) -> tuple[str, str]:
        """What is still held when the reply ends (a cut-off thinking stays thinking)."""
        buf, self.buf = self.buf, ""
        if self.state == "thinking":
            return self._thinking(buf.rstrip()), ""
        return "", buf if self.state in ("start", "answer") else ""


def reasoning_for(model_dir: str, chat) -> bool | None:
    """How ``chat``'s reply is split: None (not at all), else whether it starts inside its thinking.
    A grammar owns a constrained reply from its first token, so that reply is never inside. A
    servable whose tokenizer or template the leader cannot read goes unsplit (the stage serves it)."""
    if not model_dir or chat.prompt_ids:
        return None
    try:
        inside = reply_starts_inside(tokenizer_for(model_dir), chat.enable_thinking)
    except ApiError:
        return None
    if inside is None:
        return None
    return inside and not chat.sampling.grammar
