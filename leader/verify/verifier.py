"""The leader's verifier: for a share of finished replies, another replica scores prompt + reply in one
prefill and the leader judges the serving fellow by it (leader.verify.checks).

It sees every request as the gateway publishes it (a core subscription on ``swarm.req.*``), picks the
share by a hash of the request id (every leader picks the same ones), reads the reply's frames as the
gateway does (TokenStreams: signed, in order), and then publishes the check, ``vf-<request id>``, on the
load's own queue with ``not_by`` naming the fellow that served it and every drained one: that fellow's
stage hands it back (a nak), another replica takes it. The scorer's start frame must name another fellow,
or the check counts for nothing. Ids are deterministic, so two leaders publish one check and one verdict.

A fellow is drained (FellowDrained; placement gives it no new stage) once ``DRAIN_AFTER`` checks of its
replies failed, by at least ``QUORUM`` different scorers: with two fellows alone a disagreement cannot say
which one is wrong, so both are marked (their failed checks, the metric) and neither is drained.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy import select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.bus import publish_struct, unsubscribe_quietly
from core.tasks import cancel_and_wait
from events import subjects
from events.frames import DoneFrame, TokenFrame
from events.requests import ChatRequest, RequestAccepted, Sampling
from events.verify import FellowDrained, ReplyChecked
from leader import placement
from leader.db.tables import LoadStage, Model
from leader.token_stream import FrameTimeout, TokenStreams
from leader.verify.checks import checkable, chosen, judge
from leader.verify.projector import Tally

log = logging.getLogger("swarm.verify")

DRAIN_AFTER = 3  # failed checks of a fellow's replies before it is drained
QUORUM = 2  # different scorers among them
FRAME_TIMEOUT_S = 300.0  # silence on a reply's or a check's frames before the check is given up
_decode = msgspec.json.Decoder(ChatRequest).decode


class Verifier:
    def __init__(self, share: float, nc: Client, js: JetStreamContext, sessions: async_sessionmaker,
                 streams: TokenStreams, publish, tally: Tally):
        self.share, self.nc, self.js, self.sessions = share, nc, js, sessions
        self.streams, self.publish, self.tally = streams, publish, tally
        self._sub = None
        self._tasks: set[asyncio.Task] = set()
        self.checked = 0  # verdicts this leader published

    async def start(self) -> "Verifier":
        await self.tally.load(self.sessions)
        if self.share > 0:
            self._sub = await self.nc.subscribe(subjects.REQUESTS_ALL, cb=self._on_request)
        return self

    async def stop(self) -> None:
        await unsubscribe_quietly(self._sub)
        self._sub = None
        for task in list(self._tasks):
            await cancel_and_wait(task)

    async def _on_request(self, msg) -> None:
        try:
            chat = _decode(msg.data)
        except (msgspec.DecodeError, RecursionError):
            return
        if not checkable(chat) or not chosen(chat.request_id, self.share):
            return
        # open at once: frames sent before this are read back from SWARM_TOKENS, the rest live
        stream = await self.streams.open(chat.request_id, chat.load_id)
        task = asyncio.create_task(self._check(chat, stream), name=f"verify-{chat.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, chat: ChatRequest, stream) -> None:
        try:
            served = await _reply(stream)
        finally:
            stream.close(cancel=False)
        if served is None:
            return  # failed, cancelled or cut short: nothing a second fellow could confirm
        fellow_id, reply = served
        try:
            replicas, vocab = await self._load_facts(chat)
            if not reply or not replicas - {fellow_id} - placement.DRAINED:
                return
            scored = await self._score(chat, fellow_id, reply)
            if scored is None:
                return
            scorer_id, entries = scored
            verdict = judge(chat, reply, entries, vocab)
            await self.publish(ReplyChecked(
                id=f"chk-{chat.request_id}", request_id=chat.request_id, model_id=chat.model_id,
                load_id=chat.load_id, fellow_id=fellow_id, scorer_id=scorer_id, mode=verdict.mode,
                passed=verdict.passed, tokens=verdict.tokens, bad=verdict.bad, first_bad=verdict.first_bad,
                worst=round(verdict.worst, 6)), wait=["reply_checks"], timeout=30)
            self.checked += 1
            if not verdict.passed:
                log.warning("fellow %s failed a check of request %s by %s: %d of %d %s tokens (worst %.3f)",
                            fellow_id, chat.request_id, scorer_id, verdict.bad, verdict.tokens, verdict.mode,
                            verdict.worst)
                await self._maybe_drain(fellow_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the check of request %s was given up", chat.request_id)

    async def _load_facts(self, chat: ChatRequest) -> tuple[set[str], int]:
        """The fellows whose stage 0 of this load is ready, and the model's vocabulary size."""
        from leader.openai.tokenizer import tokenizer_for

        async with self.sessions() as session:
            fellows = set(await session.scalars(select(LoadStage.fellow_id).where(
                LoadStage.load_id == chat.load_id, LoadStage.stage == 0, LoadStage.state == "ready")))
            path = await session.scalar(select(Model.path).where(Model.model_id == chat.model_id))
        vocab = tokenizer_for(path).vocab_size if path else 1 << 18
        return fellows, vocab

    async def _score(self, chat: ChatRequest, fellow_id: str, reply: list[int]):
        """(scorer fellow, its entries for the reply's tokens), or None where no other fellow scored it."""
        vid = "vf-" + chat.request_id
        check = self.streams.keyed(msgspec.structs.replace(
            chat, request_id=vid, max_tokens=1, max_tokens_fit=False, stop=[], created=time.time(),
            sampling=Sampling(temperature=0.0, prompt_logprobs=1), not_by=sorted({fellow_id, *placement.DRAINED}),
            scored_ids=list(reply)))
        stream = await self.streams.open(vid, chat.load_id)
        try:
            await asyncio.gather(
                publish_struct(self.js, subjects.request(chat.load_id), check, msg_id=vid),
                self.publish(RequestAccepted(id=f"acc-{vid}", request_id=vid, model_id=chat.model_id,
                                             load_id=chat.load_id, max_tokens=1, api="verify")))
            entries = []
            while True:
                frame = await stream.next(FRAME_TIMEOUT_S)
                if isinstance(frame, TokenFrame):
                    entries += frame.prompt_logprobs
                elif isinstance(frame, DoneFrame):
                    break
                else:
                    log.warning("the check %s failed on its scorer: %s", vid, getattr(frame, "message", frame))
                    return None
        except FrameTimeout:
            log.warning("the check %s got no answer in %gs", vid, FRAME_TIMEOUT_S)
            await self.streams.cancel(chat.load_id, vid)
            return None
        finally:
            stream.close(cancel=False)
        if stream.fellow_id in check.not_by or len(entries) < len(reply):
            log.warning("the check %s is void: scored by %r, %d entries for %d tokens", vid, stream.fellow_id,
                        len(entries), len(reply))
            return None
        return stream.fellow_id, entries[-len(reply):]

    async def _maybe_drain(self, fellow_id: str) -> None:
        failed, scorers = self.tally.standing(fellow_id)
        if fellow_id in placement.DRAINED or failed < DRAIN_AFTER or len(scorers) < QUORUM:
            return
        checks = self.tally.checks.get(fellow_id, 0)
        await self.publish(FellowDrained(
            id=f"drained-{fellow_id}", fellow_id=fellow_id, failed=failed, scorers=scorers,
            reason=f"{failed} of {checks} checks of its replies failed, by {', '.join(scorers)}"),
            wait=["reply_checks"], timeout=30)
        placement.DRAINED.add(fellow_id)
        log.warning("fellow %s drained: %d failed checks by %s", fellow_id, failed, scorers)


async def _reply(stream) -> tuple[str, list[int]] | None:
    """(serving fellow, reply token ids) of a reply that finished (stop or length), else None."""
    ids: list[int] = []
    try:
        while True:
            frame = await stream.next(FRAME_TIMEOUT_S)
            if isinstance(frame, TokenFrame):
                ids += frame.token_ids
            elif isinstance(frame, DoneFrame):
                ok = frame.finish_reason in ("stop", "length") and stream.fellow_id
                return (stream.fellow_id, ids) if ok else None
            else:
                return None
    except FrameTimeout:
        return None
