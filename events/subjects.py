"""Subject builders and stream configurations: the one place that names them."""

from __future__ import annotations

from dataclasses import dataclass, field

EVENTS_STREAM = "SWARM_EVENTS"
HEARTBEATS_STREAM = "SWARM_HEARTBEATS"
COMMANDS_STREAM = "SWARM_COMMANDS"
REQUESTS_STREAM = "SWARM_REQUESTS"
TOKENS_STREAM = "SWARM_TOKENS"

EVENTS_ALL = "swarm.evt.>"
HEARTBEATS_ALL = "swarm.hb.*"
COMMANDS_ALL = "swarm.cmd.*.*"
REQUESTS_ALL = "swarm.req.*"
TOKENS_ALL = "swarm.tok.*"


def _token(part: str) -> str:
    """A subject token must not contain '.', '*', '>' or whitespace."""
    if not part or any(c in part for c in ".*> \t\r\n"):
        raise ValueError(f"not a valid subject token: {part!r}")
    return part


def event(kind: str, fellow_id: str = "") -> str:
    """``swarm.evt.<kind>``; kind is the event's tag, e.g. ``fellow.joined``. What a fellow publishes goes
    on ``swarm.evt.<kind>.<fellow_id>``, the only event subjects its NATS user may publish on."""
    return "swarm.evt." + kind + ("." + _token(fellow_id) if fellow_id else "")


def event_watch(kind: str) -> list[str]:
    """The subjects of one kind of event from anyone: the leader's and every fellow's."""
    return [event(kind), event(kind) + ".*"]


def event_sender(subject: str, kind: str) -> str | None:
    """Who published an event of `kind` on `subject`: "" the leader, else the fellow's id; None when the
    subject is not one of that kind's (a payload of one type on another type's subject)."""
    bare = event(kind)
    if subject == bare:
        return ""
    if subject.startswith(bare + ".") and "." not in subject[len(bare) + 1:]:
        return subject[len(bare) + 1:]
    return None


def heartbeat(fellow_id: str) -> str:
    return "swarm.hb." + _token(fellow_id)


def command(fellow_id: str, verb: str) -> str:
    return f"swarm.cmd.{_token(fellow_id)}.{_token(verb)}"


def commands_for(fellow_id: str) -> str:
    return f"swarm.cmd.{_token(fellow_id)}.*"


def request(load_id: str) -> str:
    return "swarm.req." + _token(load_id)


def tokens(request_id: str) -> str:
    return "swarm.tok." + _token(request_id)


def cancel(load_id: str, request_id: str) -> str:
    """``swarm.cancel.<load>.<request>``: the gateway's hard cancel of one request of a load."""
    return f"swarm.cancel.{_token(load_id)}.{_token(request_id)}"


def cancels_of(load_id: str) -> str:
    """What a stage of ``load_id`` subscribes to: the cancels of its own load, no other."""
    return f"swarm.cancel.{_token(load_id)}.*"


def logs(fellow_id: str) -> str:
    """``swarm.logs.<fellow>``: a core NATS request for a fellow's log tails (events/logs.py)."""
    return "swarm.logs." + _token(fellow_id)


def request_consumer(load_id: str) -> str:
    """The durable pull consumer on SWARM_REQUESTS that every replica of a load shares."""
    return "load-" + _token(load_id)


def command_consumer(fellow_id: str) -> str:
    """The durable pull consumer on SWARM_COMMANDS through which a fellow takes its commands."""
    return "fellow-" + _token(fellow_id)


def ring(load_id: str, lane: str) -> str:
    return f"swarm.ring.{_token(load_id)}.{_token(lane)}"


@dataclass(frozen=True)
class StreamSpec:
    """What a stream must look like; `core.bus` turns it into a nats StreamConfig."""

    name: str
    subjects: list[str]
    retention: str = "limits"  # limits | workqueue
    max_age_s: float = 0.0  # 0: forever
    max_msgs_per_subject: int = -1
    duplicate_window_s: float = 120.0
    extra: dict = field(default_factory=dict)


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(EVENTS_STREAM, [EVENTS_ALL]),
    StreamSpec(HEARTBEATS_STREAM, [HEARTBEATS_ALL], max_age_s=60.0, max_msgs_per_subject=3,
               duplicate_window_s=10.0),
    StreamSpec(COMMANDS_STREAM, [COMMANDS_ALL], retention="workqueue", max_age_s=24 * 3600.0),
    StreamSpec(REQUESTS_STREAM, [REQUESTS_ALL], retention="workqueue", max_age_s=3600.0),
    StreamSpec(TOKENS_STREAM, [TOKENS_ALL], max_age_s=3600.0),
)
