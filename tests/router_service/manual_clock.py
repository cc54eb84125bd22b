"""A ``load_store.Clock`` that moves only when a test advances it, and a wait that advances it.

Its timers are asyncio's own (``asyncio.timeout``, futures), fired by ``advance`` instead of
by the event loop's clock, so a store's batching interval, backoff or timeout passes at once
and in order, and nothing sleeps to wait for one.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from types import TracebackType

_Timer = tuple[float, int, Callable[[], None]]  # deadline, order, what fires


class ManualClock:
    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s
        self._order = itertools.count()  # equal deadlines fire in the order they were set
        self._due: list[_Timer] = []  # a heap

    def now_s(self) -> float:
        return self._now_s

    @property
    def timers(self) -> int:
        """Timers waiting (a sleep, or a timeout whose block has not ended)."""
        return len(self._due)

    def timeout(self, delay_s: float | None) -> _ManualTimeout:
        return _ManualTimeout(self, delay_s)

    async def sleep(self, delay_s: float) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        entry = self._add(delay_s, wake)
        try:
            await done
        finally:
            self._drop(entry)

    def advance(self, delay_s: float) -> None:
        """Move the clock on by ``delay_s``, firing every timer it passes (in order); what
        they wake runs when the test next yields to the event loop."""
        self._now_s += delay_s
        while self._due and self._due[0][0] <= self._now_s:
            heapq.heappop(self._due)[2]()

    def _add(self, delay_s: float, fire: Callable[[], None]) -> _Timer:
        entry = (self._now_s + delay_s, next(self._order), fire)
        heapq.heappush(self._due, entry)
        self.advance(0.0)  # a timer already due fires now
        return entry

    def _drop(self, entry: _Timer) -> None:
        if entry in self._due:
            self._due.remove(entry)
            heapq.heapify(self._due)


class _ManualTimeout:
    """``asyncio.timeout(None)``, rescheduled to now when the manual clock passes its
    deadline: the block ends in ``TimeoutError`` exactly as under the real clock."""

    def __init__(self, clock: ManualClock, delay_s: float | None) -> None:
        self._clock = clock
        self._delay_s = delay_s
        self._inner = asyncio.timeout(None)
        self._entry: _Timer | None = None

    async def __aenter__(self) -> _ManualTimeout:
        await self._inner.__aenter__()
        if self._delay_s is not None:
            self._entry = self._clock._add(self._delay_s, self._expire)
        return self

    def _expire(self) -> None:
        self._inner.reschedule(asyncio.get_running_loop().time())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._entry is not None:
            self._clock._drop(self._entry)
        return await self._inner.__aexit__(exc_type, exc, tb)


async def until(
    check: Callable[[], bool],
    timeout_s: float = 5.0,
    *,
    clock: ManualClock | None = None,
    step_s: float = 0.005,
) -> None:
    """Poll ``check`` (what it waits for is real I/O: Redis' answers); with ``clock``, move
    it on by ``step_s`` at each poll, so the stores' timers keep firing meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        if clock is not None:
            clock.advance(step_s)
        await asyncio.sleep(0.005)
