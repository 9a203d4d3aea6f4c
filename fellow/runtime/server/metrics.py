"""A stage's request counters for its metrics reports: requests taken, the last time to first token,
tokens a second over the last 30 s."""

from __future__ import annotations

import time


class Metrics:
    def __init__(self) -> None:
        self.requests = 0
        self.last_ttft_s: float | None = None
        self.window: list[tuple[float, int]] = []  # (time, tokens) over the last 30 s

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        self.window.append((now, n))
        while self.window and now - self.window[0][0] > 30:
            self.window.pop(0)

    def tokens_per_s(self) -> float:
        if len(self.window) < 2:
            return 0.0
        span = self.window[-1][0] - self.window[0][0]
        return round(sum(n for _, n in self.window[1:]) / span, 3) if span > 0 else 0.0
