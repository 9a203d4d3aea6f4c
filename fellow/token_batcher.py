"""Batches a request's tokens into frames: whatever arrived while the previous frame was in flight."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from nats.js import JetStreamContext

from core.bus import publish_with_id
from events.base import encode
from events import subjects
from events.frames import (FRAME_TAG_HEADER, DoneFrame, ErrorFrame, Frame, StartFrame, TokenFrame, frame_decoder,
                           frame_msg_id, frame_tag)

log = logging.getLogger(__name__)

PROMPT_FRAME_POSITIONS = 256  # prompt logprobs a frame: 256 x 21 candidates is about 200 kB of JSON


class TokenBatcher:
    """One per request. Tokens that arrive while the previous frame is being sent ride together
    in the next one; token frames do not wait for JetStream's ack (the stream keeps them all the
    same), so an idle stage adds no delay.

    The done or error frame, acked, always follows every token frame (one ordered sender per request).
    With the request's `key` (ChatRequest.frame_key) every frame is signed: the leader drops a frame of a
    keyed request without a right tag (another fellow's forgery).
    """

    def __init__(self, nc: Client, js: JetStreamContext, request_id: str, key: str = ""):
        self.nc = nc
        self.js = js
        self.request_id = request_id
        self.key = key
        self.subject = subjects.tokens(request_id)
        self.seq = 0
        self._claim: StartFrame | None = None  # the start frame we published, or tried to
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list = []
        self._prompt: list = []  # the prompt's logprobs, sent before any token, PROMPT_FRAME_POSITIONS a frame
        self._final: Frame | None = None
        self._sender: asyncio.Task | None = None
        self.closed = asyncio.Event()

    async def start(self, fellow_id: str, replica: int) -> bool:
        """Frame 0, acked by JetStream: which replica took the request (before the stage acks it).

        Its message id is the request's frame 0, so of two replicas that took the same request (one
        frozen past the ack wait, the other handed the redelivery) only the first is stored: False
        tells the second it lost the claim and must not serve.
        """
        if self.seq:
            raise RuntimeError("the start frame comes first")
        self._claim = StartFrame(request_id=self.request_id, seq=0, fellow_id=fellow_id, replica=replica)
        ack = await self._publish_acked(self._claim)
        self.seq = 1
        return not ack.duplicate

    def add(self, texts: list[str], ids: list[int], logprobs: list | None = None, prompt: list | None = None) -> None:
        if self._final is not None:
            return
        self._prompt.extend(prompt or ())
        self._texts.extend(texts)
        self._ids.extend(ids)
        self._logprobs.extend(logprobs or ())
        self._kick()

    def done(self, completion_tokens: int, prompt_tokens: int, finish_reason: str, timing: dict) -> None:
        self._close(lambda seq: DoneFrame(request_id=self.request_id, seq=seq, completion_tokens=completion_tokens,
                                          prompt_tokens=prompt_tokens, finish_reason=finish_reason, timing=timing))

    def error(self, message: str, code: str = "internal_error", data: dict | None = None) -> None:
        self._close(lambda seq: ErrorFrame(request_id=self.request_id, seq=seq, message=message, code=code,
                                           data=data or {}))

    def _close(self, make) -> None:
        if self._final is not None:
            return
        self._final = make  # built when it is sent, after the token frames, with the next seq
        self._kick()

    def _kick(self) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())

    async def _send(self) -> None:
        try:
            while self._prompt or self._texts or self._ids or (self._final is not None and not self.closed.is_set()):
                if self._prompt:  # a long prompt's logprobs in several frames, each well under NATS' 1 MB
                    piece, self._prompt = self._prompt[:PROMPT_FRAME_POSITIONS], self._prompt[PROMPT_FRAME_POSITIONS:]
                    await self._publish_unacked(TokenFrame(request_id=self.request_id, seq=self.seq, texts=[],
                                                           prompt_logprobs=piece))
                    continue
                if self._texts or self._ids:
                    texts, ids, logprobs = self._texts, self._ids, self._logprobs
                    self._texts, self._ids, self._logprobs = [], [], []
                    # Token frames go out without waiting for JetStream's ack: the stream still keeps
                    # them (same subject, same msg id) for a gap fill or a replay, and the done or
                    # error frame, which is acked, follows them on the same connection in order.
                    await self._publish_unacked(TokenFrame(request_id=self.request_id, seq=self.seq, texts=texts,
                                                           text="".join(texts), token_ids=ids, logprobs=logprobs))
                    continue
                ack = await self._publish_acked(self._final(self.seq))
                self.seq += 1
                if ack.duplicate and self.seq == 1 and await self._claimed_after_all():
                    continue  # our start frame was stored though its publish failed: the end follows it
                self.closed.set()
        except Exception:
            log.exception("frames of %s not published", self.request_id)
            self.closed.set()

    async def _publish_unacked(self, frame: TokenFrame) -> None:
        payload = encode(frame)
        await self.nc.publish(self.subject, payload, headers=self._headers(payload, self.seq))
        self.seq += 1

    def _headers(self, payload: bytes, seq: int) -> dict:
        headers = {"Nats-Msg-Id": frame_msg_id(self.request_id, seq, self.key)}
        if self.key:
            headers[FRAME_TAG_HEADER] = frame_tag(self.key, payload)
        return headers

    async def _publish_acked(self, frame: Frame):
        payload = encode(frame)
        headers = self._headers(payload, frame.seq)
        return await publish_with_id(self.js, self.subject, payload, headers.pop("Nats-Msg-Id"), headers=headers)

    async def _claimed_after_all(self) -> bool:
        """Whether frame 0 on the stream is the start frame we tried (not another replica's claim)."""
        if self._claim is None:
            return False
        stored = await self.js.get_last_msg(subjects.TOKENS_STREAM, self.subject)
        return frame_decoder.decode(stored.data) == self._claim
