"""Decayed queue load for the service: embedded, Redis, and Redis with embedded fallback.

One async interface, three stores, the semantics of DESIGN 3.2 (``routing.load``): a load in
ms per worker that decays by 31/32 every 20 ms, reservations and decayed-remainder releases.

- ``EmbeddedStore``: in process, one replica, no set-up.
- ``RedisStore``: shared by all replicas. Every operation is one Lua script run atomically on
  the server, on the server's clock (``TIME``), so replicas with skewed clocks agree. Keys are
  ``kvroute:{cluster}:load:{worker}`` hashes ``{v, t}`` (value, tick); they expire after an
  hour idle, and no prompt text is ever written.
- ``FallbackStore``: Redis while it answers within a small timeout; otherwise the embedded
  store, counted and reported in ``/health``, while a background task reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router_service.routing.load import DECAY_FACTOR, DECAY_TICK_MS, EmbeddedLoadStore

__all__ = ["EmbeddedStore", "FallbackStore", "LoadStore", "RedisStore", "StoreReservation"]

log = logging.getLogger("kvroute.load_store")


@dataclass(frozen=True, slots=True)
class StoreReservation:
    """A reservation and the store that holds it (released where it was made)."""

    worker: str
    inc_ms: float
    tick: int
    store: str  # "embedded" or "redis"


class LoadStore(Protocol):
    @property
    def mode(self) -> str: ...

    async def start(self) -> None: ...

    async def read_many(self, workers: list[str]) -> dict[str, float]: ...

    async def reserve(self, worker: str, inc_ms: float) -> StoreReservation: ...

    async def release(self, reservation: StoreReservation) -> None: ...

    async def remove(self, worker: str) -> None: ...

    def status(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def _now_ms() -> float:
    return time.monotonic() * 1000.0


class EmbeddedStore:
    """The routing core's embedded store on the process's monotonic clock.

    ``time_scale`` > 1 runs the decay that many times faster, for emulated workers whose
    time runs faster than real time (``kvroute emulate --time-scale``).
    """

    mode = "embedded"

    def __init__(self, time_scale: float = 1.0) -> None:
        self._store = EmbeddedLoadStore()
        self._scale = time_scale

    def _now_ms(self) -> float:
        return _now_ms() * self._scale

    async def start(self) -> None:
        pass

    async def read_many(self, workers: list[str]) -> dict[str, float]:
        return self._store.read_many(workers, self._now_ms())

    async def reserve(self, worker: str, inc_ms: float) -> StoreReservation:
        res = self._store.reserve(worker, inc_ms, self._now_ms())
        return StoreReservation(worker, inc_ms, res.tick, "embedded")

    async def release(self, reservation: StoreReservation) -> None:
        from router_service.routing.load import Reservation

        res = Reservation(reservation.worker, reservation.inc_ms, reservation.tick)
        self._store.release(res, self._now_ms())

    async def remove(self, worker: str) -> None:
        self._store.remove(worker)

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode}

    async def close(self) -> None:
        pass


# Shared Lua prelude: the server's clock in ticks, and a key's value decayed to that tick.
_PRELUDE = f"""
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_tick = math.floor(now_ms / {DECAY_TICK_MS})
local function decayed(key)
  local v = tonumber(redis.call('HGET', key, 'v') or '0')
  local at = tonumber(redis.call('HGET', key, 't') or tostring(now_tick))
  if now_tick > at then v = v * math.pow({DECAY_FACTOR!r}, now_tick - at) end
  return v
end
"""
_READ = (
    _PRELUDE
    + """
local out = {}
for i, key in ipairs(KEYS) do out[i] = tostring(decayed(key)) end
return out
"""
)
_RESERVE = (
    _PRELUDE
    + """
local v = decayed(KEYS[1]) + tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'v', tostring(v), 't', now_tick)
redis.call('EXPIRE', KEYS[1], 3600)
return now_tick
"""
)
_RELEASE = (
    _PRELUDE
    + f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return '0' end
local rem = tonumber(ARGV[1])
local ticks = now_tick - tonumber(ARGV[2])
if ticks > 0 then rem = rem * math.pow({DECAY_FACTOR!r}, ticks) end
local v = decayed(KEYS[1]) - rem
if v < 0 then v = 0 end
redis.call('HSET', KEYS[1], 'v', tostring(v), 't', now_tick)
return tostring(rem)
"""
)


