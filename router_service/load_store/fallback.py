"""``FallbackStore``: Redis while it answers, the embedded store while it does not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from router_service.load_store.clock import Clock, MonotonicClock
from router_service.load_store.embedded import EmbeddedStore
from router_service.load_store.interface import (
    REDIS_FAILURES,
    LoadOperations,
    SharedStore,
    Ticket,
)
from router_service.load_store.mirror import RedisMirror
from router_service.load_store.redis_store import RedisStore
from router_service.redis_client import drop_connections

__all__ = ["FallbackStore"]

log = logging.getLogger("kvroute.load_store")

T = TypeVar("T")


class FallbackStore:
    """Redis first; the embedded store while Redis is unreachable; never blocks for long.

    ``sync_ms`` > 0 talks to Redis through a ``RedisMirror`` (a local copy, writes in
    batches of that interval; ``on_read_age`` gets the copy's age at every read), 0 through
    ``redis_store`` itself (one script per operation). Either way the shared store's
    operations are bounded by ``redis_store``'s timeout; when one fails (or the mirror's
    syncer does), the store degrades: every operation is served by the embedded store,
    counted, and reported in ``/health``, while a background task reconnects with backoff.
    """

    def __init__(
        self,
        redis_store: RedisStore,
        sync_ms: float = 0.0,
        *,
        on_read_age: Callable[[float], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if redis_store.timeout_s is None:
            raise ValueError(
                "FallbackStore needs a RedisStore with a timeout_ms: an unbounded operation "
                "would stall requests on a slow Redis instead of falling back"
            )
        self.redis = redis_store
        self.timeout_s = redis_store.timeout_s
        self._clock = clock or MonotonicClock()
        self.backend: SharedStore = (
            RedisMirror(
                redis_store,
                sync_ms,
                read_wait_ms=self.timeout_s * 1000.0,
                on_error=self._degrade,
                on_read_age=on_read_age,
                clock=self._clock,
            )
            if sync_ms > 0
            else redis_store
        )
        self.embedded = EmbeddedStore(clock=self._clock)
        self.degraded = False
        self.fallbacks = 0  # operations served by the embedded store because Redis failed
        self.outages = 0
        self.last_error: str | None = None
        self._reconnect: asyncio.Task[None] | None = None

    @property
    def mode(self) -> str:
        return "embedded-fallback" if self.degraded else "redis"

    async def start(self, workers: Sequence[str] = ()) -> None:
        """Warm the Redis connection (and the mirror's copy of ``workers``' loads) before
        serving, with more time than one operation gets; if Redis does not answer, start
        degraded and keep reconnecting."""
        try:
            async with self._clock.timeout(max(self.timeout_s, 2.0)):
                await self.backend.start()
                await self.backend.refresh(workers)
        except REDIS_FAILURES as exc:
            self._degrade(exc)

    async def _shared_first(self, operation: Callable[[LoadOperations], Awaitable[T]]) -> T:
        """``operation`` on the shared store, or on the embedded one if Redis fails."""
        if not self.degraded:
            try:
                return await operation(self.backend)
            except REDIS_FAILURES as exc:
                self._degrade(exc)
        self.fallbacks += 1
        return await operation(self.embedded)

    def _degrade(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        if not self.degraded:
            self.degraded = True
            self.outages += 1
            self.backend.reset()  # what it held or queued may be gone with Redis
            log.warning(
                "Redis unavailable (%s); routing on the embedded load store", self.last_error
            )
            if self._reconnect is None or self._reconnect.done():
                self._reconnect = asyncio.get_running_loop().create_task(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        delay_s = 0.1
        while self.degraded:
            await self._clock.sleep(delay_s)
            try:
                # Connections pooled before the outage are dead: drop them all, or the first
                # operations after the restart fail on them and degrade the store again.
                await drop_connections(self.redis.client)
                # A restarted Redis has lost the scripts: reload them before traffic returns.
                async with self._clock.timeout(max(self.timeout_s, 0.5)):
                    await self.backend.start()
                # Fresh loads before traffic returns, so that no read waits on a busy loop.
                self.backend.reset()
                async with self._clock.timeout(max(self.timeout_s, 0.5)):
                    await self.backend.refresh()
            except REDIS_FAILURES:
                delay_s = min(delay_s * 2, 5.0)
                continue
            self.degraded = False
            log.warning("Redis is back; shared load store restored")

    async def read_many(self, workers: list[str]) -> dict[str, float]:
        return await self._shared_first(lambda store: store.read_many(workers))

    async def reserve(self, worker: str, inc_ms: float) -> Ticket:
        return await self._shared_first(lambda store: store.reserve(worker, inc_ms))

    async def release(self, ticket: Ticket) -> None:
        if ticket.store == "embedded":
            await self.embedded.release(ticket)
        elif not self.degraded:  # if Redis is gone the reservation decays away there
            with contextlib.suppress(*REDIS_FAILURES):
                await self.backend.release(ticket)

    async def remove(self, worker: str) -> None:
        await self.embedded.remove(worker)
        with contextlib.suppress(*REDIS_FAILURES):
            await self.backend.remove(worker)

    def status(self) -> dict[str, Any]:
        out = {
            "mode": self.mode,
            "redis_connected": not self.degraded,
            "fallback_operations": self.fallbacks,
            "outages": self.outages,
            "last_error": self.last_error,
        }
        # The mirror's sync figures (the per-operation store has none).
        return out | {k: v for k, v in self.backend.status().items() if k != "mode"}

    async def close(self) -> None:
        if self._reconnect is not None:
            self._reconnect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnect
        await self.backend.close()
