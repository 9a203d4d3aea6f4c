"""The draft model's fixed-shape decoder (the spec's TS9): its single-token greedy steps captured as
CUDA graphs.

A draft model's decode step is small: on a GPU its time goes to launching kernels, not running
them. ``FixedDecoder`` keeps everything a step touches at a fixed address: static token and
position inputs, static argmax ids and logits out, and one static KV pool of ``slots`` sessions x
``positions`` positions (plus a scratch column) that every slot's ``SlotCache`` is a view of. A
step for slots [0, n) is one captured graph per slot count bucket (1, 2, 4, ... ``slots``): it
embeds the tokens, writes each row's new keys and values at its position in the pool, attends
under a mask of the columns up to that position, and writes the argmax ids. Rows of free or
resting slots write to the scratch column and are not read.

The catch-up before the steps (``DraftModel.propose``: cropping, the unseen tokens as one piece)
runs eagerly through the stage's own forward, writing into the same pool through the slot's
``SlotCache``; only the one-token steps replay graphs.

``fixed_decoder`` builds it at load: captured, then one step checked against the eager step on the
same inputs (the same argmax ids, logits close). Where the device is not CUDA, or the capture or
the check fails, it returns None and why, and the draft model steps eagerly (``stage.decode``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from fellow.runtime.model.kv_cache import KVCache
from fellow.runtime.model.stage import CUDA_SDPA_BACKENDS, StageModel
from fellow.runtime.steps.protocol import StepReport

log = logging.getLogger("swarm.draft")

GRAPH_POSITIONS = 4096  # a slot's positions; a session whose sequence and drafts need more steps eagerly
CHECK_PROMPT = 7  # positions the load's check runs before its step (each row one more than the last)
EAGER = "eager"
CUDA_GRAPH = "cuda-graph"

Step = Callable[[], None]
Capture = Callable[[Step], Step]  # a step -> what replays it; raises when it cannot be captured


def capture_cuda_graph(step: Step, pool=None) -> Step:
    """``step`` captured as a CUDA graph, warmed up on a side stream first (as PyTorch's CUDA graph
    notes do); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph.replay


def _buckets(slots: int) -> list[int]:
    sizes, n = [], 1
    while n < slots:
        sizes.append(n)
        n *= 2
    return sizes + [slots]


class SlotCache(KVCache):
    """A session's draft cache in one slot of the decoder's static pool: fixed capacity, no growth;
    ``release`` hands the slot back."""

    def __init__(self, decoder: "FixedDecoder", slot: int) -> None:
        stage = decoder.stage
        super().__init__(stage.first_layer, len(stage.layers), stage.num_kv_heads, stage.head_dim, stage.dtype,
                         stage.layer_devices)
        self.decoder, self.slot = decoder, slot
        self.keys, self.values = [decoder.keys[slot]], [decoder.values[slot]]  # [L, H_kv, width, D]
        self.capacity = decoder.positions

    def reserve(self, positions: int) -> None:
        if self.length + positions > self.capacity:
            raise RuntimeError(f"a draft slot holds {self.capacity} positions, {self.length + positions} asked")

    def release(self) -> None:
        if self.decoder is not None:
            self.decoder.free.add(self.slot)
            self.decoder = None
        self.length = 0


