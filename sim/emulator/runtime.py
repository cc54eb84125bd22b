"""The simulator's worker engine driven in real time (asyncio), ``time_scale`` times faster.

One task runs the scheduler loop: form a batch (``WorkerEngine.plan_step``), sleep for its
emulated duration divided by ``time_scale``, finish it, and hand each request its new tokens.
Back-to-back steps are timed against deadlines, so the event loop's wake-up lateness does not
accumulate over a busy period (it would, multiplied by ``time_scale``).
Emulated time is the monotonic clock times ``time_scale``, so a 1 s prefill at
``time_scale=10`` takes 100 ms of wall time and is reported as 1 s of emulated time.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_ext.cache import RadixCache
from router_service.kv_wire import KVEvent
from sim.cache_events import EventedRadixCache
from sim.engine import EngineRequest, RequestTooLarge, Step, WorkerEngine
from sim.profiles import ServiceProfile

__all__ = ["EmulatedRuntime", "RequestTooLarge", "Submission"]


@dataclass(eq=False)
class Submission:
    """A request inside the runtime; ``tokens`` yields the count of tokens produced so far."""

    request: EngineRequest
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)


class EmulatedRuntime:
    """A worker's engine, cache and scheduler loop."""

    def __init__(
        self,
        profile: ServiceProfile,
        eviction: str,
        capacity_tokens: int | None,
        *,
        time_scale: float = 1.0,
        page_size: int = 1,
        seed: int = 0,
        on_events: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.profile = profile
        self.time_scale = time_scale
        capacity = capacity_tokens or profile.kv_capacity_tokens
        rng = random.Random(seed)
        # With ``on_events`` the cache records its KV events, handed over after every
        # scheduler step (admissions evict, completions insert), as SGLang publishes them.
        self.on_events = on_events
        self.cache: RadixCache = (
            EventedRadixCache(capacity, eviction, page_size=page_size, rng=rng)
            if on_events is not None
            else RadixCache(capacity, eviction, page_size=page_size, rng=rng)
        )
        self.engine = WorkerEngine(profile, self.cache)
        self._subs: dict[str, Submission] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.generation_tokens = 0
        self.requests_total = 0

    def now_ms(self) -> float:
        """Emulated time: the monotonic clock, scaled."""
        return time.monotonic() * 1000.0 * self.time_scale

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def overhead(self, spent_s: float = 0.0) -> None:
        """The per-request overhead (tokenisation, HTTP), scaled.

        ``spent_s`` is the wall time this worker already spent on the request (reading and
        parsing its body): it is part of that overhead, so only the rest is slept. Charging
        both would bill the HTTP work twice, ``time_scale`` times over in emulated time.
        """
        await asyncio.sleep(
            max(0.0, self.profile.request_overhead_ms / 1000.0 / self.time_scale - spent_s)
        )

    def submit(self, request: EngineRequest) -> Submission:
        """Queue a request (raises RequestTooLarge / ValueError for impossible ones)."""
        self.engine.submit(request, self.now_ms())
        sub = Submission(request)
        self._subs[request.rid] = sub
        self.requests_total += 1
        self._wake.set()
        return sub

    async def _loop(self) -> None:
        # A step that follows another back to back starts when the previous one was due, not
        # when the loop woke up: asyncio wakes ~0.1-2 ms late, and time_scale multiplies that
        # lateness into every step (a 40-step request at 20x ran ~1.8x its emulated time).
        due_ms: float | None = None
        while True:
            now_ms = self.now_ms()
            step = self.engine.plan_step(now_ms)
            self._publish()
            if step is None:
                due_ms = None
                self._wake.clear()
                await self._wake.wait()
                continue
            due_ms = (now_ms if due_ms is None else min(now_ms, due_ms)) + step.duration_ms
            delay_s = (due_ms - now_ms) / 1000.0 / self.time_scale
            await asyncio.sleep(max(0.0, delay_s))
            self._deliver(step, due_ms)

    def _publish(self) -> None:
        if self.on_events is not None and isinstance(self.cache, EventedRadixCache):
            self.on_events(self.cache.events.take())

    def _deliver(self, step: Step, due_ms: float) -> None:
        result = self.engine.finish_step(step, due_ms)
        self._publish()
        for req in result.first_tokens + step.decode:
            sub = self._subs.get(req.rid)
            if sub is not None:
                sub.tokens.put_nowait(req.generated)
                self.generation_tokens += 1
        for req in result.finished:
            sub = self._subs.pop(req.rid, None)
            if sub is not None:
                sub.tokens.put_nowait(None)

    def flush(self) -> bool:
        flushed = self.engine.flush()
        self._publish()
        return flushed

    @property
    def running(self) -> int:
        return len(self.engine.running) + (self.engine.chunked is not None)

    @property
    def queued(self) -> int:
        return len(self.engine.waiting)