class RedisStore:
    """Decayed load shared through Redis; raises RedisError/TimeoutError when Redis fails."""

    mode = "redis"

    def __init__(self, client: aioredis.Redis, cluster: str) -> None:
        self.client = client
        self.prefix = f"kvroute:{cluster}:load:"
        self._read = client.register_script(_READ)
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)

    def key(self, worker: str) -> str:
        return self.prefix + worker

    async def start(self) -> None:
        """Connect and load the scripts now: a cold first call (connection handshake, then
        NOSCRIPT and a script load) takes tens of ms, past the per-operation timeout."""
        await self.client.ping()
        for script in (self._read, self._reserve, self._release):
            await self.client.script_load(script.script)

    async def read_many(self, workers: list[str]) -> dict[str, float]:
        if not workers:
            return {}
        values = await self._read(keys=[self.key(w) for w in workers])
        return {w: float(v) for w, v in zip(workers, values, strict=True)}

    async def reserve(self, worker: str, inc_ms: float) -> StoreReservation:
        tick = await self._reserve(keys=[self.key(worker)], args=[repr(float(inc_ms))])
        return StoreReservation(worker, inc_ms, int(tick), "redis")

    async def release(self, reservation: StoreReservation) -> None:
        await self._release(
            keys=[self.key(reservation.worker)],
            args=[repr(float(reservation.inc_ms)), reservation.tick],
        )

    async def remove(self, worker: str) -> None:
        await self.client.delete(self.key(worker))

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode}

    async def close(self) -> None:
        await self.client.aclose()


class FallbackStore:
    """Redis first; the embedded store while Redis is unreachable; never blocks for long."""

    def __init__(self, redis_store: RedisStore, timeout_ms: float = 50.0) -> None:
        self.redis = redis_store
        self.embedded = EmbeddedStore()
        self.timeout_s = timeout_ms / 1000.0
        self.degraded = False
        self.fallbacks = 0  # operations served by the embedded store because Redis failed
        self.outages = 0
        self.last_error: str | None = None
        self._reconnect: asyncio.Task[None] | None = None

    @property
    def mode(self) -> str:
        return "embedded-fallback" if self.degraded else "redis"

    async def start(self) -> None:
        """Warm the Redis connection before serving, with more time than one operation gets;
        if Redis does not answer, start degraded and keep reconnecting."""
        try:
            await asyncio.wait_for(self.redis.start(), max(self.timeout_s, 2.0))
        except (RedisError, OSError, TimeoutError) as exc:
            self._degrade(exc)

    async def _call(self, op: str, *args: Any) -> Any:
        if not self.degraded:
            try:
                async with asyncio.timeout(self.timeout_s):  # no extra task, unlike wait_for
                    return await getattr(self.redis, op)(*args)
            except (RedisError, OSError, TimeoutError) as exc:
                self._degrade(exc)
        self.fallbacks += 1
        return await getattr(self.embedded, op)(*args)

    def _degrade(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        if not self.degraded:
            self.degraded = True
            self.outages += 1
            log.warning(
                "Redis unavailable (%s); routing on the embedded load store", self.last_error
            )
            if self._reconnect is None or self._reconnect.done():
                self._reconnect = asyncio.get_running_loop().create_task(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        delay = 0.1
        while self.degraded:
            await asyncio.sleep(delay)
            try:
                # Connections pooled before the outage are dead: drop them all, or the first
                # operations after the restart fail on them and degrade the store again.
                await self.redis.client.connection_pool.disconnect()
                # A restarted Redis has lost the scripts: reload them before traffic returns.
                await asyncio.wait_for(self.redis.start(), max(self.timeout_s, 0.5))
            except (RedisError, OSError, TimeoutError):
                delay = min(delay * 2, 5.0)
                continue
            self.degraded = False
            log.warning("Redis is back; shared load store restored")

    async def read_many(self, workers: list[str]) -> dict[str, float]:
        values: dict[str, float] = await self._call("read_many", workers)
        return values

    async def reserve(self, worker: str, inc_ms: float) -> StoreReservation:
        res: StoreReservation = await self._call("reserve", worker, inc_ms)
        return res

    async def release(self, reservation: StoreReservation) -> None:
        if reservation.store == "embedded":
            await self.embedded.release(reservation)
        else:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                # If Redis is gone the reservation decays away there on its own.
                async with asyncio.timeout(self.timeout_s):
                    await self.redis.release(reservation)

    async def remove(self, worker: str) -> None:
        await self.embedded.remove(worker)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.redis.remove(worker), self.timeout_s)

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "redis_connected": not self.degraded,
            "fallback_operations": self.fallbacks,
            "outages": self.outages,
            "last_error": self.last_error,
        }

    async def close(self) -> None:
        if self._reconnect is not None:
            self._reconnect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnect
        await self.redis.close()


def make_store(
    redis_url: str | None, cluster: str, timeout_ms: float, time_scale: float = 1.0
) -> LoadStore:
    if not redis_url:
        return EmbeddedStore(time_scale)
    client = aioredis.Redis.from_url(
        redis_url,
        socket_connect_timeout=max(timeout_ms / 1000.0, 0.2),
        socket_timeout=max(timeout_ms / 1000.0, 0.2),
        health_check_interval=0,
    )
    return FallbackStore(RedisStore(client, cluster), timeout_ms)
