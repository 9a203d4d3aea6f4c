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
- every other path (prefill pieces, verify passes, the prefix cache, crops) reads and writes the
  cache as before: it is a cache like any other, whose buffers live in the slab.

The slab follows the batch. A session that joins (or a step that needs more room than the slab has)
rebuilds it: every session of the step copies its past in once, and a session of the old slab that
is still alive but not in the step gets its own buffers back. A session that leaves only frees its row
(``KVCache.release`` tells the slab); the slab goes when its last row does, so an idle stage holds no
slab. The slab is used only where it costs little memory over the sessions' own caches
(``MEMORY_SLACK``); a batch of very uneven pasts attends row by row, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fellow.runtime.model.kv_cache import GROW_CHUNK, KVCache

HEADROOM = GROW_CHUNK  # positions past the longest row a new slab leaves: a rebuild every 64 steps at most
MEMORY_SLACK = 1.5  # a slab may hold up to this times the positions the rows' own caches would
DEAD_ROWS = 2  # rebuild (rather than attend over rows not stepping) once the slab has over twice the step's rows


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

    def step(self, caches: Sequence[KVCache]) -> "SlabStep | None":
        """Ready a decode step of ``caches`` (each with room for one more position): their rows, where
        each writes, and the masks. None: this step attends row by row (the slab is then dropped)."""
        if len(caches) < 2 or not all(type(c) is KVCache and len(c.groups) == 1 for c in caches):
            return None
        rows = self._rows_of(caches)
        if rows is None:
            if not self._fits(caches):
                self.drop()
                return None
            rows = self._rebuild(caches)
        return SlabStep(self, caches, rows)

    def _rows_of(self, caches: Sequence[KVCache]) -> list[int] | None:
        """Each cache's row, where every one of them is in the slab with room for this step."""
        if self.keys is None or len(self.rows) > DEAD_ROWS * len(caches):
            return None
        rows = []
        for cache in caches:
            home = cache.home
            if home is None or home[0] is not self or cache.length + 1 > self.capacity:
                return None
            rows.append(home[1])
        return rows

    def _fits(self, caches: Sequence[KVCache]) -> bool:
        """Whether a slab for these caches holds at most MEMORY_SLACK times the positions of their own
        caches (plus a chunk each: a short past may always use one)."""
        own = sum(-(-(c.length + 1) // GROW_CHUNK) * GROW_CHUNK for c in caches)
        return len(caches) * self._capacity_for(caches) <= MEMORY_SLACK * own + len(caches) * GROW_CHUNK

    @staticmethod
    def _capacity_for(caches: Sequence[KVCache]) -> int:
        return -(-(max(c.length for c in caches) + 1 + HEADROOM) // GROW_CHUNK) * GROW_CHUNK

    # --- building and dropping ----------------------------------------------------------------------

    def _rebuild(self, caches: Sequence[KVCache]) -> list[int]:
        """A new slab with a row per cache, in order: each copies its past in and takes its row as its
        buffers. A live session of the old slab left out of this step gets buffers of its own."""
        first = caches[0]
        capacity = self._capacity_for(caches)
        shape = (first.num_layers, len(caches), first.num_kv_heads, capacity, first.head_dim)
        device = first.groups[0][2]
        # zeros: a freed row's first position is what its masked row attends to, and stays finite
        keys = torch.zeros(shape, dtype=first.dtype, device=device)
        values = torch.zeros(shape, dtype=first.dtype, device=device)
        stepping = {id(c) for c in caches}
        for cache in self.rows:
            if cache is not None and id(cache) not in stepping:
                _own_buffers(cache)
        for row, cache in enumerate(caches):
            if cache.length:
                keys[:, row, :, : cache.length].copy_(cache.keys[0][:, :, : cache.length])
                values[:, row, :, : cache.length].copy_(cache.values[0][:, :, : cache.length])
            cache.keys, cache.values = [keys[:, row]], [values[:, row]]
            cache.capacity, cache.home = capacity, (self, row)
        self.keys, self.values, self.capacity = keys, values, capacity
        self.rows = list(caches)
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
    """One decode step's use of the slab: ``attend`` is what ``FusedStack.attend_decode`` calls per layer."""

    def __init__(self, slab: DecodeSlab, caches: Sequence[KVCache], rows: list[int]) -> None:
        self.keys, self.values = slab.keys, slab.values
        self.first_layer = slab.first_layer
        self.windows = slab.windows
        slots = len(slab.rows)
        self.batch = len(caches)
        self.identity = rows == list(range(slots))  # the step is the slab, row for row: no scatter
        self.slots = slots
        lengths = [c.length for c in caches]
        self.rows = torch.tensor(rows)
        self.at = torch.tensor(lengths)  # where each session writes its new position
        self.width = max(lengths) + 1
        per_slot = [0] * slots  # a freed row (or one not stepping) sees its first position only
        for row, length in zip(rows, lengths):
            per_slot[row] = length
        self.masks: dict[int | None, torch.Tensor | None] = {}
        even = self.identity and len(set(lengths)) == 1
        seen_to = torch.tensor(per_slot)[:, None]
        columns = torch.arange(self.width)[None, :]
        for window in set(self.windows.values()):
            if even and (window is None or window >= self.width):
                self.masks[window] = None
                continue
            visible = columns <= seen_to
            if window is not None:
                visible &= columns > seen_to - window
            mask = torch.zeros(slots, 1, 1, self.width, dtype=slab.keys.dtype, device=slab.keys.device)
            self.masks[window] = mask.masked_fill_(~visible[:, None, None].to(mask.device), float("-inf"))

    def attend(self, layer_idx: int, scaling: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out_shape: tuple[int, ...]) -> torch.Tensor:
        """q [B, heads, 1, D], k and v [B, kv_heads, 1, D] -> [B, 1, heads * D]."""
        slot = layer_idx - self.first_layer
        keys, values = self.keys[slot], self.values[slot]  # [rows, kv_heads, capacity, D]
        keys[self.rows, :, self.at] = k[:, :, 0]
        values[self.rows, :, self.at] = v[:, :, 0]
        batch, kv_heads, head_dim = self.batch, keys.shape[1], keys.shape[3]
        queries = q.reshape(batch, kv_heads, -1, head_dim)
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
