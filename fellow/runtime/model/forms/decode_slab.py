"""A decode batch's keys and values side by side, kept across steps, so a layer attends in one call.

Each session's ``KVCache`` holds its own buffers, so a fused decode step over B sessions used to make,
per layer, B cache writes and B attention calls on one query each: for small models and short pasts
that loop, not the arithmetic, was the step (llama-deep, 16 layers of hidden 256, 8 rows: about
1,300 slices and 450 copies a step). The slab puts the batch's sessions in one buffer pair per
device, ``[layers, rows, kv_heads, capacity, D]``, and each session's cache *is* its row of it (a
view), so:

- a step writes every session's new position with one indexed copy per layer, and attends with one
  ``scaled_dot_product_attention`` over ``[rows, kv_heads, width, D]``, a mask hiding each row's
  positions past its own length (and before its window, for a sliding layer);
- a verify pass of two sessions or more (each its last token and its drafts) does the same, each
  session's queries in its row, padded to the widest session's width and masked causally;
- every other path (prefill pieces, the prefix cache, crops) reads and writes the cache as before:
  it is a cache like any other, whose buffers live in the slab.

The slab follows the batch. A session that joins (or a step that needs more room than the slab has)
rebuilds it: every session of the step copies its past in once. A session of the old slab that is
still alive but not in the step keeps a row after the step's where the whole still fits, else gets
its own buffers back; so sessions that decode in several batches (more of them than the batch cap)
share one slab, each batch a block of rows, and a step attends over its block only. A session that
leaves only frees its row (``KVCache.release`` tells the slab); the slab goes when its last row
does, so an idle stage holds no slab. The slab is used only where it costs little memory over the sessions' own caches
(``MEMORY_SLACK``); a batch of very uneven pasts attends row by row, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fellow.runtime.model.kv_cache import GROW_CHUNK, KVCache

HEADROOM = GROW_CHUNK  # positions past the longest row a new slab leaves: a rebuild every 64 steps at most
MEMORY_SLACK = 1.5  # a slab may hold up to this times the positions the rows' own caches would
KEEP_LEFT_OUT = True  # False: a rebuild gives the sessions it leaves out buffers of their own (bench_split's "before")
DEAD_ROWS = 2  # rebuild (rather than attend over rows not stepping) once a step's rows span over twice as many


class DecodeSlab:
    """One stage's slab (see the module's doc). ``step(caches)`` readies a decode step; None where the
    step attends row by row instead."""

    def __init__(self, first_layer: int, windows: dict[int, int | None]) -> None:
        self.first_layer = first_layer
        self.windows = windows  # absolute layer index -> its window (None: full attention)
        self.keys: torch.Tensor | None = None  # [layers, rows, kv_heads, capacity, D]
        self.values: torch.Tensor | None = None
        self.rows: list[KVCache | None] = []
        self.capacity = 0
        self.rebuilds = 0

    # --- a step -------------------------------------------------------------------------------------

    def step(self, caches: Sequence[KVCache], widths: Sequence[int] | None = None) -> "SlabStep | None":
        """Ready a step of ``caches`` (each with room for its new positions): their rows, where each
        writes, and the masks. ``widths``: how many new positions each session runs (a verify pass:
        its last token and its drafts); one each when None (a decode step). None: this step attends
        row by row (the slab is then dropped)."""
        if len(caches) < 2 or not all(type(c) is KVCache and len(c.groups) == 1 for c in caches):
            return None
        packed = widths is not None
        widths = list(widths) if packed else [1] * len(caches)
        rows = self._rows_of(caches, widths)
        if rows is None:
            if not self._fits(caches, widths):
                self.drop()
                return None
            rows = self._rebuild(caches, widths)
        return SlabStep(self, caches, rows, widths, packed)

    def _rows_of(self, caches: Sequence[KVCache], widths: Sequence[int]) -> list[int] | None:
        """Each cache's row, where every one of them is in the slab with room for this step, and the
        block of rows they span holds at most DEAD_ROWS times the step's rows (the step attends over
        that block)."""
        if self.keys is None:
            return None
        rows = []
        for cache, width in zip(caches, widths):
            home = cache.home
            if home is None or home[0] is not self or cache.length + width > self.capacity:
                return None
            rows.append(home[1])
        if max(rows) - min(rows) + 1 > DEAD_ROWS * len(caches):
            return None
        return rows

    def _fits(self, caches: Sequence[KVCache], widths: Sequence[int]) -> bool:
        """Whether a slab for these caches holds at most MEMORY_SLACK times the positions of their own
        caches (plus a chunk each: a short past may always use one)."""
        own = sum(-(-(c.length + w) // GROW_CHUNK) * GROW_CHUNK for c, w in zip(caches, widths))
        return len(caches) * self._capacity_for(caches, widths) <= MEMORY_SLACK * own + len(caches) * GROW_CHUNK

    @staticmethod
    def _capacity_for(caches: Sequence[KVCache], widths: Sequence[int]) -> int:
        needed = max(c.length + w for c, w in zip(caches, widths))
        return -(-(needed + HEADROOM) // GROW_CHUNK) * GROW_CHUNK

    # --- building and dropping ----------------------------------------------------------------------

    def _rebuild(self, caches: Sequence[KVCache], widths: Sequence[int]) -> list[int]:
        """A new slab with a row per cache, in order: each copies its past in and takes its row as its
        buffers. The live sessions of the old slab that this step leaves out keep rows after the
        step's, where the whole fits (MEMORY_SLACK): a stage whose sessions run in several batches
        (more sessions than its batch cap) then keeps them all in one slab, each batch a block of rows,
        instead of rebuilding it for every batch of every step. Where it does not fit, they get buffers
        of their own."""
        stepping = {id(c) for c in caches}
        left_out = [c for c in self.rows if c is not None and id(c) not in stepping]
        idle = left_out if KEEP_LEFT_OUT else []
        kept = [*caches, *idle]
        kept_widths = [*widths, *[1] * len(idle)]
        if idle and not self._fits(kept, kept_widths):
            kept, kept_widths = list(caches), list(widths)
        first = caches[0]
        capacity = self._capacity_for(kept, kept_widths)
        shape = (first.num_layers, len(kept), first.num_kv_heads, capacity, first.head_dim)
        device = first.groups[0][2]
        # zeros: a freed row's first position is what its masked row attends to, and stays finite
        keys = torch.zeros(shape, dtype=first.dtype, device=device)
        values = torch.zeros(shape, dtype=first.dtype, device=device)
        staying = {id(c) for c in kept}
        for cache in left_out:
            if id(cache) not in staying:
                _own_buffers(cache)
        for row, cache in enumerate(kept):
            if cache.length:
                keys[:, row, :, : cache.length].copy_(cache.keys[0][:, :, : cache.length])
                values[:, row, :, : cache.length].copy_(cache.values[0][:, :, : cache.length])
            cache.keys, cache.values = [keys[:, row]], [values[:, row]]
            cache.capacity, cache.home = capacity, (self, row)
        self.keys, self.values, self.capacity = keys, values, capacity
        self.rows = kept
        self.rebuilds += 1
        return list(range(len(caches)))

    def forget(self, row: int) -> None:
        """A row's session left (released its cache, or grew it into buffers of its own)."""
        if row < len(self.rows):
            self.rows[row] = None
        if not any(cache is not None for cache in self.rows):
            self.keys = self.values = None
            self.rows, self.capacity = [], 0

    def drop(self) -> None:
        """Give every live row's session its own buffers back and free the slab."""
        for cache in self.rows:
            if cache is not None:
                _own_buffers(cache)
        self.keys = self.values = None
        self.rows, self.capacity = [], 0


