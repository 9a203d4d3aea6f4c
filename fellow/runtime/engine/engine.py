"""The one-stage decode loop: admits sessions by tokens, runs prompt pieces and batched decode steps."""

from __future__ import annotations

import time

import torch

from fellow.runtime.engine.draft_model import LOOKUP_FIRST_RUN, DraftModel
from fellow.runtime.engine.drafting import check_speculative
from fellow.runtime.engine.prefix_cache import PrefixCache
from fellow.runtime.engine.processors import sample_next
from fellow.runtime.engine.sampling import make_generator
from fellow.runtime.engine.scheduler import Scheduler, StepResult
from fellow.runtime.engine.session import Session
from fellow.runtime.engine.speculative import verify_drafts
from fellow.runtime.model.recurrent import without_rollback
from fellow.runtime.model.stage import StageModel


class Engine(Scheduler):
    """Serves sessions on a stage that holds the whole model (a ring of one). Free of I/O.

    The caller adds sessions, cancels them, and calls ``step()`` in a loop while ``busy`` (the
    Scheduler's contract). Each step runs prompt pieces of at most ``prefill_chunk`` tokens in all
    (at least one piece; 0 runs one whole prompt), so a long prompt does not hold up the others'
    decode for long, and then one decode position for every decoding session, in batches of at most
    ``max_batch`` (0: no cap, 1: off).

    With ``prefix_cache`` on, a session that ends leaves its positions in the PrefixCache, and a new
    one starts from the longest cached prefix of its prompt. The cache's tokens count in the budget
    beside the reservations, and are evicted whenever a reservation needs their room.

    With ``speculative`` k > 0, each decoding session drafts up to k tokens per pass by prompt lookup
    (fellow.runtime.engine.drafting); a batch in which any session drafted runs as one verify pass
    (``StageModel.verify``: every session's last token and its drafts), ``verify_drafts`` keeps what
    the model agrees with plus one token of its own, and each cache is cropped to what stood.
    Sessions with and without drafts share the pass; a session's DraftGuard sizes its drafts by
    how many stood, and pauses its drafting while they keep failing.

    With a ``draft`` model (fellow.runtime.engine.draft_model) too, prompt lookup still drafts first
    when it matched a tail of LOOKUP_FIRST_RUN tokens or more and has a full set of drafts; every
    other drafting session asks the draft model, in one batch. The budget's tokens then each hold
    a position of both models (``DraftModel.budget_tokens``).

    A stage with recurrent layers (``stage.recurrent``: fellow.runtime.model.recurrent) cannot roll a
    session back nor start one from another's positions: speculative decoding, a draft model and the
    prefix cache are off for it, and its ``kernels["recurrent"]`` says so and why.
    """

    def __init__(self, stage: StageModel, *, kv_tokens: int, max_batch: int = 0, prefill_chunk: int = 256,
                 prefix_cache: bool = True, speculative: int = 0, draft: DraftModel | None = None) -> None:
        if not (stage.is_first and stage.is_last):
            raise ValueError("the engine serves a stage that holds the embeddings and the head")
        if stage.recurrent is not None:
            speculative, draft, prefix_cache = without_rollback(stage, speculative, draft, prefix_cache)
        if draft is not None:
            if not speculative:
                raise ValueError("a draft model drafts only with speculative k > 0")
            kv_tokens = draft.budget_tokens(kv_tokens)
        self.draft = draft
        super().__init__(kv_tokens, max_batch=max_batch, prefill_chunk=prefill_chunk)
        self.stage = stage
        self.speculative = check_speculative(speculative)
        self.last_prefill_batch = 0  # prompts in the last step's padded prefill (0: none batched)
        self.prefix = PrefixCache() if prefix_cache else None

    def step(self) -> StepResult:
        result = StepResult()
        self._apply_cancels(result)
        self._admit(result)
        self._prefill(result)
        self._decode(result)
        return result

    def _start(self, session: Session) -> None:
        self._open(session)
        session.generator = make_generator(session.sampling, self.stage.output_device)

    def _finish(self, session: Session, reason: str | None, result: StepResult) -> None:
        if self.prefix is not None and session.cache is not None and session.error is None and reason != "error":
            self.prefix.insert(session.prompt_ids + session.output_ids, session.cache)
        super()._finish(session, reason, result)
        if self.draft is not None:
            self.draft.release(session.session_id)
        if self.prefix is not None:
            self.prefix.fit(self.budget.reserved, self.prefix_room)

    def stats(self) -> dict:
        stats = super().stats()
        if self.prefix is not None:
            stats.update(self.prefix.stats())
        if self.draft is not None:
            stats["draft_positions"] = self.draft.positions
        return stats

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
                token = sample_next(logits[None], [session])[0]
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
        tokens = sample_next(logits, batch)
        now = time.perf_counter()
        for session, token in zip(batch, tokens):
            session.prefilled = len(session.prompt_ids)
            self._accept(session, token, now, result)
        return len(batch) * max(len(s.prompt_ids) for s in batch)

    def _decode(self, result: StepResult) -> None:
        decoding = [s for s in self.sessions.values() if not s.prefilling]
        drafts = self._all_drafts(decoding) if self.speculative else {}
        batches = self._decode_batches(decoding)
        self.last_batches = [len(batch) for batch in batches]
        for batch in batches:
            if any(drafts.get(s.session_id) for s in batch):
                self._verify(batch, drafts, result)
                continue
            started = time.perf_counter()
            ids = torch.tensor([s.next_input for s in batch], device=self.stage.input_device)
            logits = self.stage.decode([s.cache for s in batch], ids)
            tokens = sample_next(logits, batch)
            now = time.perf_counter()
            for session, token in zip(batch, tokens):
                session.decode_s += now - started
                session.decode_steps += 1
                self._accept(session, token, now, result)

    def _all_drafts(self, decoding: list[Session]) -> dict[str, list[int]]:
        """Every decoding session's drafts for this pass: prompt lookup's, else the draft model's
        (all asked in one batch)."""
        drafts: dict[str, list[int]] = {}
        asks = []
        for session in decoding:
            limit = self._draft_limit(session)
            if limit <= 0:
                continue
            lookup = session.lookup
            lookup.extend(session.output_ids[len(lookup.ids) - len(session.prompt_ids):])
            found, run = lookup.draft_run(limit)
            if self.draft is None or (run >= LOOKUP_FIRST_RUN and len(found) == limit):
                drafts[session.session_id] = found
                session.model_drafting = False
            else:
                asks.append((session.session_id, lookup.ids, limit, session.stop_ids))
                session.model_drafting = True
        if asks:
            drafts.update(self.draft.propose(asks))
        return drafts

    def _draft_limit(self, session: Session) -> int:
        """How many tokens the session may draft this pass. At most the tokens its reply has left but
        one: a pass then never writes past the session's reservation (the reserved prompt plus
        max_tokens holds the positions of the pass in flight)."""
        if not session.spec_k or session.constraint is not None or not session.guard.allows():
            return 0  # a grammar's mask is computed for one position at a time: no drafts to check
        return min(session.guard.limit, session.max_new_tokens - len(session.output_ids) - 1)

    def _verify(self, batch: list[Session], drafts: dict[str, list[int]], result: StepResult) -> None:
        """One pass of ``[next_input, *drafts]`` for every session of the batch (sessions without
        drafts run their one position), then each cache cropped to the positions that stood."""
        started = time.perf_counter()
        inputs = [[s.next_input, *drafts.get(s.session_id, [])] for s in batch]
        lengths = [s.cache.length for s in batch]
        logits = self.stage.verify([s.cache for s in batch], inputs)
        gains = [verify_drafts(rows, ids[1:], s) for s, rows, ids in zip(batch, logits, inputs)]
        now = time.perf_counter()
        for session, ids, length, gained in zip(batch, inputs, lengths, gains):
            drafted = len(ids) - 1
            for i, (token, _) in enumerate(gained):
                if token in session.stop_ids:  # nothing after an end of turn counts
                    gained = gained[: i + 1]
                    break
            session.cache.crop_to(length + len(gained))  # the input and the drafts that stood
            session.decode_s += now - started
            session.decode_steps += 1
            if drafted:
                accepted = len(gained) - 1
                session.guard.record(drafted, accepted)
                session.spec_passes += 1
                session.spec_tokens += len(gained)
                session.spec_drafted += drafted
                session.spec_accepted += accepted
                if session.model_drafting:
                    session.spec_model_drafted += drafted
                    session.spec_model_accepted += accepted
            for token, logprob in gained:
                session.pending_logprob = logprob
                if self._accept(session, token, now, result):
                    break

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
        if self.stage.fused is not None:
            return True  # fused layers attend row by row in each session's own cache: no padded copy
        # a stage with recurrent layers pads its attention layers' keys only (RecurrentBatchedView), each of
        # which a budget token counts (kv_budget.bytes_per_token)
        layers = sum(self.stage.attends) if self.stage.recurrent is not None else len(self.stage.layers)
        copy_tokens = rows * (longest + 1) / max(1, layers)
        return copy_tokens <= self.budget.free + (self.prefill_chunk or 256)
