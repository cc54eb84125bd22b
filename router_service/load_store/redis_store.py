"""``RedisStore``: the load shared by every replica, one Lua script per operation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router_service.load_store import scripts
from router_service.load_store.clock import Clock, MonotonicClock
from router_service.load_store.interface import Ticket
from router_service.redis_client import RedisClient, key_prefix

__all__ = ["RedisStore"]


class RedisStore:
    """Decayed load shared through Redis, each operation one script run atomically on the
    server's clock (``scripts``).

    Each operation is bounded by ``timeout_ms`` (``None``: unbounded) and raises
    ``RedisError``, ``OSError`` or ``TimeoutError`` when Redis fails or is too slow.
    """

    mode = "redis"

    def __init__(
        self,
        client: RedisClient,
        cluster: str,
        timeout_ms: float | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.client = client
        self.prefix = key_prefix(cluster) + "load:"  # one hash slot: the scripts' keys too
        self.timeout_s = timeout_ms / 1000.0 if timeout_ms is not None else None
        self._clock = clock or MonotonicClock()
        self._read = client.register_script(scripts.READ)
        self._reserve = client.register_script(scripts.RESERVE)
        self._release = client.register_script(scripts.RELEASE)

    def key(self, worker: str) -> str:
        return self.prefix + worker

    async def start(self) -> None:
        """Connect and load the scripts now: a cold first call (connection handshake, then
        NOSCRIPT and a script load) takes tens of ms, past the per-operation timeout."""
        await self.client.ping()
        for script in (self._read, self._reserve, self._release):
            await self.client.script_load(script.script)

    async def refresh(self, workers: Sequence[str] = ()) -> None:
        """Nothing to bring up to date: every read asks Redis."""

    def reset(self) -> None:
        """Nothing queued, nothing copied."""

    async def read_many(self, workers: list[str]) -> dict[str, float]:
        if not workers:
            return {}
        async with self._clock.timeout(self.timeout_s):
            values = await self._read(keys=[self.key(w) for w in workers])
        return {w: float(v) for w, v in zip(workers, values, strict=True)}

    async def reserve(self, worker: str, inc_ms: float) -> Ticket:
        async with self._clock.timeout(self.timeout_s):
            tick = await self._reserve(keys=[self.key(worker)], args=[repr(float(inc_ms))])
        return Ticket(worker, inc_ms, int(tick), "redis")

    async def release(self, ticket: Ticket) -> None:
        async with self._clock.timeout(self.timeout_s):
            await self._release(
                keys=[self.key(ticket.worker)], args=[repr(float(ticket.inc_ms)), ticket.tick]
            )

    async def remove(self, worker: str) -> None:
        async with self._clock.timeout(self.timeout_s):
            await self.client.delete(self.key(worker))

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode}

    async def close(self) -> None:
        await self.client.aclose()
