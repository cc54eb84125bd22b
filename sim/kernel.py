"""A minimal discrete-event kernel: a heap of (time, sequence, callback).

Deterministic: events at the same time run in the order they were scheduled. Time is in
milliseconds of simulated time; nothing here reads a wall clock (SimPy's Environment, not its
RealtimeEnvironment).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

__all__ = ["Environment"]


class Environment:
    """Simulated clock plus the pending-event heap."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0

    def schedule(self, delay_ms: float, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` ``delay_ms`` from now (>= 0)."""
        if delay_ms < 0:
            raise ValueError(f"cannot schedule in the past (delay {delay_ms} ms)")
        self.schedule_at(self.now_ms + delay_ms, callback, *args)

    def schedule_at(self, time_ms: float, callback: Callable[..., Any], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(time_ms, self.now_ms), self._seq, callback, args))

    def run(self, until_ms: float | None = None) -> None:
        """Process events in time order until none are left (or ``until_ms`` is reached)."""
        heap = self._heap
        while heap:
            if until_ms is not None and heap[0][0] > until_ms:
                self.now_ms = until_ms
                return
            time_ms, _, callback, args = heapq.heappop(heap)
            self.now_ms = time_ms
            callback(*args)

    @property
    def pending(self) -> int:
        return len(self._heap)
