"""A moved request on the stage (events.moves): its prompt followed by the reply so far, frames from where
the reply stopped, usage counted once."""

from __future__ import annotations

import msgspec

from events.requests import ChatRequest


def resumed(req: ChatRequest, prompt_ids: list[int]) -> tuple[ChatRequest, list[int]]:
    """(the request as this stage serves it, the ids it prefills): a moved request's reply so far follows
    its prompt, its max_tokens and min_tokens are less what was sent, and a sampled one's generator skips the
    draws of the tokens sent (``Sampling.drawn``)."""
    if req.resume is None:
        return req, prompt_ids
    sent = len(req.resume.reply_ids)
    sampling = msgspec.structs.replace(req.sampling, min_tokens=max(0, req.sampling.min_tokens - sent),
                                       drawn=0 if req.sampling.greedy else sent)
    return (msgspec.structs.replace(req, max_tokens=max(1, req.max_tokens - sent), sampling=sampling),
            prompt_ids + list(req.resume.reply_ids))


def sent(req: ChatRequest) -> int:
    """The reply tokens an earlier stage sent (prefilled here as prompt, counted as completion)."""
    return len(req.resume.reply_ids) if req.resume is not None else 0


def start_at(req: ChatRequest) -> tuple[int, int]:
    """(seq, after) of the request's start frame (fellow.token_batcher.TokenBatcher.start)."""
    return (req.resume.seq, req.resume.after) if req.resume is not None else (0, 0)


def count_once(out, sent_before: int) -> None:
    """A moved request's ending Output counts the reply's tokens sent before the move as completion, not
    as prompt (and the prefix cache's hits on them not as cached prompt tokens)."""
    out.completion_tokens += sent_before
    out.prompt_tokens = max(0, out.prompt_tokens - sent_before)
    if isinstance(out.timing.get("cached_tokens"), int):
        out.timing["cached_tokens"] = min(out.timing["cached_tokens"], out.prompt_tokens)