def _own_buffers(cache: KVCache) -> None:
    """Move a cache out of its slab row into buffers of its own, with room for one more position (a
    decode step reserved it before the slab was asked): ``KVCache.reserve`` grows it out of a full
    buffer, copying its past and telling the slab its row is free."""
    cache.capacity = 0
    cache.reserve(1)


class SlabStep:
    """One step's use of the slab: ``attend`` is what ``FusedStack.attend_decode`` (one new position per
    row, q [B, heads, 1, D]) and ``FusedStack.attend_packed`` (a verify pass: each session's positions
    packed in one row, q [1, heads, sum(widths), D]) call per layer.

    A verify pass's queries go into the slab's rows padded to the widest session's width; a padded
    query attends like the session's last real one would a position later, and its output is dropped.
    """

    def __init__(self, slab: DecodeSlab, caches: Sequence[KVCache], rows: list[int], widths: Sequence[int],
                 packed: bool = False) -> None:
        # the block of rows the step's sessions span: it attends over that block only (a view)
        low, high = min(rows), max(rows) + 1
        self.keys, self.values = slab.keys[:, low:high], slab.values[:, low:high]
        rows = [row - low for row in rows]
        self.first_layer = slab.first_layer
        self.windows = slab.windows
        slots = high - low
        self.batch = len(caches)
        self.identity = rows == list(range(slots))  # the step is the slab, row for row: no scatter
        self.slots = slots
        lengths = [c.length for c in caches]
        self.span = max(widths)  # the queries per row: 1 for a decode step
        self.packed = packed  # a verify pass: q holds every session's positions in one row
        if not packed:
            self.rows = torch.tensor(rows)
            self.at = torch.tensor(lengths)  # where each session writes its new position
        else:  # per packed position: its session's row, its place among that session's queries, where it writes
            self.rows = torch.tensor([row for row, width in zip(rows, widths) for _ in range(width)])
            self.offsets = torch.tensor([j for width in widths for j in range(width)])
            self.at = torch.tensor([length + j for length, width in zip(lengths, widths) for j in range(width)])
        self.width = max(length + width for length, width in zip(lengths, widths))
        per_slot = [0] * slots  # a freed row (or one not stepping) sees its first positions only
        for row, length in zip(rows, lengths):
            per_slot[row] = length
        self.masks: dict[int | None, torch.Tensor | None] = {}
        self.repeated: dict[int | None, torch.Tensor] = {}  # by window: a verify pass's masks, per query group
        even = not packed and self.identity and len(set(lengths)) == 1
        # query j of a row is at position length + j, and sees every position up to it
        seen_to = torch.tensor(per_slot)[:, None, None] + torch.arange(self.span)[None, :, None]
        columns = torch.arange(self.width)[None, None, :]
        for window in set(self.windows.values()):
            if even and (window is None or window >= self.width):
                self.masks[window] = None
                continue
            visible = columns <= seen_to  # [slots, span, width]
            if window is not None:
                visible &= columns > seen_to - window
            mask = torch.zeros(slots, 1, self.span, self.width, dtype=slab.keys.dtype, device=slab.keys.device)
            self.masks[window] = mask.masked_fill_(~visible[:, None].to(mask.device), float("-inf"))

    def attend(self, layer_idx: int, scaling: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out_shape: tuple[int, ...]) -> torch.Tensor:
        """A decode step's q [B, heads, 1, D], k and v [B, kv_heads, 1, D] -> [B, 1, heads * D]; a verify
        pass's q [1, heads, total, D], k and v [1, kv_heads, total, D] -> [1, total, heads * D]."""
        slot = layer_idx - self.first_layer
        keys, values = self.keys[slot], self.values[slot]  # [rows, kv_heads, capacity, D]
        kv_heads, head_dim = keys.shape[1], keys.shape[3]
        if self.packed:
            return self._attend_packed(keys, values, scaling, q, k, v, self.windows[layer_idx], out_shape)
        keys[self.rows, :, self.at] = k[:, :, 0]
        values[self.rows, :, self.at] = v[:, :, 0]
        queries = q.reshape(self.batch, kv_heads, -1, head_dim)
        if not self.identity:
            full = queries.new_zeros(self.slots, *queries.shape[1:])
            full[self.rows] = queries
            queries = full
        out = torch.nn.functional.scaled_dot_product_attention(
            queries, keys[:, :, : self.width], values[:, :, : self.width],
            attn_mask=self.masks[self.windows[layer_idx]], scale=scaling)
        if not self.identity:
            out = out[self.rows]
        return out.reshape(out_shape)

    def _attend_packed(self, keys, values, scaling, q, k, v, window, out_shape) -> torch.Tensor:
        heads, kv_heads, head_dim = q.shape[1], keys.shape[1], keys.shape[3]
        groups = heads // kv_heads
        keys[self.rows, :, self.at] = k[0].transpose(0, 1)  # [total, kv_heads, D]
        values[self.rows, :, self.at] = v[0].transpose(0, 1)
        queries = q.new_zeros(self.slots, heads, self.span, head_dim)
        queries[self.rows, :, self.offsets] = q[0].transpose(0, 1)  # [total, heads, D]
        # the query heads that share a key/value head go in as its queries: [slots, kv_heads, groups * span, D]
        queries = queries.view(self.slots, kv_heads, groups * self.span, head_dim)
        mask = self.masks[window]
        if mask is not None and groups > 1:  # each group's queries see what the row's do (once per step)
            if window not in self.repeated:
                self.repeated[window] = mask.repeat(1, 1, groups, 1)
            mask = self.repeated[window]
        out = torch.nn.functional.scaled_dot_product_attention(
            queries, keys[:, :, : self.width], values[:, :, : self.width], attn_mask=mask, scale=scaling)
        out = out.view(self.slots, heads, self.span, head_dim)[self.rows, :, self.offsets]  # [total, heads, D]
        return out.reshape(out_shape)
