"""The time the load stores read and wait on, passed in.

Every store that reads the time (the decay, the copy's age) or waits on it (the mirror's
batching interval and sync timeout, the fallback's reconnect backoff, per-operation bounds)
takes a ``Clock``. The service runs on ``MonotonicClock``; tests pass a clock they advance
by hand, so that a batching interval or a backoff passes without sleeping.

>>> import asyncio
>>> async def bounded() -> str:
...     try:
...         async with MonotonicClock().timeout(0.001):
...             await asyncio.sleep(1)
...     except TimeoutError:
...         return "timed out"
...     return "finished"
>>> asyncio.run(bounded())
'timed out'
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from typing import Protocol

__all__ = ["Clock", "MonotonicClock"]


class Clock(Protocol):
    def now_s(self) -> float:
        """Monotonic seconds (any origin: only differences mean something)."""
        ...

    def timeout(self, delay_s: float | None) -> AbstractAsyncContextManager[object]:
        """``asyncio.timeout`` on this clock: the block raises ``TimeoutError`` once
        ``delay_s`` has passed (``None``: never)."""
        ...

    async def sleep(self, delay_s: float) -> None:
        """Return once ``delay_s`` has passed."""
        ...


class MonotonicClock:
    """The process's monotonic clock, the one asyncio's timers run on."""

    def now_s(self) -> float:
        return time.monotonic()

    def timeout(self, delay_s: float | None) -> asyncio.Timeout:
        return asyncio.timeout(delay_s)

    async def sleep(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
