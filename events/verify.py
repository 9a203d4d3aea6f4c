"""Replies checked by a second fellow (leader.verify): one event per check, one when a fellow is drained."""

from __future__ import annotations

from events.base import Event


class ReplyChecked(Event, frozen=True, tag="reply.checked"):
    """Another replica scored a finished reply teacher-forced; ``passed`` is the leader's verdict."""

    request_id: str  # the checked request (its scoring request is ``vf-<request_id>``)
    model_id: str
    load_id: str
    fellow_id: str  # whose stage served the reply
    scorer_id: str  # whose stage scored it
    mode: str  # greedy | sampled
    passed: bool
    tokens: int = 0  # reply tokens compared
    bad: int = 0  # of them, how many failed the test
    first_bad: int = -1  # the first failing position in the reply (-1: none)
    worst: float = 0.0  # greedy: the largest gap to the argmax in nats; sampled: the lowest logprob


class FellowDrained(Event, frozen=True, tag="fellow.drained"):
    """A fellow whose replies failed checks by other fellows: placement gives it no new stage."""

    fellow_id: str
    failed: int  # failed checks of its replies when it was drained
    scorers: list[str] = []  # the fellows whose scores it failed
    reason: str = ""
