"""The KV token ledger of a stage: who holds how many of its tokens. Written by the scheduler alone."""

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
    """The KV tokens a stage holds, and which session holds how many of them: the stage's one ledger.

    Holdings are keyed by session id, so a session's tokens go back exactly once and in the amount it
    took. Safe from any thread (the stage's intake offers on the bus thread, the scheduler admits and
    gives back on the engine's); only fellow.runtime.engine.scheduler calls ``reserve``, ``release``
    and ``resize`` (tests/test_stage_core.py checks the tree for other writers).
    """

    def __init__(self, kv_tokens: int) -> None:
        if kv_tokens < 1:
            raise ValueError(f"kv_tokens={kv_tokens} must be at least 1")
        self._kv_tokens = kv_tokens
        self._held: dict[str, int] = {}
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def kv_tokens(self) -> int:
        return self._kv_tokens

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def free(self) -> int:
        return self._kv_tokens - self._reserved

    def holds(self, key: str) -> int:
        """The tokens ``key`` holds (0: none)."""
        return self._held.get(key, 0)

    def check(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The tokens a request would reserve; ContextTooLong when even an empty pool could not hold them."""
        needed = prompt_tokens + max_new_tokens
        if needed > self._kv_tokens:
            raise ContextTooLong(prompt_tokens, max_new_tokens, self._kv_tokens)
        return needed

    def reserve(self, key: str, tokens: int, *, over: bool = False) -> bool:
        """``key`` takes ``tokens`` if they are free now; False (and nothing taken) if not. ``over``
        takes them even past the budget (a later ring stage holds what stage 0 admitted)."""
        with self._lock:
            if key in self._held:
                raise ValueError(f"{key!r} holds {self._held[key]} tokens already")
            if not over and tokens > self._kv_tokens - self._reserved:
                return False
            self._held[key] = tokens
            self._reserved += tokens
            return True

    def release(self, key: str) -> int:
        """What ``key`` held goes back; the number of tokens (0 when it held none)."""
        with self._lock:
            tokens = self._held.pop(key, 0)
            self._reserved -= tokens
            return tokens

    def resize(self, kv_tokens: int) -> None:
        """The stage holds ``kv_tokens`` from now on (a ring admits by its smallest stage's)."""
        if kv_tokens < 1:
            raise ValueError(f"kv_tokens={kv_tokens} must be at least 1")
        with self._lock:
            self._kv_tokens = kv_tokens
