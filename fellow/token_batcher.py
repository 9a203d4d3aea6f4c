"""Batches a request's tokens into frames: the first token at once, then at most one frame an interval."""

from __future__ import annotations

import asyncio
import logging
import secrets

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError

from core.bus import publish_with_id
from events import subjects
from events.base import encode
from events.frames import (
    FRAME_TAG_HEADER,
    DoneFrame,
    ErrorFrame,
    Frame,
    StartFrame,
    TokenFrame,
    claim_msg_id,
    frame_msg_id,
    frame_tag,
)

log = logging.getLogger(__name__)

PROMPT_FRAME_POSITIONS = 256  # prompt logprobs a frame: 256 x 21 candidates is about 200 kB of JSON
FIRST_ON_SUBJECT = {"Nats-Expected-Last-Subject-Sequence": "0"}  # JetStream stores frame 0 only on an empty subject
WRONG_LAST_SEQUENCE = 10071  # JetStream's answer when the subject holds a message already
# A header JetStream checks only after it finds a duplicate (on one server and on a cluster), and refuses
# always (no such rollup): a publish under our claim's id with it is answered `duplicate` if ours is stored,
# else refused with ROLLUP_REFUSED, storing nothing. (Not Nats-Expected-Last-Msg-Id: a cluster of
# nats-server 2.15 answers no publish on the stream after refusing one of those.)
NEVER_STORED = {"Nats-Rollup": "never"}
ROLLUP_REFUSED = 10111


async def stored_beyond(js: JetStreamContext, request_id: str, after: int = 0, timeout: float = 5.0) -> bool:
    """Whether SWARM_TOKENS holds a frame of this request after stream sequence ``after`` (0: any frame;
    a moved request: its last frame before the move), asked without reading the stream or its info (a
    fellow may do neither: stream info with a subjects filter would list every request's subject): an
    empty publish that expects ``after`` as the subject's last sequence, with NEVER_STORED, which JetStream
    checks after that expectation, on one server and on a cluster. Refused either way, stored never: a
    wrong last sequence says there is one, a refused rollup that there is not."""
    headers = {"Nats-Expected-Last-Subject-Sequence": str(after), **NEVER_STORED}
    try:
        await js.publish(subjects.tokens(request_id), b"", timeout=timeout, headers=headers)
    except APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            return True
        if exc.err_code == ROLLUP_REFUSED:
            return False
        raise
    raise RuntimeError(f"JetStream stored a probe of {request_id} it should have refused (Nats-Rollup: never)")


