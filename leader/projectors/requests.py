"""Requests projection: the audit trail of every chat request and how it ended.

A request ends once: the first final event (finished or failed) sets its outcome, and a later one
(a stage that finished what the gateway had already failed, or the reverse) changes nothing. Each move
off a stage that died mid-reply is a row of ``request_moves`` (RequestMoved).
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from events.base import Event
from events.moves import RequestMoved
from events.requests import RequestAccepted, RequestFailed, RequestFinished
from leader.db.tables import Request, RequestMove
from leader.projectors.projector import Projector

OPEN = (None, "accepted")  # a row not ended yet (None: made here, before its first flush)


class RequestsProjector(Projector):
    name = "requests"
    tables = (Request, RequestMove)
    handles = (RequestAccepted, RequestFinished, RequestFailed, RequestMoved)
    # A request's accepted event comes while its stage computes its first token beside the leader (on
    # a small machine, on the same cores): written at once, its transaction slowed that first token by
    # about as much CPU as it took (docs/benchmarks.md). Gathered, it is written after the first token
    # of a short prompt, and a request that ends within the linger writes both events in one transaction.
    linger_s = 0.1

    async def apply(self, session: AsyncSession, evt: Event, seq: int) -> None:
        match evt:
            case RequestAccepted():
                if await session.get(Request, evt.request_id) is None:
                    session.add(Request(
                        request_id=evt.request_id, model_id=evt.model_id, load_id=evt.load_id,
                        status="accepted", stream=evt.stream, max_tokens=evt.max_tokens,
                        token_id=evt.token_id, api=evt.api, accepted_at=evt.at, prompt_tokens=0,
                        completion_tokens=0, finish_reason="", duration_s=0.0, tokens_per_s=0.0,
                        error_code="", error_message="", fellow_id=""))
            case RequestFinished():
                row = await self._row(session, evt.request_id, evt.model_id, evt.load_id, evt.at)
                if row.status not in OPEN:
                    return
                row.status = "finished"
                row.ended_at = evt.at
                row.prompt_tokens = evt.prompt_tokens
                row.completion_tokens = evt.completion_tokens
                row.finish_reason = evt.finish_reason
                row.ttft_s = evt.ttft_s
                row.duration_s = evt.duration_s
                row.tokens_per_s = evt.tokens_per_s
                row.timing = dict(evt.timing)
                row.fellow_id = evt.fellow_id
            case RequestFailed():
                row = await self._row(session, evt.request_id, evt.model_id, evt.load_id, evt.at)
                if row.status not in OPEN:
                    return
                row.status = "too_long" if evt.code == "context_too_long" else "failed"
                row.ended_at = evt.at
                row.error_code = evt.code
                row.error_message = evt.message
                row.prompt_tokens = evt.prompt_tokens
                row.completion_tokens = evt.completion_tokens
                row.fellow_id = evt.fellow_id or row.fellow_id
            case RequestMoved():
                if await session.get(RequestMove, (evt.request_id, evt.moves)) is None:
                    session.add(RequestMove(request_id=evt.request_id, move=evt.moves, fellow_id=evt.fellow_id,
                                            load_id=evt.load_id, seq=evt.seq, tokens=evt.tokens, at=evt.at))
                row = await session.get(Request, evt.request_id)
                if row is not None and row.status in OPEN:  # it goes on at that load (a failed one's heal)
                    row.load_id = evt.load_id

    async def _row(self, session: AsyncSession, request_id: str, model_id: str, load_id: str,
                   at: float) -> Request:
        row = await session.get(Request, request_id)
        if row is None:  # the accepted event was trimmed or lost: keep what we know
            row = Request(request_id=request_id, model_id=model_id, load_id=load_id, accepted_at=at,
                          stream=False, max_tokens=0, token_id="", prompt_tokens=0,
                          completion_tokens=0, finish_reason="", duration_s=0.0,
                          tokens_per_s=0.0, error_code="", error_message="", fellow_id="")
            session.add(row)
        return row
