"""Incremental detokenization: emit text only once its bytes form whole characters; token texts for logprobs."""

from __future__ import annotations

from events.frames import TokenLogprob, TopLogprob

TEXTS_KEPT = 65536  # token texts remembered per stage


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


class TokenTexts:
    """A token id's text and UTF-8 bytes as logprobs show them (the token decoded alone, as vLLM does)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> tuple[str, list[int]]:
        known = self._texts.get(token_id)
        if known is None:
            if len(self._texts) >= TEXTS_KEPT:
                self._texts.clear()
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            known = self._texts[token_id] = (text, list(text.encode("utf-8")))
        return known

    def logprob(self, entry: tuple | None) -> TokenLogprob | None:
        """A sampler's (id, logprob, [(id, logprob), ...][, rank]) as the frame carries it (None stays None:
        a prompt's first position)."""
        if entry is None:
            return None
        token_id, logprob, best, *rank = entry
        text, utf8 = self.text(token_id)
        return TokenLogprob(text, logprob, utf8, [TopLogprob(*self._top(i, lp)) for i, lp in best], *rank)

    def _top(self, token_id: int, logprob: float) -> tuple[str, float, list[int], int]:
        text, utf8 = self.text(token_id)
        return text, logprob, utf8, token_id
