"""The one-stage decode loop: admits sessions by tokens, runs prompt pieces and batched decode steps."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from fellow.runtime.admission import TokenBudget
from fellow.runtime.sampling import make_generator, sample
from fellow.runtime.session import Session
from fellow.runtime.stage import StageModel


@dataclass
class StepResult:
    """What one step produced: new tokens per session id, and the sessions that ended (finish_reason set)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Session] = field(default_factory=list)

    def emit(self, session: Session, token: int) -> None:
        self.tokens.setdefault(session.session_id, []).append(token)


class Engine:
    """Serves sessions on a stage that holds the whole model (a ring of one). Free of I/O.

    The caller adds sessions, cancels them, and calls ``step()`` in a loop while ``busy``. Each step
    runs prompt pieces of at most ``prefill_chunk`` tokens in all (at least one piece; 0 runs one
    whole prompt), so a long prompt does not hold up the others' decode for long, and then one decode
    position for every decoding session, in batches of at most ``max_batch`` (0: no cap, 1: off).
    """

    def __init__(self, stage: StageModel, *, kv_tokens: int, max_batch: int = 0, prefill_chunk: int = 256) -> None:
        if not (stage.is_first and stage.is_last):
            raise ValueError("the engine serves a stage that holds the embeddings and the head")
        if max_batch < 0 or prefill_chunk < 0:
            raise ValueError("max_batch and prefill_chunk must be >= 0")
        self.stage = stage
        self.budget = TokenBudget(kv_tokens)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Session] = deque()
        self.sessions: dict[str, Session] = {}  # admitted, in admission order
        self._cancels: dict[str, str] = {}
        self.last_prefill_batch = 0  # prompts in the last step's padded prefill (0: none batched)
        self.last_batches: list[int] = []  # the decode batch sizes of the latest step, for stats

    @property
    def kv_tokens(self) -> int:
        return self.budget.kv_tokens

    @property
    def busy(self) -> bool:
        return bool(self.sessions or self.waiting or self._cancels)

    def can_admit(self, tokens: int) -> bool:
        """Whether a request reserving ``tokens`` would be admitted now, behind any already waiting."""
        return tokens + sum(s.reserved_tokens for s in self.waiting) <= self.budget.free

    def add(self, session: Session) -> None:
        """Queue a session; it is admitted when its tokens fit. ContextTooLong if they never can."""
        self.budget.check(len(session.prompt_ids), session.max_new_tokens)
        if session.session_id in self.sessions or any(s.session_id == session.session_id for s in self.waiting):
            raise ValueError(f"session {session.session_id!r} is already in the engine")
        session.added_at = time.perf_counter()
        self.waiting.append(session)

    def cancel(self, session_id: str, reason: str = "cancelled") -> None:
        """End a session at the next step and give back its cache and tokens (a stop string: reason "stop")."""
        self._cancels[session_id] = reason

    def stats(self) -> dict:
        caches = [s.cache for s in self.sessions.values() if s.cache is not None]
        return {"kv_tokens": self.kv_tokens, "reserved_tokens": self.budget.reserved,
                "cached_tokens": sum(c.length for c in caches), "kv_bytes": sum(c.bytes for c in caches),
                "in_flight": len(self.sessions), "waiting": len(self.waiting),
                "decode_batches": list(self.last_batches)}

    def step(self) -> StepResult:
        result = StepResult()
        self._apply_cancels(result)
        self._admit()
        self._prefill(result)
        self._decode(result)
        return result

    def _apply_cancels(self, result: StepResult) -> None:
        for session_id, reason in self._cancels.items():
            session = self.sessions.get(session_id)
            if session is not None:
                self._finish(session, reason, result)
                continue
            for queued in self.waiting:
                if queued.session_id == session_id:
                    self.waiting.remove(queued)
                    queued.finish_reason = reason
                    result.finished.append(queued)
                    break
        self._cancels.clear()

    def _admit(self) -> None:
        # first come, first served: the head of the line waits until it fits, and nobody passes it
        while self.waiting and self.budget.fits(self.waiting[0].reserved_tokens):
            session = self.waiting.popleft()
            self.budget.reserve(session.reserved_tokens)
            session.cache = self.stage.new_cache()
            session.generator = make_generator(session.sampling, self.stage.output_device)
            self.sessions[session.session_id] = session

    def _finish(self, session: Session, reason: str | None, result: StepResult) -> None:
        if reason is not None:
            session.finish_reason = reason
        self.sessions.pop(session.session_id, None)
        self.budget.release(session.reserved_tokens)
        session.cache.release()
        session.cache = None
        result.finished.append(session)

    def _prefill(self, result: StepResult) -> None:
        spent = self._prefill_fresh(result)
        for session in [s for s in self.sessions.values() if s.prefilling]:
            if spent and (self.prefill_chunk == 0 or spent >= self.prefill_chunk):
                break
            left = len(session.prompt_ids) - session.prefilled
            size = min(left, self.prefill_chunk) if self.prefill_chunk else left
            if session.prefill_started_at is None:
                session.prefill_started_at = time.perf_counter()
            piece = torch.tensor(session.prompt_ids[session.prefilled : session.prefilled + size],
                                 device=self.stage.input_device)
            logits = self.stage.forward_piece(session.cache, piece)
            session.prefilled += size
            spent += size
            if not session.prefilling:  # the prompt's last piece starts the reply
                token = int(sample(logits[None], [session.sampling], [session.generator])[0])
                self._accept(session, token, time.perf_counter(), result)

    def _prefill_fresh(self, result: StepResult) -> int:
        """Whole short prompts that arrived together go through in one forward, left-padded (rows x
        longest counted against prefill_chunk); one prompt alone, or a long one, takes the loop below."""
        fresh = [s for s in self.sessions.values()
                 if s.prefilled == 0 and (not self.prefill_chunk or len(s.prompt_ids) <= self.prefill_chunk)]
        batch: list[Session] = []
        for session in fresh:
            if self.max_batch and len(batch) == self.max_batch:  # SWARM_SERVE_MAX_BATCH caps these too
                break
            width = max([len(session.prompt_ids)] + [len(s.prompt_ids) for s in batch])
            if self.prefill_chunk and (len(batch) + 1) * width > self.prefill_chunk:
                break
            batch.append(session)
        self.last_prefill_batch = len(batch) if len(batch) >= 2 else 0
        if not self.last_prefill_batch:
            return 0
        started = time.perf_counter()
        for session in batch:
            session.prefill_started_at = started
        logits = self.stage.prefill_fresh([s.cache for s in batch], [s.prompt_ids for s in batch])
        tokens = sample(logits, [s.sampling for s in batch], [s.generator for s in batch]).tolist()
        now = time.perf_counter()
        for session, token in zip(batch, tokens):
            session.prefilled = len(session.prompt_ids)
            self._accept(session, token, now, result)
        return len(batch) * max(len(s.prompt_ids) for s in batch)

    def _decode(self, result: StepResult) -> None:
        decoding = [s for s in self.sessions.values() if not s.prefilling]
        batches = self._decode_batches(decoding)
        self.last_batches = [len(batch) for batch in batches]
        for batch in batches:
            started = time.perf_counter()
            ids = torch.tensor([s.next_input for s in batch], device=self.stage.input_device)
            logits = self.stage.decode([s.cache for s in batch], ids)
            tokens = sample(logits, [s.sampling for s in batch], [s.generator for s in batch]).tolist()
            now = time.perf_counter()
            for session, token in zip(batch, tokens):
                session.decode_s += now - started
                session.decode_steps += 1
                self._accept(session, token, now, result)

    def _accept(self, session: Session, token: int, now: float, result: StepResult) -> bool:
        """Take a sampled token into the session (and the step's result); True when it ended the session."""
        ended = session.accept(token, now)
        if session.finish_reason != "stop":  # an end-of-turn id is not part of the reply
            result.emit(session, token)
        if ended:
            self._finish(session, None, result)
        return ended

    def _decode_batches(self, sessions: list[Session]) -> list[list[Session]]:
        """Batches of at most max_batch; sessions of similar length together, so padding stays small."""
        cap = len(sessions) if self.max_batch == 0 else self.max_batch
        batches: list[list[Session]] = []
        current: list[Session] = []
        for session in sorted(sessions, key=lambda s: s.cache.length):
            if current and (len(current) == cap or not self._fits_padded(len(current) + 1, session.cache.length)):
                batches.append(current)
                current = []
            current.append(session)
        if current:
            batches.append(current)
        return batches

    def _fits_padded(self, rows: int, longest: int) -> bool:
        """Whether one layer's padded copy of a batch fits beside the reservations.

        The copy holds rows x (longest + 1) positions of one layer, so it costs that over the number
        of layers in budget tokens. It may use what is unreserved plus one prompt piece's room: a
        decode step never runs beside a piece.
        """
        copy_tokens = rows * (longest + 1) / len(self.stage.layers)
        return copy_tokens <= self.budget.free + (self.prefill_chunk or 256)
