"""The prompt's own logprobs in a completions reply: OpenAI's ``echo`` with ``logprobs`` (the prompt's tokens
first in the choice's ``logprobs``, the first with ``null``), with ``max_tokens: 0`` for scoring only, and
vLLM's ``prompt_logprobs`` field (``[null, {token_id: {logprob, rank, decoded_token}}, ...]``).

The stage that samples computes them from a teacher-forced pass of the prompt (fellow.runtime.engine.
prompt_scores) and sends them ahead of the reply's tokens (TokenFrame.prompt_logprobs). A scoring-only
request runs as a one-token request whose token is dropped here: its choice holds the prompt alone, its
usage no completion tokens. Served in whole replies, on one stage and on rings (the last stage scores
each piece it runs); a stream is refused.
"""

from __future__ import annotations

import msgspec

from events.frames import TokenLogprob
from leader.openai.schema import MAX_LOGPROBS
from leader.openai.validate import bad, unsupported


class Scoring(msgspec.Struct, kw_only=True):
    """What a completions request asked of its prompts' logprobs, and what shaping them needs."""

    top: int  # candidates the stage computes a position (the larger of the two asks)
    echo_top: int | None  # OpenAI's: echo with logprobs
    vllm_top: int | None  # vLLM's prompt_logprobs
    only: bool  # max_tokens 0: the prompt scored, nothing generated
    prompt_ids: list[list[int]]  # per prompt
    first_texts: list[str]  # per prompt: its first token's text (no logprob of its own)
    echoes: list[str]  # per choice: the echoed prompt text
    per_prompt: int  # choices per prompt (n)

    def prompt_of(self, index: int) -> int:
        return index // self.per_prompt


def asked(body) -> int | None:
    """Candidates a position the stage computes (None: no prompt logprobs asked)."""
    tops = [t for t in ((body.logprobs if body.echo else None), body.prompt_logprobs) if t is not None]
    return max(tops) if tops else None


def check(body) -> None:
    """What needs no model: prompt_logprobs' range, no stream with them, max_tokens 0 only with echo."""
    if body.prompt_logprobs is not None and not 0 <= body.prompt_logprobs <= MAX_LOGPROBS:
        raise bad("prompt_logprobs", f"'prompt_logprobs' must be between 0 and {MAX_LOGPROBS} "
                                     f"(got {body.prompt_logprobs})")
    if body.max_tokens == 0 and not body.echo:
        raise bad("max_tokens", "'max_tokens' must be at least 1, or 0 with 'echo' (the prompt scored only)")
    if body.stream and asked(body) is not None:
        raise unsupported("stream", "prompt logprobs come in a whole reply; leave out 'stream'")


def scoring(body, prompt_ids: list[list[int]], first_texts: list[str], echoes: list[str]) -> Scoring | None:
    """None where no prompt logprobs were asked (and the prompt is not only echoed)."""
    top = asked(body)
    if top is None:
        if body.max_tokens == 0:  # echo alone, scored by nobody: the prompt back, nothing generated
            return Scoring(top=0, echo_top=None, vllm_top=None, only=True, prompt_ids=prompt_ids,
                           first_texts=first_texts, echoes=echoes, per_prompt=body.n or 1)
        return None
    return Scoring(top=top, echo_top=body.logprobs if body.echo else None, vllm_top=body.prompt_logprobs,
                   only=body.max_tokens == 0, prompt_ids=prompt_ids, first_texts=first_texts, echoes=echoes,
                   per_prompt=body.n or 1)


def echo_logprobs(first: str, prompt: list[TokenLogprob | None], reply: list[TokenLogprob], top: int) -> dict:
    """OpenAI's legacy shape over the prompt, then the reply: the first token has no logprob (null)."""
    entries = [e for e in prompt[1:] if e is not None] + list(reply)
    tokens = [first] + [e.token for e in entries]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"text_offset": offsets, "token_logprobs": [None] + [e.logprob for e in entries], "tokens": tokens,
            "top_logprobs": [None] + [{t.token: t.logprob for t in e.top_logprobs[:top]} for e in entries]}


def vllm_prompt_logprobs(prompt_ids: list[int], prompt: list[TokenLogprob | None], top: int) -> list:
    """vLLM's: per prompt position, None for the first, else {token id: {logprob, rank, decoded_token}} for the
    prompt's token and the ``top`` likeliest (ranks 1 ..)."""
    out: list = [None]
    for token_id, entry in zip(prompt_ids[1:], prompt[1:]):
        if entry is None:
            out.append(None)
            continue
        best = {str(t.id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
                for rank, t in enumerate(entry.top_logprobs[:top], start=1)}
        out.append({str(token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token},
                    **{k: v for k, v in best.items() if k != str(token_id)}})
    return out