class FixedDecoder:
    """Static buffers and one step per slot count bucket for a whole draft stage on one device
    (the target stage's own decode uses it too: fellow.runtime.model.forms.cuda_graphs)."""

    cache_class: type[SlotCache] = SlotCache  # what ``take`` hands out

    def __init__(self, stage: StageModel, slots: int, positions: int) -> None:
        if not (stage.is_first and stage.is_last):
            raise ValueError("the fixed-shape decoder runs a whole model")
        if len(set(stage.layer_devices)) != 1 or stage.layer_devices[0] != stage.input_device:
            raise ValueError("the fixed-shape decoder runs a model on one device")
        if slots < 1 or positions < 2:
            raise ValueError(f"{slots} slots of {positions} positions")
        self.stage, self.slots, self.positions = stage, slots, positions
        device, dtype = stage.input_device, stage.dtype
        with torch.inference_mode():
            # the positions, a scratch column at ``positions``, and columns never seen up to a multiple of
            # 16: memory-efficient attention wants the mask's rows aligned
            self.width = -(-(positions + 1) // 16) * 16
            shape = (slots, len(stage.layers), stage.num_kv_heads, self.width, stage.head_dim)
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
            self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
            self.where = torch.full((slots,), positions, dtype=torch.long, device=device)  # scratch: positions
            self.ids = torch.zeros(slots, dtype=torch.long, device=device)
            self.logits = torch.zeros(slots, stage.config.vocab_size, dtype=torch.float32, device=device)
            self.rows = torch.arange(slots, device=device)
            self.columns = torch.arange(self.width, device=device)
        self.free = set(range(slots))  # ``take`` gives the lowest: the graphs run slots [0, n)
        self.buckets = _buckets(slots)
        self.replays: dict[int, Step] = {}
        self.label = EAGER

    @property
    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def take(self, needed: int) -> SlotCache | None:
        """A free slot for a session whose positions reach ``needed``; None when none is free or it needs more."""
        if needed > self.positions or not self.free:
            return None
        slot = min(self.free)
        self.free.discard(slot)
        return self.cache_class(self, slot)

    # --- the step -----------------------------------------------------------------------------------

    def _step(self, n: int) -> None:
        """Slots [0, n): the token at ``tokens[s]`` at position ``where[s]``; argmax into ``ids[s]``."""
        stage = self.stage
        tokens, where, rows = self.tokens[:n], self.where[:n], self.rows[:n]
        hidden = stage.embed(tokens.view(n, 1))
        position_ids = where.view(n, 1)
        masks = {}  # by window (None: full attention), as the stage's layers have them
        for window in set(stage.layer_windows):
            hidden_cols = self.columns[None, :] > where[:, None]  # [n, width]: after the position
            if window is not None:  # and before the last ``window`` positions
                hidden_cols |= self.columns[None, :] <= where[:, None] - window
            mask = torch.zeros(n, 1, 1, self.width, dtype=hidden.dtype, device=hidden.device)
            masks[window] = mask.masked_fill_(hidden_cols[:, None, None, :], torch.finfo(hidden.dtype).min)

        def store(slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.keys[:n, slot], self.values[:n, slot]  # [n, H_kv, width, D]
            keys[rows, :, where] = k[:, :, 0]
            values[rows, :, where] = v[:, :, 0]
            return keys, values

        if stage.fused is not None:
            groups = stage.fused.groups

            def attend(layer, q, k, v):
                slot = layer.layer_idx - stage.first_layer
                keys, values = store(slot, k, v)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[stage.layer_windows[slot]],
                                                     scale=layer.scaling,
                                                     enable_gqa=groups > 1)
                return out.transpose(1, 2).reshape(n, 1, -1)
            hidden = stage.run_fused(hidden, position_ids, attend)
        else:
            view = _StaticView(store, stage.first_layer, self.width - 1)
            if hidden.device.type == "cuda":
                with torch.nn.attention.sdpa_kernel(CUDA_SDPA_BACKENDS):
                    hidden = stage._run_layers(hidden, position_ids, masks, view)
            else:
                hidden = stage._run_layers(hidden, position_ids, masks, view)
        logits = stage.head(stage.norm(hidden[:, -1]))
        self.logits[:n].copy_(logits)
        self.ids[:n].copy_(logits.argmax(dim=-1))

    @torch.inference_mode()
    def capture(self, capture: Capture) -> None:
        """One replay per bucket, the largest first, every row at the scratch column while capturing."""
        self.where.fill_(self.positions)
        self.tokens.zero_()
        for n in reversed(self.buckets):
            self.replays[n] = capture(lambda n=n: self._step(n))

    @torch.inference_mode()
    def step(self, caches: list[SlotCache], tokens: list[int]) -> list[int]:
        """One greedy step for sessions in slots: each cache's next position; their argmax ids."""
        n = self._replay(caches, torch.tensor(tokens))
        out = self.ids[:n].tolist()
        return [out[cache.slot] for cache in caches]

    @torch.inference_mode()
    def step_logits(self, caches: Sequence[SlotCache], tokens: torch.Tensor) -> torch.Tensor:
        """One step for sessions in slots, ``tokens`` [B] (on any device): their logits [B, V] in the
        stage's dtype, rows in the order of ``caches``."""
        return self.step_rows(caches, tokens).to(self.stage.dtype)

    def step_rows(self, caches: Sequence[SlotCache], tokens: torch.Tensor) -> torch.Tensor:
        """``step_logits``' rows as the step wrote them (float32): what its argmax ids were taken from."""
        self._replay(caches, tokens)
        rows = torch.tensor([cache.slot for cache in caches], device=self.logits.device)
        return self.logits.index_select(0, rows)

    def _replay(self, caches: Sequence[SlotCache], tokens: torch.Tensor) -> int:
        """Each cache's next token at its next position in its slot, the other slots of the bucket at the
        scratch column; replays the bucket's step and advances the caches. Returns the bucket."""
        top = max(cache.slot for cache in caches) + 1
        n = next(b for b in self.buckets if b >= top)
        where = [self.positions] * n
        for cache in caches:
            if cache.length >= self.positions:
                raise RuntimeError(f"slot {cache.slot} is full ({self.positions} positions)")
            where[cache.slot] = cache.length
        slots = torch.tensor([cache.slot for cache in caches], device=self.tokens.device)
        self.where[:n].copy_(torch.tensor(where), non_blocking=True)
        self.tokens[:n].zero_()
        self.tokens.index_copy_(0, slots, tokens.reshape(-1).to(self.tokens.device, torch.long))
        self.replays[n]()
        for cache in caches:
            cache.advance(1)
        return n

    @torch.inference_mode()
    def check(self) -> None:
        """One replayed step of every bucket against ``stage.decode`` on the same sequences (each row a
        prompt one longer than the last); raises when the ids differ or the logits are not close."""
        for n in self.buckets:
            self._check(n)

    def _check(self, n: int) -> None:
        stage = self.stage
        generator = torch.Generator().manual_seed(n)
        vocab = stage.config.vocab_size
        prompts = [torch.randint(vocab, (CHECK_PROMPT + row,), generator=generator).tolist() for row in range(n)]
        prompts = [p[: self.positions - 1] for p in prompts]
        last = torch.randint(vocab, (n,), generator=generator).tolist()
        slotted = [self.take(len(p) + 1) for p in prompts]
        eager = [stage.new_cache() for _ in prompts]
        try:
            for slot, cache, prompt in zip(slotted, eager, prompts):
                ids = torch.tensor(prompt, device=stage.input_device)
                stage.prefill(slot, ids)
                stage.prefill(cache, ids)
            got = self.step(slotted, last)
            got_logits = self.logits[[s.slot for s in slotted]].clone()
            want_logits = stage.decode(eager, torch.tensor(last, device=stage.input_device)).float()
        finally:
            for cache in slotted + eager:
                cache.release()
        want = want_logits.argmax(dim=-1).tolist()
        if got != want:
            raise RuntimeError(f"the replayed step's ids {got} are not the eager step's {want}")
        scale = float(want_logits.abs().max())
        tolerance = (1e-3 if stage.dtype == torch.float32 else 3e-2) * max(scale, 1.0)
        error = float((got_logits - want_logits).abs().max())
        if error > tolerance:
            raise RuntimeError(f"the replayed step's logits are {error:.3g} from the eager step's "
                               f"(tolerance {tolerance:.3g})")


class FixedStep:
    """The draft model's fixed-shape decoder as a form of its stage's decode step (``steps.DecodeStep``): it
    serves a step whose sessions all hold a slot of it (``forms/plan_steps.plan_draft_steps`` puts it in the
    draft stage's table); a session with a cache of its own steps eagerly. Its logits are the float32 rows the
    replay wrote. A step that raises advanced nothing (``_replay`` advances the caches after the replay); the
    form then gives up and the eager form serves that step and every one after."""

    name = "fixed_decoder"

    def __init__(self, decoder: FixedDecoder) -> None:
        self.decoder, self.steps, self.given_up = decoder, 0, ""

    def takes(self, caches: Sequence) -> bool:
        return not self.given_up and bool(caches) and all(
            isinstance(c, SlotCache) and c.decoder is self.decoder for c in caches)

    def decode(self, caches: Sequence, inputs: torch.Tensor) -> torch.Tensor:
        logits = self.decoder.step_rows(caches, inputs)
        self.steps += 1
        return logits

    def take(self) -> None:
        """No slot for ``StageModel.new_cache``: the draft model hands its slots out itself, to sessions whose
        positions fit one (``DraftModel._new_cache``)."""
        return None

    def give_up(self, caches: Sequence, exc: Exception) -> None:
        self.given_up = f"{type(exc).__name__}: {exc}"
        log.warning("draft decoder: %s from now on, a replayed step failed: %s", EAGER, self.given_up)

    def report(self) -> StepReport:
        return StepReport(form=self.name, steps=self.steps, batches=list(self.decoder.buckets),
                          given_up=self.given_up)


class _StaticView:
    """The cache an HF attention layer sees in a fixed-shape step: the pool's columns, written at each row's
    position."""

    def __init__(self, store, first_layer: int, positions: int) -> None:
        self.store, self.first_layer, self.positions = store, first_layer, positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.store(layer_idx - self.first_layer, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.positions


def fixed_decoder(stage: StageModel, *, slots: int, positions: int = GRAPH_POSITIONS,
                  capture: Capture | None = None, label: str = CUDA_GRAPH) -> tuple[FixedDecoder | None, str]:
    """The draft model's fixed-shape decoder and what its steps run as (``label``), or None and
    ``eager (why)``. ``capture`` defaults to ``capture_cuda_graph`` on a CUDA stage; elsewhere the
    steps are eager. One line in the log names the choice."""
    device = stage.input_device
    if capture is None:
        if device.type != "cuda":
            log.info("draft decoder: %s (the draft model is on %s)", EAGER, device.type)
            return None, EAGER
        pool = torch.cuda.graph_pool_handle()  # shared: each step's outputs are copied to static buffers
        capture = lambda step: capture_cuda_graph(step, pool)  # noqa: E731
    positions = min(positions, getattr(stage.config, "max_position_embeddings", positions) or positions)
    try:
        decoder = FixedDecoder(stage, slots, positions)
        decoder.capture(capture)
    except Exception as exc:  # noqa: BLE001 (any failure to capture means eager steps)
        log.warning("draft decoder: %s, the capture failed: %s: %s", EAGER, type(exc).__name__, exc)
        return None, f"{EAGER} (capture failed)"
    try:
        decoder.check()
    except Exception as exc:  # noqa: BLE001
        log.warning("draft decoder: %s, the captured step does not match the eager step: %s: %s", EAGER,
                    type(exc).__name__, exc)
        return None, f"{EAGER} (check failed)"
    decoder.label = label
    log.info("draft decoder: %s (%d slots of %d positions, %d captured steps, %d bytes of static KV)", label, slots,
             positions, len(decoder.replays), decoder.bytes)
    return decoder, label
