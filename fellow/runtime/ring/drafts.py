"""A ring's draft model on its last stage (the spec's TS9).

The last stage produces every token anyway, so after it answers a frame that asks (``Hidden.draft_k``)
its draft model guesses the next tokens of that session from the whole sequence (the prompt, which
the session's first frame carries, and the reply it sampled), and the guesses ride back to stage 0 on
the token frame (``Token.draft``). Stage 0 keeps each session's latest guesses (``RingDrafts``) and its
scheduler takes them as the draft model's drafts of the next pass, where prompt lookup has no full run
(``Scheduler.drafts``): that pass travels the ring as a VERIFY frame as before. The draft model's KV
lives on the last stage and counts in its budget; stage 0 holds none.
"""

from __future__ import annotations

from collections.abc import Iterable

from fellow.runtime.engine.draft_model import DraftModel


class RingDrafts:
    """Stage 0's side, in a draft model's place for its scheduler: ``propose`` answers each session with
    the guesses its last answer brought (none where it brought none)."""

    positions = 0  # the draft model's positions are held on the last stage

    def __init__(self, name: str) -> None:
        self.name = name
        self.latest: dict[str, list[int]] = {}

    def budget_tokens(self, kv_tokens: int) -> int:
        return kv_tokens

    def took(self, session_id: str, drafts: Iterable[int]) -> None:
        """A session's answer came back with these guesses (replacing any older ones)."""
        self.latest[session_id] = list(drafts)

    def release(self, session_id: str) -> None:
        self.latest.pop(session_id, None)

    def propose(self, rows: list[tuple[str, list[int], int, frozenset[int]]]) -> dict[str, list[int]]:
        return {session_id: self.latest.pop(session_id, [])[:limit] for session_id, _, limit, _ in rows}


class LastStageDrafter:
    """The last stage's side: its draft model guesses after the tokens it answered, for the frames that
    asked, all such sessions in one ``propose``."""

    def __init__(self, model: DraftModel, stop_ids: frozenset[int]) -> None:
        self.model, self.stop_ids = model, stop_ids

    @property
    def name(self) -> str:
        return self.model.name

    def after(self, answered: list[tuple[str, int, list[int]]]) -> dict[str, list[int]]:
        """Guesses for each ``(session, draft_k, sequence so far)`` whose frame asked and whose reply goes on
        (its last token not a stop)."""
        rows = [(session, sequence, k, self.stop_ids) for session, k, sequence in answered
                if k > 0 and sequence and sequence[-1] not in self.stop_ids]
        return self.model.propose(rows) if rows else {}

    def release(self, session_id: str) -> None:
        self.model.release(session_id)
