"""Frames as the gateway reads them: a message checked and decoded (`read_frame`), and the SSE ids that
name where a client's stream stands (`event_id`, `parse_event_id`)."""

from __future__ import annotations

import logging

import msgspec

from events.frames import AnyFrame, frame_decoder, frame_signed

log = logging.getLogger("leader.token_stream")


def event_id(request_id: str, next_seq: int) -> bytes:
    """The SSE `id:` line of a chunk: the request and the seq of the next frame it has not sent."""
    return f"id: {request_id}:{next_seq}\n".encode()


def parse_event_id(value: str) -> tuple[str, int] | None:
    """(request_id, next_seq) from a Last-Event-ID that event_id wrote, else None."""
    rid, _, seq = value.strip().rpartition(":")
    if not rid or not seq.isdigit() or len(seq) > 9 or len(rid) > 64:
        return None
    return rid, int(seq)


def read_frame(msg, key: str = "") -> AnyFrame | None:
    """The frame in ``msg``, or None (logged) for one that does not decode or, with the request's `key`,
    is not signed by the stage that took the request."""
    if (msg.headers or {}).get("Nats-Rollup") == "never":  # seen live, refused by the stream: a stage's question
        return None  # (fellow.token_batcher: a claim's second try, stored_beyond), not a frame
    if not frame_signed(key, msg.data, msg.headers):
        log.warning("a frame on %s without the request's signature dropped (not from its stage)", msg.subject)
        return None
    try:
        return frame_decoder.decode(msg.data)
    except (msgspec.DecodeError, RecursionError):  # not a frame, or nested too deep
        log.warning("undecodable frame on %s dropped", msg.subject)
        return None
