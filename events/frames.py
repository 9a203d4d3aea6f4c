"""Token frames on ``swarm.tok.<request>``: batches of tokens, then one done or error frame."""

from __future__ import annotations

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


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A sampled token's log-probability and the most likely candidates at its position."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []


class TokenFrame(Frame, frozen=True, tag="tokens"):
    texts: list[str]
    text: str = ""  # the texts joined, for readers that want one string
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []  # one per token id, when the request asked for logprobs


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


def frame_msg_id(request_id: str, seq: int) -> str:
    """The Nats-Msg-Id of a frame: a retried publish of the same frame is dropped by JetStream."""
    return f"{request_id}:{seq}"
