"""Token frames on ``swarm.tok.<request>``: batches of tokens, then one done or error frame."""

from __future__ import annotations

import hashlib
import hmac

import msgspec


class Frame(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", array_like=False):
    request_id: str
    seq: int  # 0, 1, 2 ... per request, so a gap is visible and filled from the stream


class StartFrame(Frame, frozen=True, tag="start"):
    """seq 0: the stage that took the request says which replica serves it, before it acks the request.

    A fellow that dies after this frame fails the request; one that dies before it leaves the
    request unacked, so JetStream redelivers it to another replica, which serves it only when no
    frame of it is in SWARM_TOKENS yet. So a request is served or fails, never both.
    """

    fellow_id: str
    replica: int = 0


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One candidate token: its text, log-probability and UTF-8 bytes (OpenAI's shape, as an array)."""

    token: str
    logprob: float
    bytes: list[int]
    id: int = -1  # the token's id (prompt logprobs; -1 where a stage did not say)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A sampled token's log-probability and the most likely candidates at its position."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []
    rank: int = 0  # 1 for the likeliest token (prompt logprobs; 0 where a stage did not say)


class TokenFrame(Frame, frozen=True, tag="tokens"):
    # one text per token id ("" where a token completes no character yet), then at most one piece of
    # no token (what the detokenizer still held when the reply ended)
    texts: list[str]
    text: str = ""  # the texts joined, for readers that want one string
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []  # one per token id, when the request asked for logprobs
    # the prompt's, in order, before any token (Sampling.prompt_logprobs): None for the first position;
    # a long prompt's come in several frames
    prompt_logprobs: list[TokenLogprob | None] = []


class DoneFrame(Frame, frozen=True, tag="done"):
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str = "stop"  # stop | length | cancelled
    timing: dict = {}


class ErrorFrame(Frame, frozen=True, tag="error"):
    message: str
    code: str = "internal_error"
    data: dict = {}


AnyFrame = StartFrame | TokenFrame | DoneFrame | ErrorFrame
frame_decoder = msgspec.json.Decoder(AnyFrame)


# A keyed request's frames carry this header: HMAC-SHA256 of the frame's bytes under the request's
# `ChatRequest.frame_key`, which only the leader and the stage that took the request know.
FRAME_TAG_HEADER = "Swarm-Frame-Tag"


def frame_key(secret: bytes, request_id: str) -> str:
    """A request's frame key: derived from the leader's secret, so every leader (and a restarted one)
    can check its frames without keeping the key anywhere. "" without a secret: frames go unsigned."""
    if not secret:
        return ""
    return hmac.new(secret, b"frame-key:" + request_id.encode(), hashlib.sha256).hexdigest()


def frame_tag(key: str, payload: bytes) -> str:
    return hmac.digest(key.encode(), payload, "sha256").hex()[:32]  # digest(): OpenSSL's one-shot, the fast path


def frame_signed(key: str, payload: bytes, headers) -> bool:
    """Whether a frame of a keyed request was sent by the stage holding the key ("" key: no check)."""
    if not key:
        return True
    tag = (headers or {}).get(FRAME_TAG_HEADER, "")
    return bool(tag) and hmac.compare_digest(tag, frame_tag(key, payload))


def frame_msg_id(request_id: str, seq: int, key: str = "") -> str:
    """The Nats-Msg-Id of a frame: a retried publish of the same frame is dropped by JetStream. A keyed
    request's ids hold a mark of the key, so a forged frame cannot take the id of a real one (JetStream
    would drop the real one as its duplicate); every replica that took the request computes the same.
    Frame 0 of a replica's start is sent under its claim_msg_id instead."""
    if not key:
        return f"{request_id}:{seq}"
    return f"{request_id}:{seq}:" + hmac.digest(key.encode(), b"id:%d" % seq, "sha256").hex()[:16]


def claim_msg_id(request_id: str, fellow_id: str, replica: int, nonce: str) -> str:
    """The Nats-Msg-Id of a replica's start frame (frame 0): its own, so that its retried publish alone is
    a duplicate (fellow.token_batcher); the nonce keeps it from being guessed and taken first."""
    return f"{request_id}:0:{fellow_id}:{replica}:{nonce}"