class TokenBatcher:
    """One per request. The first token frame goes out at once; after it, tokens ride together in frames at
    most one an ``interval`` (SWARM_SERVE_STREAM_INTERVAL_MS), and the end (done or error) goes out at once
    with whatever is left. Every frame costs the bus, the leader and the client about as much whatever it
    carries: on two cores, a frame a token took 2-2.4 ms of their CPU a token from the stage's own
    (docs/benchmarks.md). Token frames do not wait for JetStream's ack (the stream keeps them all the same).

    The done or error frame, acked, always follows every token frame (one ordered sender per request).
    With the request's `key` (ChatRequest.frame_key) every frame is signed: the leader drops a frame of a
    keyed request without a right tag (another fellow's forgery).
    """

    def __init__(self, nc: Client, js: JetStreamContext, request_id: str, key: str = "", interval: float = 0.0):
        self.nc = nc
        self.interval = interval  # seconds between token frames after the first (0: each as it comes)
        self._next_frame = 0.0  # the event loop's time from which the next token frame may go
        self._timer: asyncio.TimerHandle | None = None
        self.js = js
        self.request_id = request_id
        self.key = key
        self.subject = subjects.tokens(request_id)
        self.seq = 0
        self.first = 0  # the seq of our start frame: 0, or where a moved request goes on (events.moves)
        self._expect = FIRST_ON_SUBJECT  # what the subject must hold for the start frame to be stored
        self._claim: StartFrame | None = None  # the start frame we published, or tried to
        self._claim_id = ""  # its message id, ours alone
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list = []
        self._prompt: list = []  # the prompt's logprobs, sent before any token, PROMPT_FRAME_POSITIONS a frame
        self._final: Frame | None = None
        self._sender: asyncio.Task | None = None
        self._claiming = False  # start() waits for JetStream's answer to the start frame
        self.closed = asyncio.Event()

    async def start(self, fellow_id: str, replica: int, seq: int = 0, after: int = 0) -> bool:
        """Frame 0, acked by JetStream: which replica took the request (before the stage acks it).

        JetStream stores it only as the first message on the request's subject: of two replicas that
        took the same request (one frozen past the ack wait, the other handed the redelivery) only the
        first is stored, and False tells the second it lost the claim and must not serve. Its message id
        is this claimant's own, so a retry whose first ack was lost learns that frame 0 is ours without
        reading it (a fellow may not read SWARM_TOKENS): see _claimed. A moved request's start frame is
        frame ``seq``, stored only right after the subject's stream sequence ``after`` (its last frame stored).
        """
        if self.seq > self.first:
            raise RuntimeError("the start frame comes first")
        if self._claim is None:
            self.seq = self.first = seq
            if seq:
                self._expect = {"Nats-Expected-Last-Subject-Sequence": str(after)}
            self._claim = StartFrame(request_id=self.request_id, seq=seq, fellow_id=fellow_id, replica=replica)
            self._claim_id = claim_msg_id(self.request_id, fellow_id, replica, secrets.token_hex(8))
        self._claiming = True  # what is added meanwhile waits for the answer
        try:
            claimed = await self._claimed()
        finally:
            self._claiming = False
        self.seq = self.first + 1
        if not claimed:
            self.closed.set()  # another replica's: nothing of ours goes out
        elif self._prompt or self._texts or self._ids or self._final is not None:
            self._kick()
        return claimed

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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._kick()

    def _kick(self) -> None:
        if self._timer is not None:  # the tokens wait for it (an end cancels it)
            return
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())

    def _holds(self) -> bool:
        """Whether the pending tokens wait for the interval (and a timer is set to send them then)."""
        if self._final is not None or self._prompt:
            return False
        loop = asyncio.get_running_loop()
        wait = self._next_frame - loop.time()
        if wait <= 0:
            return False
        if self._timer is None:
            self._timer = loop.call_later(wait, self._fire)
        return True

    def _pending(self) -> tuple[list[str], list[int], list]:
        """The tokens of the next frame: all those waiting, or with no interval one token (the last one with
        a closing piece of no token after it): a frame a token, however many the serving loop handed over
        before the sender's turn. A token's text and logprob are the first of those waiting."""
        if self.interval > 0 or len(self._ids) <= 1:
            out = self._texts, self._ids, self._logprobs
            self._texts, self._ids, self._logprobs = [], [], []
            return out
        out = self._texts[:1], self._ids[:1], self._logprobs[:1]
        del self._texts[:1], self._ids[:1], self._logprobs[:1]
        return out

    def _fire(self) -> None:
        self._timer = None
        self._kick()

    async def _send(self) -> None:
        try:
            while not self._claiming and not (self.seq > self.first and self.closed.is_set()) and (
                    self._prompt or self._texts or self._ids or (self._final is not None and not self.closed.is_set())):
                if self._prompt:  # a long prompt's logprobs in several frames, each well under NATS' 1 MB
                    piece, self._prompt = self._prompt[:PROMPT_FRAME_POSITIONS], self._prompt[PROMPT_FRAME_POSITIONS:]
                    await self._publish_unacked(TokenFrame(request_id=self.request_id, seq=self.seq, texts=[],
                                                           prompt_logprobs=piece))
                    continue
                if self._texts or self._ids:
                    if self._holds():
                        break
                    texts, ids, logprobs = self._pending()
                    # Token frames go out without waiting for JetStream's ack: the stream still keeps
                    # them (same subject, same msg id) for a gap fill or a replay, and the done or
                    # error frame, which is acked, follows them on the same connection in order.
                    await self._publish_unacked(TokenFrame(request_id=self.request_id, seq=self.seq, texts=texts,
                                                           text="".join(texts), token_ids=ids, logprobs=logprobs))
                    self._next_frame = asyncio.get_running_loop().time() + self.interval
                    continue
                if self.seq == self.first and self._claim is not None:  # start() raised: ours or not
                    if not await self._claimed():
                        self.closed.set()  # another replica's request: not ours to end
                        break
                    self.seq = self.first + 1
                    continue  # our start frame is stored: the end follows it
                await self._publish_acked(self._final(self.seq))
                self.seq += 1
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

    async def _publish_acked(self, frame: Frame, msg_id: str = "", expect: dict | None = None):
        """Publish `frame` acked, under `msg_id` (else its frame id), with the `expect` headers (else, for
        frame 0, FIRST_ON_SUBJECT): None when JetStream refused it for what they expect (frame 0: the
        subject holds a frame already, another replica's or ours)."""
        payload = encode(frame)
        headers = self._headers(payload, frame.seq)
        frame_id = headers.pop("Nats-Msg-Id")
        headers.update(expect if expect is not None else self._expect if frame is self._claim
                       else FIRST_ON_SUBJECT if frame.seq == 0 else {})
        try:
            return await publish_with_id(self.js, self.subject, payload, msg_id or frame_id, headers=headers)
        except APIError as exc:
            if exc.err_code in (WRONG_LAST_SEQUENCE, ROLLUP_REFUSED):
                return None
            raise

    async def _claimed(self) -> bool:
        """Publish our start frame; whether frame 0 on the stream is it (not another replica's claim).

        A subject that holds a frame already refuses it: frame 0 is ours if an attempt whose ack was lost
        stored it (a cluster answers that retry `duplicate` at once; one server checks the subject first).
        Our id again with NEVER_STORED tells which without reading the frame: `duplicate`, or refused."""
        if await self._publish_acked(self._claim, self._claim_id) is not None:
            return True  # stored now, or a duplicate of our own attempt
        ack = await self._publish_acked(self._claim, self._claim_id, NEVER_STORED)
        return ack is not None and bool(ack.duplicate)
