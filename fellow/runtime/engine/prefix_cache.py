"""Finished sessions' keys and values kept as reusable prompt prefixes, in blocks, inside the KV budget.

A chat client sends the whole conversation again every turn. When a session ends, the positions its
cache holds are cut into blocks of BLOCK tokens, each keyed by a hash chained through every block
before it (as vLLM's automatic prefix caching keys them), so a block stands for its whole prefix,
not just its own tokens. The last, partial block is kept too, as a leaf only an exact continuation
matches, so a turn that extends the previous one reuses every position of it.

A new session looks up the longest chain its prompt starts with (leaving at least its last token to
compute) and gets those positions copied into its own cache: attention reads one contiguous past per
session, so the copy costs a memory copy where the prefill would have cost a forward over every
layer. Blocks shared by many prompts (one system prompt) are held once.

Cached blocks count in the stage's token budget but never block admission: the engine evicts least
recently used leaves whenever a live session needs their room (``fit``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from fellow.runtime.model.kv_cache import KVCache

BLOCK = 16  # tokens a block holds


@dataclass(eq=False)
class Block:
    key: int  # the chained hash: this block's tokens and every block before it
    parent: int | None
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per device group of the cache: [layers, kv_heads, len(tokens), head_dim]
    values: list[torch.Tensor]
    children: int = field(default=0)

    @property
    def full(self) -> bool:
        return len(self.tokens) == BLOCK


def _chain(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class PrefixCache:
    """The blocks one stage keeps, least recently used first. One thread (the engine's) uses it."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        self.tokens = 0  # positions held, over all blocks
        self.lookups = 0
        self.hits = 0
        self.reused_tokens = 0
        self.prompt_tokens = 0  # over every lookup: the share of them reused is the token hit rate

    # --- reuse ------------------------------------------------------------------------------------

    def match(self, prompt: list[int]) -> list[Block]:
        """The chain of blocks the prompt starts with, longest first found (may run past the prompt's
        last token but one: ``fill`` copies only what it is told)."""
        chain: list[Block] = []
        parent: int | None = None
        start = 0
        while start + BLOCK <= len(prompt) - 1:
            tokens = tuple(prompt[start : start + BLOCK])
            block = self.blocks.get(_chain(parent, tokens))
            if block is None or block.tokens != tokens or block.parent != parent:  # a hash collision is a miss
                break
            chain.append(block)
            parent, start = block.key, start + BLOCK
        rest = prompt[start : len(prompt) - 1]
        if rest:  # a partial leaf: the previous turn's tail, if the prompt continues it exactly
            for size in range(min(BLOCK - 1, len(rest)), 0, -1):
                tokens = tuple(rest[:size])
                leaf = self.blocks.get(_chain(parent, tokens))
                if leaf is not None and not leaf.full and leaf.tokens == tokens and leaf.parent == parent:
                    chain.append(leaf)
                    break
        return chain

    def lookup(self, prompt: list[int]) -> tuple[int, list[Block]]:
        """(positions reused, their blocks) for a new session's prompt; counts toward the hit rate."""
        chain = self.match(prompt)
        reused = min(sum(len(b.tokens) for b in chain), len(prompt) - 1)
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        if reused:
            self.hits += 1
            self.reused_tokens += reused
            for block in chain:  # root first: the leaf ends most recent, the root (which has children) older
                self.blocks.move_to_end(block.key)
        return reused, chain

    def start(self, cache: KVCache, prompt: list[int]) -> int:
        """A new session's first positions from the cache: copies the longest cached prefix of its
        prompt (never its last token) into its empty ``cache``; returns how many positions that is."""
        reused, chain = self.lookup(prompt)
        if reused:
            self.fill(cache, chain, reused)
        return reused

    def take(self, cache: KVCache, ids: list[int]) -> bool:
        """Exactly the positions of ``ids`` into an empty ``cache``, as another stage of a ring decided
        to reuse them; False (the cache left empty) where this stage no longer holds them all."""
        chain = self.match(ids + [-1])  # match leaves the prompt's last token out: a stand-in for it
        if sum(len(b.tokens) for b in chain) < len(ids):
            return False
        for block in chain:
            self.blocks.move_to_end(block.key)
        self.fill(cache, chain, len(ids))
        return True

    def fit(self, reserved: int, kv_tokens: int) -> None:
        """Evict until the kept blocks and the live sessions' ``reserved`` positions fit ``kv_tokens``."""
        over = reserved + self.tokens - kv_tokens
        if over > 0:
            self.evict(over)

    @staticmethod
    def fill(cache: KVCache, chain: list[Block], positions: int) -> None:
        """Copy the chain's first ``positions`` positions into an empty cache and advance it past them."""
        if cache.length:
            raise ValueError("fill takes an empty cache")
        cache.reserve(positions)
        start = 0
        for block in chain:
            take = min(len(block.tokens), positions - start)
            if take <= 0:
                break
            for g in range(len(cache.groups)):
                cache.keys[g][:, :, start : start + take].copy_(block.keys[g][:, :, :take])
                cache.values[g][:, :, start : start + take].copy_(block.values[g][:, :, :take])
            start += take
        cache.advance(positions)

    # --- keeping ----------------------------------------------------------------------------------

    def insert(self, ids: list[int], cache: KVCache) -> int:
        """Keep the blocks of a cache whose positions hold ``ids`` (the first ``cache.length`` of them)
        that are not kept yet; returns how many positions were added."""
        ids = ids[: cache.length]
        parent: int | None = None
        added = 0
        for start in range(0, len(ids), BLOCK):
            tokens = tuple(ids[start : start + BLOCK])
            key = _chain(parent, tokens)
            block = self.blocks.get(key)
            if block is None:
                end = start + len(tokens)
                block = Block(key, parent, tokens,
                              [k[:, :, start:end].clone() for k in cache.keys],
                              [v[:, :, start:end].clone() for v in cache.values])
                self.blocks[key] = block
                if parent is not None:
                    self.blocks[parent].children += 1
                self.tokens += len(tokens)
                added += len(tokens)
            else:
                self.blocks.move_to_end(key)
            if not block.full:
                break
            parent = key
        return added

    def evict(self, tokens: int) -> int:
        """Drop least recently used leaves until ``tokens`` positions are freed (or none are left)."""
        freed = 0
        while freed < tokens and self.blocks:
            leaf = next(b for b in self.blocks.values() if b.children == 0)  # a leaf always exists
            del self.blocks[leaf.key]
            if leaf.parent is not None and leaf.parent in self.blocks:
                self.blocks[leaf.parent].children -= 1
            self.tokens -= len(leaf.tokens)
            freed += len(leaf.tokens)
        return freed

    def clear(self) -> None:
        self.evict(self.tokens)

    def stats(self) -> dict:
        return {"prefix_cached_tokens": self.tokens, "prefix_blocks": len(self.blocks),
                "prefix_lookups": self.lookups, "prefix_hits": self.hits,
                "prefix_hit_rate": round(self.reused_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0}
