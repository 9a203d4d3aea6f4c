"""What a decode pass drafts: prompt lookup (the spec's TS1) and the guard that stops a session's
drafting while its drafts keep failing.

Prompt lookup guesses that a reply goes on as the text it repeats: it finds the latest earlier
occurrence of the sequence's last 4, 3 or 2 tokens (longest first), in the prompt or the reply so
far, and drafts up to k of the tokens that followed it. Where those run into the sequence's end, the
drafts go on copying themselves (a repeating pattern is drafted as repeating on).
"""

from __future__ import annotations

from events.loads import MAX_SPECULATIVE

NGRAMS = (4, 3, 2)  # the tail lengths looked up, longest first
FAILED_PASSES = 2  # passes in a row in which no draft stood before the guard pauses drafting
PAUSE_PASSES = 16  # how long it pauses


def check_speculative(k: int) -> int:
    """k itself when it is a valid number of drafted tokens per pass (0 is off); else ValueError."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE:
        raise ValueError(f"speculative={k!r} must be a whole number of drafted tokens from 0 (off) "
                         f"to {MAX_SPECULATIVE}")
    return k


class PromptLookup:
    """One session's sequence (prompt, then reply) and an index of its n-grams, kept as it grows.

    ``index[n]`` maps each n-gram to the position just after its latest occurrence; only n-grams that
    end before the sequence's last token are indexed when a draft is looked up, so the tail never
    finds itself.
    """

    def __init__(self, prompt: list[int]) -> None:
        self.ids = list(prompt)
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAMS}
        self.indexed = 0  # n-grams ending (exclusive) at positions up to this one are in the index

    def extend(self, ids: list[int]) -> None:
        self.ids.extend(ids)

    def _index_to(self, end: int) -> None:
        ids, index = self.ids, self.index
        for i in range(self.indexed + 1, end + 1):
            for n in NGRAMS:
                if i >= n:
                    index[n][tuple(ids[i - n : i])] = i
        self.indexed = max(self.indexed, end)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's tail."""
        return self.draft_run(k)[0]

    def draft_run(self, k: int) -> tuple[list[int], int]:
        """``draft(k)`` and the length of the tail it matched (0: none)."""
        length = len(self.ids)
        if k <= 0 or length < NGRAMS[-1] + 1:
            return [], 0
        self._index_to(length - 1)
        for n in NGRAMS:
            if length <= n:
                continue
            start = self.index[n].get(tuple(self.ids[length - n :]))
            if start is None:
                continue
            drafts: list[int] = []
            for j in range(k):
                position = start + j
                drafts.append(self.ids[position] if position < length else drafts[position - length])
            return drafts, n
        return [], 0


def draft_limit(session) -> int:
    """How many tokens a session may draft for its next pass (0: none). At most the tokens its reply has
    left but one: a pass then never writes past the session's reservation (the reserved prompt plus
    max_tokens holds the positions of the pass in flight). A session under a grammar drafts nothing: its
    mask is computed one position at a time."""
    if not session.spec_k or session.sampling.grammar or not session.guard.allows():
        return 0
    return min(session.guard.limit, session.max_new_tokens - len(session.output_ids) - 1)


def caught_up(session):
    """The session's prompt lookup, with its reply so far added."""
    lookup = session.lookup
    lookup.extend(session.output_ids[len(lookup.ids) - len(session.prompt_ids):])
    return lookup


def until_stop(gained: list, stop_ids) -> list:
    """A pass's gained (token, logprob) pairs up to the first end-of-turn id: nothing after it counts."""
    for i, (token, _) in enumerate(gained):
        if token in stop_ids:
            return gained[: i + 1]
    return gained


class DraftGuard:
    """Stops a session's drafting for PAUSE_PASSES passes after FAILED_PASSES passes in a row in
    which none of its drafts stood; a pass with a draft that stood resets the count.

    It also sizes the next draft (``limit``): one more than stood last time when some fell, twice
    as many when all stood, never above k. A reply that copies keeps drafting k; one whose drafts
    stand one or two at a time stops paying for positions that fall.
    """

    def __init__(self, k: int = MAX_SPECULATIVE) -> None:
        self.k = k
        self.limit = k  # the most the next pass drafts
        self.failures = 0
        self.paused_for = 0  # passes left without drafting
        self.pauses = 0  # how often it paused, over the session

    def allows(self) -> bool:
        """Whether this pass may draft; a pass spent paused counts down the pause."""
        if self.paused_for:
            self.paused_for -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.limit = min(self.k, 2 * drafted if accepted == drafted else accepted + 1)
        if accepted:
            self.failures = 0
            return
        self.failures += 1
        if self.failures >= FAILED_PASSES:
            self.failures = 0
            self.paused_for = PAUSE_PASSES
            self.pauses += 1
