"""Incremental detokenization: emit text only once its bytes form whole characters."""

from __future__ import annotations


class Detokenizer:
    """Decodes a growing id list a few tokens at a time (the vLLM / TGI offset scheme), so a
    multi-byte character split over tokens comes out whole, and spaces between tokens survive."""

    def __init__(self, tokenizer, prompt_tail: list[int] | None = None):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_tail or [])[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=False)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=False)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """What is left at the end (possibly an incomplete character, shown as decoded)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=False)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=False)
        self.read_offset = len(self.ids)
        new = full[len(prefix):]
        self.text += new
        return new
