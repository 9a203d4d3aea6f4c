"""A reply that outlives its stage (issue 53): a request moved mid-reply to another placement.

When the stage serving a request dies, the gateway publishes the request again (leader.moves) with a
``Resume``: the reply's tokens already sent, which the next stage prefills after the prompt, how much of
their text the client has, and where its frames go on. One RequestMoved event records each move.
"""

from __future__ import annotations

import msgspec

from events.base import Event

MAX_MOVES = 3  # moves of one request; the next loss fails it as before


class Resume(msgspec.Struct, frozen=True, kw_only=True):
    """Where a moved request goes on: its next stage prefills prompt + ``reply_ids``, replays them through
    what the reply's next tokens depend on (its detokenizer, stop strings, grammar and penalties), and sends
    frames from ``seq`` (its start frame) on."""

    seq: int  # the seq of the new stage's start frame, one past the last frame stored; its tokens follow
    after: int  # the stream sequence of the last frame stored: the start frame is stored only right after it
    reply_ids: list[int]  # the reply's tokens already sent
    text_sent: int = 0  # characters of their text sent: the rest was held back (part of a character, or of
    # what may be a stop string) and comes out from the next stage
    moves: int = 1  # which move this is


class RequestMoved(Event, frozen=True, tag="request.moved"):
    """The stage serving a request died mid-reply; the request goes on elsewhere from ``seq``."""

    request_id: str
    model_id: str
    load_id: str  # the load it goes on at: its own, or the one that heals its failed load
    fellow_id: str  # the fellow whose stage died under it ("" where its load failed naming none)
    replica: int = 0
    seq: int = 0  # the frame the next stage starts at
    tokens: int = 0  # reply tokens sent before the move
    moves: int = 1
    reason: str = ""


def move_id(request_id: str, moves: int) -> str:
    """The id of a request's n-th move, its RequestMoved's and its republished request's alike."""
    return f"mv-{request_id}-{moves}"
