"""Admission by tokens: a session reserves its prompt plus max_new_tokens of the stage's KV budget until it ends."""

from __future__ import annotations

import threading


class ContextTooLong(ValueError):
    """A request needs more tokens than the whole budget holds, so it can never be admitted."""

    code = "context_too_long"

    def __init__(self, prompt_tokens: int, max_new_tokens: int, kv_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.needed = prompt_tokens + max_new_tokens
        self.kv_tokens = kv_tokens
        super().__init__(
            f"this conversation needs {self.needed:,} tokens ({prompt_tokens:,} in the prompt + "
            f"{max_new_tokens:,} max_tokens); the pool serving this model holds {kv_tokens:,}"
        )

    @property
    def data(self) -> dict:
        """The numbers, for an error frame's data."""
        return {"needed": self.needed, "prompt_tokens": self.prompt_tokens,
                "max_new_tokens": self.max_new_tokens, "kv_tokens": self.kv_tokens}


class AdmissionFailed(RuntimeError):
    """A session could not be given what it runs with (its cache, its sampling generator); it alone fails."""

    code = "admission_failed"


class TokenBudget:
    """The KV tokens a stage holds, and how many of them are reserved: the stage's one ledger.

    Safe from any thread: the stage's intake reserves on the bus thread, the scheduler admits and
    gives back on the engine's.
    """

    def __init__(self, kv_tokens: int) -> None:
        if kv_tokens < 1:
            raise ValueError(f"kv_tokens={kv_tokens} must be at least 1")
        self.kv_tokens = kv_tokens
        self.reserved = 0
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return self.kv_tokens - self.reserved

    def check(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The tokens a request would reserve; ContextTooLong when even an empty pool could not hold them."""
        needed = prompt_tokens + max_new_tokens
        if needed > self.kv_tokens:
            raise ContextTooLong(prompt_tokens, max_new_tokens, self.kv_tokens)
        return needed

    def try_reserve(self, tokens: int) -> bool:
        """Reserve ``tokens`` if they are free now; False (and nothing reserved) if not."""
        with self._lock:
            if tokens > self.kv_tokens - self.reserved:
                return False
            self.reserved += tokens
            return True

    def release(self, tokens: int) -> None:
        with self._lock:
            if tokens > self.reserved:
                raise RuntimeError(f"releasing {tokens} tokens with only {self.reserved} reserved")
            self.reserved -= tokens
