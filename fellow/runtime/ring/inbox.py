"""A stage's inbox: frames from the bus, taken by the compute thread with each batch kept whole."""

from __future__ import annotations

import queue
import time
from collections import Counter

COALESCE_S = 0.05  # how long a stage waits for the rest of a batch whose first frames are in


class Inbox:
    """Thread-safe: the event loop puts decoded frames (and control tuples), the compute thread takes.

    A batched step's frames are sent back to back and arrive a few milliseconds apart; a stage
    that started on what had arrived would split the batch, and every part costs nearly a whole
    forward. So ``take`` waits up to COALESCE_S for the rest of any batch it holds part of.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self._queue.put(item)

    def take(self, timeout: float) -> list:
        """Everything waiting (after up to ``timeout`` s for the first), with partial batches completed."""
        try:
            first = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        items = [first]
        self._drain(items)
        deadline = time.monotonic() + COALESCE_S
        while _partial(items):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                items.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
            self._drain(items)
        return items

    def _drain(self, items: list) -> None:
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return


def _partial(items: list) -> bool:
    """Whether some batch (frames with batch > 1 from one sender step) is not all here."""
    counts = Counter((item.step, item.batch) for item in items if getattr(item, "batch", 1) > 1)
    return any(n < batch for (_, batch), n in counts.items())
