"""Sessions with the same prompt share one prefill (OpenAI's ``n`` choices, or any identical prompts that
meet on a stage): the first to start runs the prompt; the others wait beside it, and when its last piece
has run each gets a copy of its keys and values and samples its first token from the same logits with its
own seed and processors. A session that comes once the first has run its prompt (choices reach the stage
as separate requests, and a short prompt's prefill is done before the next one is in) copies every prompt
position but the last from it, and runs that one itself (``late``). So ``n`` choices cost one prefill,
and each reply is what it would be alone (the copy is of the very positions its own prefill would have
computed on that path; tests/test_choice_forks.py).

A session forks only from a prompt the same to the token, with nothing of the prefix cache in it, where the
stage can copy a session (no recurrent layers: their states are not copied), and where it does not ask
for the prompt's own logprobs (each scores its prompt). Its ledger reservation is its own from admission.
"""

from __future__ import annotations

from collections.abc import Iterable

from fellow.runtime.engine.session import Session


def forkable(session: Session) -> bool:
    return session.sampling.prompt_logprobs is None and session.cached_tokens == 0


def twins(sessions: Iterable[Session]) -> dict[str, list[Session]]:
    """Per session that runs a prompt (its id), the sessions that wait to fork from it: those with the same
    prompt that have not started theirs. The source is the one furthest on (the first added, on a tie)."""
    groups: dict[tuple[int, ...], list[Session]] = {}
    for s in sessions:
        if s.prefilling and forkable(s):
            groups.setdefault(tuple(s.prompt_ids), []).append(s)
    out: dict[str, list[Session]] = {}
    for group in groups.values():
        if len(group) > 1:
            source = max(group, key=lambda s: s.prefilled)  # max keeps the first of equals: the first added
            waiting = [s for s in group if s is not source and s.prefilled == 0]
            if waiting:
                out[source.session_id] = waiting
    return out


def late(sessions: list[Session]) -> None:
    """Each session that has not started its prompt takes all of it but the last position from a session
    that has run the same prompt (it then runs that last position, and samples from its own logits). Only
    where a session is fresh are prompts compared (a decode step compares none)."""
    fresh = {tuple(s.prompt_ids): s for s in sessions if s.prefilled == 0 and forkable(s) and len(s.prompt_ids) > 1}
    if not fresh:
        return
    lengths = {len(prompt) for prompt in fresh}
    donors = {}
    for s in sessions:
        if not s.prefilling and s.cache is not None and len(s.prompt_ids) in lengths:
            donors.setdefault(tuple(s.prompt_ids), s)
    for s in sessions:
        if s.prefilled == 0 and forkable(s) and (donor := donors.get(tuple(s.prompt_ids))) is not None:
            _copy(s, donor, len(s.prompt_ids) - 1)


def fork(source: Session, waiting: list[Session]) -> None:
    """Copy the source's prompt positions into each waiting session's cache (the source has just run its
    last piece, before it samples: a first token that ends it would release its cache)."""
    for s in waiting:
        _copy(s, source, len(source.prompt_ids))
        s.prefill_started_at = source.prefill_started_at


def _copy(session: Session, donor: Session, positions: int) -> None:
    session.cache.copy_from(donor.cache, positions)
    session.prefilled = positions
    session.forked = True
