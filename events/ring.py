"""Ring frames between the stages of a load, on core NATS ``swarm.ring.<load>.<lane>`` (msgpack, binary).

Stage 0 sends on ``act``, middle stage i on ``act<i>``, and the last stage sends the sampled token
on ``tok``, which stage 0 reads; so a token costs one hop per stage. Every stage also publishes
what it sent per lane on ``stats`` now and then, which the leader keeps for the performance view.
"""

from __future__ import annotations

import msgspec

from events.requests import Sampling

STATS_LANE = "stats"

# Hidden.kind: a decode position, a prompt piece with more to come, the prompt's last piece, and a
# speculative pass: the session's last token and the tokens drafted after it (Hidden.draft), which
# the last stage verifies; the positions that do not stand are cropped on every stage.
DECODE, PIECE, LAST_PIECE, VERIFY = 0, 1, 2, 3
NO_TOKEN = -1  # the last stage's answer to a piece that is not the prompt's last: nothing sampled
PREFIX_MISSING = "prefix_missing"  # Token.code: a stage no longer holds the prefix stage 0 reused


def send_lane(stage: int, num_stages: int) -> str:
    """The lane stage ``stage`` of ``num_stages`` sends on."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not in a ring of {num_stages}")
    if stage == num_stages - 1:
        return "tok"
    return "act" if stage == 0 else f"act{stage}"


def recv_lane(stage: int, num_stages: int) -> str:
    """The lane a stage listens on: its predecessor's, and the last stage's for stage 0."""
    return send_lane((stage - 1) % num_stages, num_stages)


class _Hot(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True, tag_field="f"):
    """Hot-path frames: positional arrays, defaults left out, no GC tracking."""


class RingSampling(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The request's sampling, named once in the session's first frame for the last stage, with the ids its
    logits processors need (fellow.runtime.engine.processors): ``stop_ids`` ride along only with
    ``min_tokens``, and ``prompt_ids`` only with a ``repetition_penalty``. ``sampling.grammar``
    (structured outputs, constrained tool calls) is compiled by the last stage, which loads the tokenizer
    for it.
    """

    sampling: Sampling = Sampling()
    stop_ids: list[int] = []
    prompt_ids: list[int] = []
    output_ids: list[int] = []  # a replayed session's reply so far (its frames replay them after the prompt)


class Hidden(_Hot, tag="h"):
    """Positions [pos, pos + positions) of one session, coded as the boundary's codec says.

    ``data`` holds the rows, ``scale`` a quantizer's per-position scales. ``batch`` frames were
    sent together in sender step ``step``; the receiver waits briefly for all of them.
    ``compute_ms`` collects each later stage's compute for this frame, in ring order.

    Prefix caching (each stage keeps its own finished sessions' positions, keyed by token ids):
    ``ids`` are the token ids of this frame's positions, sent while the load keeps a prefix cache.
    A session's first frame is the one whose ``pos`` equals ``len(reuse)``: ``reuse`` holds the ids
    of the positions [0, pos) that stage 0 took from its prefix cache, and every later stage takes
    them from its own or answers PREFIX_MISSING. ``reserve`` is the session's KV reservation, so
    that a later stage evicts its kept blocks by the same ledger as stage 0.
    """

    session: str
    pos: int
    positions: int
    data: bytes
    scale: bytes = b""
    kind: int = DECODE
    batch: int = 1
    step: int = 0
    sampling: RingSampling | None = None
    compute_ms: list[float] = []
    ids: list[int] = []
    reuse: list[int] = []
    reserve: int = 0
    routes: str = ""  # how each hop so far sent it: "d" direct, "r" relay, one letter per hop
    attempt: int = 0  # the session's try: a replay or a start-over begins the next, and older frames are dropped
    draft: list[int] = []  # VERIFY: the drafted tokens (the frame's positions are the last token and these)
    draft_k: int = 0  # the last stage's draft model drafts up to this many tokens after its answer (0: none)

    @property
    def first(self) -> bool:
        """Whether this is its session's first frame (later frames have pos > 0 and no reuse)."""
        return self.pos == len(self.reuse)


class Token(_Hot, tag="t"):
    """The last stage's answer for one frame (NO_TOKEN for a non-final piece), or a stage's error."""

    session: str
    token: int
    batch: int = 1
    step: int = 0
    compute_ms: list[float] = []
    error: str = ""
    code: str = ""
    logprob: tuple[int, float, list[tuple[int, float]]] | None = None  # when the request asked for logprobs
    routes: str = ""  # the frame's hops, as Hidden.routes, the last stage's hop back included
    attempt: int = 0  # the attempt of the frame it answers (Hidden.attempt)
    tokens: list[int] = []  # a VERIFY frame's answer: every token the pass gained (``token`` unused)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []  # theirs, when the request asked
    # a piece's prompt logprobs (Sampling.prompt_logprobs; engine.prompt_scores), the first for prompt
    # position ``prompt_pos``: None for the prompt's first position, else (id, logprob, [(id, logprob)], rank)
    prompt: list[tuple[int, float, list[tuple[int, float]], int] | None] = []
    prompt_pos: int = 0
    draft: list[int] = []  # the last stage's draft model's guesses after the answer's last token (Hidden.draft_k)


class End(_Hot, tag="e"):
    """The session ended on stage 0: every stage drops its cache, or with ``keep`` keeps its
    positions in its prefix cache first (stage 0 kept them too). ``length``: the positions stage 0's
    cache holds; a stage holding more (the drafts of a last VERIFY frame) crops to it first."""

    session: str
    keep: bool = False
    length: int = -1


class Probe(_Hot, tag="p"):
    """Goes once round the ring; back on stage 0, every stage is listening. ``routes`` says how each
    hop sent it: "d" direct, "r" relay, "?" still dialing its next stage. ``kv``: each later stage's
    KV tokens, in ring order (stage 0 holds every session to the smallest). ``step_ms``: each later
    stage's decode step at a decode group's rows, measured at load (empty where none measured; stage 0
    sizes its in flight from them, fellow.runtime.ring.sizing). ``drafter``: the last stage's draft model,
    named when it has one (stage 0 then asks it for drafts, Hidden.draft_k)."""

    nonce: str
    routes: str = ""
    kv: list[int] = []
    step_ms: list[float] = []
    drafter: str = ""  # the draft model the last stage drafts with, when it has one


class Hop(_Hot, tag="o"):
    """A frame on a stage's own lane, numbered per hop, so the receiver keeps the sender's order
    whichever route (direct link or relay) each one took, and drops one that came both ways."""

    epoch: int  # the sending link's own number: a restarted sender starts a new count
    seq: int
    data: bytes  # the encoded frame


class Ack(_Hot, tag="a"):
    """Direct link, receiver to sender: every Hop up to ``seq`` is in."""

    seq: int


class Ping(_Hot, tag="g"):
    """Direct link: a round trip of the link probe; the receiver sends it straight back."""

    nonce: int


class LaneStats(_Hot, tag="s"):
    """What one stage has sent so far: lane -> [bytes, frames]."""

    stage: int
    lanes: dict[str, list[int]] = {}
    dropped: int = 0
    replica: int = 0


RingFrame = Hidden | Token | End | Probe | LaneStats | Hop | Ack | Ping

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RingFrame)


def encode_frame(frame: RingFrame) -> bytes:
    return _encoder.encode(frame)


def decode_frame(data: bytes) -> RingFrame:
    """One frame; msgspec.DecodeError (or ValidationError) for anything malformed."""
    return _decoder.decode(data)


STATS_ALL = "swarm.ring.*." + STATS_LANE  # every load's lane stats, for the leader
