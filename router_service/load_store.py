"""Decayed queue load for the service: embedded, Redis, and Redis with embedded fallback.

One async interface, three stores, the semantics of ``routing.load``: a load in
ms per worker that decays by 31/32 every 20 ms, reservations and decayed-remainder releases.

- ``EmbeddedStore``: in process, one replica, no set-up.
- ``RedisStore``: shared by all replicas. Every operation is one Lua script run atomically on
  the server, on the server's clock (``TIME``), so replicas with skewed clocks agree. Keys are
  ``kvroute:{cluster}:load:{worker}`` hashes ``{v, t}`` (value, tick; the braces are literal,
  a Redis Cluster hash tag: ``redis_client.key_prefix``); they expire after an hour idle, and
  no prompt text is ever written.
- ``RedisMirror``: the same keys and scripts' semantics without a round trip per operation:
  decisions read a local copy, writes leave in batches (the service's default,
  ``load_sync_ms`` 5; 0 uses ``RedisStore`` directly).
- ``FallbackStore``: Redis while it answers within a small timeout; otherwise the embedded
  store, counted and reported in ``/health``, while a background task reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError

from router_service.redis_client import RedisClient, connect, drop_connections, key_prefix
from router_service.routing.load import DECAY_FACTOR, DECAY_TICK_MS, EmbeddedLoadStore, decayed

__all__ = [
    "EmbeddedStore",
    "FallbackStore",
    "LoadStore",
    "RedisMirror",
    "RedisStore",
    "StoreReservation",
]

log = logging.getLogger("kvroute.load_store")


@dataclass(slots=True)
class StoreReservation:
    """A reservation and the store that holds it (released where it was made).

    ``tick`` is the decay tick it was added at; a batched Redis store (``RedisMirror``) fills
    it in when the batch reaches Redis (``-1`` until then).
    """

    worker: str
    inc_ms: float
    tick: int
    store: str  # "embedded" or "redis"


class LoadStore(Protocol):
    @property
    def mode(self) -> str: ...

    async def start(self, workers: Sequence[str] = ()) -> None: ...

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

    async def start(self, workers: Sequence[str] = ()) -> None:
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


# Shared Lua prelude: the server's clock in ticks, a key's value decayed to that tick, and
# the two writes (every script that reserves or releases uses these, so they cannot drift).
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
local function reserve(key, inc)
  redis.call('HSET', key, 'v', tostring(decayed(key) + inc), 't', now_tick)
  redis.call('EXPIRE', key, 3600)
end
local function release(key, inc, tick)
  if redis.call('EXISTS', key) == 0 then return 0 end
  local rem = inc
  if now_tick > tick then rem = rem * math.pow({DECAY_FACTOR!r}, now_tick - tick) end
  local v = decayed(key) - rem
  if v < 0 then v = 0 end
  redis.call('HSET', key, 'v', tostring(v), 't', now_tick)
  return rem
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
reserve(KEYS[1], tonumber(ARGV[1]))
return now_tick
"""
)
_RELEASE = (
    _PRELUDE
    + """
return tostring(release(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])))
"""
)


class RedisStore:
    """Decayed load shared through Redis; raises RedisError/TimeoutError when Redis fails."""

    mode = "redis"

    def __init__(self, client: RedisClient, cluster: str) -> None:
        self.client = client
        self.prefix = key_prefix(cluster) + "load:"  # one hash slot: the scripts' keys too
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


# One round trip applies a batch of reservations and releases and reads every worker's load.
# KEYS: the keys to read (ARGV[1] of them) first, then keys only written. ARGV[2] reservations
# as (key index, inc) pairs and ARGV[3] releases as (key index, inc, tick) triples follow.
# Returns the server's clock in ms, the tick the batch was applied at, and the loads read.
_SYNC = (
    _PRELUDE
    + """
local n_read, n_res, n_rel = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local i = 4
for _ = 1, n_res do
  reserve(KEYS[tonumber(ARGV[i])], tonumber(ARGV[i + 1]))
  i = i + 2
end
for _ = 1, n_rel do
  release(KEYS[tonumber(ARGV[i])], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]))
  i = i + 3
end
local out = {tostring(now_ms), now_tick}
for j = 1, n_read do out[j + 2] = tostring(decayed(KEYS[j])) end
return out
"""
)


# A sync that came back within half a decay tick: the loop is not busy, a read may wait.
_QUICK_SYNC_MS = DECAY_TICK_MS / 2


class _Ops:
    """This replica's load operations at one stage, queued or in the batch on the wire: the
    operations themselves (to send, and to know whether a reservation is in the batch) and
    their per-worker sums, so a read costs O(workers), not O(operations): a saturated
    replica has hundreds pending.

    Reserved ms (with a count, so that a worker whose reservations were all cancelled reads
    exactly 0), and released ms grouped by the tick their reservation reached Redis at: a
    release subtracts ``decayed(inc, now - tick)``, which is linear in ``inc``, so one sum per
    tick is exact.
    """

    __slots__ = ("released", "releases", "reserved", "reserves")

    def __init__(self) -> None:
        self.reserves: dict[int, StoreReservation] = {}  # by id()
        self.releases: list[StoreReservation] = []  # their reservations were applied
        self.reserved: dict[str, list[float]] = {}  # worker -> [ms, count]
        self.released: dict[str, dict[int, float]] = {}  # worker -> {tick: ms}

    def __bool__(self) -> bool:
        return bool(self.reserves or self.releases)

    def reserve(self, res: StoreReservation) -> None:
        self.reserves[id(res)] = res
        entry = self.reserved.get(res.worker)
        if entry is None:
            self.reserved[res.worker] = [res.inc_ms, 1]
        else:
            entry[0] += res.inc_ms
            entry[1] += 1

    def cancel(self, res: StoreReservation) -> bool:
        """Take back ``res`` if it is here (False if not)."""
        if self.reserves.pop(id(res), None) is None:
            return False
        entry = self.reserved[res.worker]
        entry[1] -= 1
        if entry[1] <= 0:
            del self.reserved[res.worker]
        else:
            entry[0] -= res.inc_ms
        return True

    def release(self, res: StoreReservation) -> None:
        self.releases.append(res)
        by_tick = self.released.setdefault(res.worker, {})
        by_tick[res.tick] = by_tick.get(res.tick, 0.0) + res.inc_ms

    def adjust(self, worker: str, tick: int) -> float:
        """What these operations add to ``worker``'s load at ``tick``."""
        entry = self.reserved.get(worker)
        out = entry[0] if entry is not None else 0.0
        by_tick = self.released.get(worker)
        if by_tick:
            for at, inc in by_tick.items():
                out -= decayed(inc, tick - at)
        return out

    def drop(self, worker: str) -> None:
        self.reserves = {k: r for k, r in self.reserves.items() if r.worker != worker}
        self.releases = [r for r in self.releases if r.worker != worker]
        self.reserved.pop(worker, None)
        self.released.pop(worker, None)


class RedisMirror:
    """The Redis store without a round trip per operation: reads from a local mirror,
    writes in batches.

    The per-operation store makes three round trips per request, two of them before the
    request can leave (read every worker's load, reserve) and one after (release). Here a
    decision reads a local copy of the loads, decayed to now on the server's clock (estimated
    from the last sync), plus this replica's own operations that the copy does not hold yet;
    reserve and release only queue. One script per sync applies the queued operations
    atomically on the server's clock and reads every worker's load back, so ``routing.load``'s
    semantics hold (a release subtracts the remainder decayed since the tick its reservation
    reached Redis at). A reservation released before its batch left is cancelled locally and
    never reaches Redis.

    Syncs run in one background task, one at a time: queued writes wait up to ``interval_ms``
    so that they leave together. A read of a copy older than ``max_age_ms`` (one decay tick)
    asks for a sync. It waits for that sync only if the copy is older than ``stale_ms``, no
    sync is on the wire and the last one came back within half a tick (``must_wait``: a
    replica between requests, whose loop answers at once), and the fallback store bounds that
    wait by the Redis timeout and then uses the copy: a busy event loop never stalls requests
    on Redis, nor reads as an outage (the syncer's own failures report those). Other
    replicas' operations show after about ``interval_ms`` plus one sync of the reader's. A
    worker new to the copy reads 0 until the sync it asks for. A failed sync fails the reads
    waiting for it and calls ``on_error``; the fallback store then degrades and resets the
    mirror.
    """

    mode = "redis"

    def __init__(
        self,
        redis_store: RedisStore,
        interval_ms: float = 5.0,
        *,
        max_age_ms: float = float(DECAY_TICK_MS),
        stale_ms: float = float(DECAY_TICK_MS),
        on_error: Callable[[BaseException], None] | None = None,
        timeout_ms: float = 1000.0,
    ) -> None:
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be > 0, got {interval_ms}")
        self.redis = redis_store
        self.interval_s = interval_ms / 1000.0
        self.max_age_ms = max_age_ms
        self.stale_ms = max(stale_ms, max_age_ms)
        # Off the request path, so generous: a busy event loop must not read as an outage.
        self.timeout_s = timeout_ms / 1000.0
        self.on_error = on_error
        self._sync = redis_store.client.register_script(_SYNC)
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # close() was called: the sync loop ends
        self._in_flight = False
        self._rtt_ms = 0.0  # the last sync, send to reply as this loop saw it
        self._waiters: list[asyncio.Future[None]] = []
        self.syncs = 0
        self.operations_sent = 0
        self.cancelled = 0  # reservations released before they were sent: never sent
        # Called with the copy's age in seconds at every read (kvroute_load_copy_age_seconds).
        self.on_read_age: Callable[[float], None] | None = None
        self._loads: dict[str, tuple[float, int]] = {}  # worker -> (value, tick) at last sync
        self._wanted: dict[str, None] = {}  # workers to read back (an ordered set)
        self._offset_ms = 0.0
        self.reset()

    def reset(self) -> None:
        """Drop everything queued and mark the copy stale (Redis was lost).

        The copy itself and the workers it covers are kept until the next sync replaces them
        (``refresh`` does that before traffic returns), so reads never wait after a reconnect.
        """
        self._fail_waiters(ConnectionError("the load mirror was reset"))
        self._local_ms = -math.inf  # our clock when the last sync was sent
        # The server's clock minus ours: each sync bounds it between its send and its reply;
        # the tightest bounds of recent syncs give the estimate (as NTP filters samples).
        self._offsets: deque[tuple[float, float]] = deque(maxlen=32)
        self._queued = _Ops()
        self._in_batch = _Ops()  # in the sync now in flight
        # Released while their reservation was in flight (its tick comes with the reply):
        # they count undecayed until then, and queue with their tick after it.
        self._deferred: list[StoreReservation] = []
        self._deferred_ms: dict[str, float] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.redis.start()
        await self.redis.client.script_load(_SYNC)
        if self._task is None or self._task.done():
            self._closing = False
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Send what is queued (the releases of requests that ended while draining), then
        stop; if Redis does not take it in time, those loads decay there on their own."""
        task = self._task
        if task is not None:
            if (self._queued or self._deferred) and not task.done():
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await asyncio.wait_for(self.refresh(), self.timeout_s)
            # The flag stops the loop even if the cancellation is swallowed on the way (the
            # Redis client may turn a CancelledError mid-command into a connection error).
            self._closing = True
            self._wake.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task}, timeout=max(self.timeout_s, 1.0))
            self._task = None
        self._fail_waiters(ConnectionError("load store closed"))
        await self.redis.close()

    # -- operations --------------------------------------------------------------------------
    async def read_many(self, workers: list[str]) -> dict[str, float]:
        if not workers:
            return {}
        if self.must_wait():
            asked_ms = _now_ms()
            await self._synced(workers)
            if self._local_ms < asked_ms:  # reset while this read waited
                raise ConnectionError("the load mirror was reset during the read")
        return self.read_local(workers)

    def must_wait(self) -> bool:
        """Would a read wait for a sync (an old copy, or none yet, on a loop that answers
        quickly)? If not, ``read_local`` answers it without I/O.

        It waits only if no sync is on the wire already (its answer is on the way) and the
        last sync took at most half a tick: on a loop that busy, waiting would only add its
        lag to the request, and the read asks for a sync anyway.
        """
        if self._local_ms == -math.inf:
            return True  # no copy at all (not warmed, or reset): nothing to read instead
        if _now_ms() - self._local_ms <= self.stale_ms or self._in_flight:
            return False
        return self._rtt_ms <= _QUICK_SYNC_MS

    def read_local(self, workers: list[str]) -> dict[str, float]:
        """The loads from the copy; a worker it does not cover yet reads 0 until the sync
        this asks for (a worker just added, whose load is 0 unless others sent to it)."""
        now_ms = _now_ms()
        age_ms = now_ms - self._local_ms
        if self.on_read_age is not None and age_ms < math.inf:
            self.on_read_age(age_ms / 1000.0)
        missing = [w for w in workers if w not in self._loads]
        if missing:
            self._wanted.update(dict.fromkeys(missing))
        if missing or age_ms > self.max_age_ms:
            self._request_sync()  # refresh soon; this read uses the copy it has
        tick = self._server_tick(now_ms)
        queued, in_batch, deferred = self._queued, self._in_batch, self._deferred_ms
        out = {}
        for w in workers:
            value, at = self._loads.get(w, (0.0, tick))
            # Plus this replica's operations the copy does not hold yet (queued, in flight).
            v = decayed(value, tick - at) + queued.adjust(w, tick) + in_batch.adjust(w, tick)
            out[w] = max(0.0, v - deferred[w] if w in deferred else v)
        return out

    async def reserve(self, worker: str, inc_ms: float) -> StoreReservation:
        res = StoreReservation(worker, inc_ms, -1, "redis")
        self._queued.reserve(res)
        self._wanted.setdefault(worker)  # read its load back with the batch
        self._wake.set()
        return res

    async def release(self, reservation: StoreReservation) -> None:
        if self._queued.cancel(reservation):
            self.cancelled += 1  # never sent: nothing to undo in Redis
        elif reservation.tick >= 0:  # sent and applied
            self._queued.release(reservation)
            self._wake.set()
        elif id(reservation) in self._in_batch.reserves:  # its tick comes with the reply
            worker = reservation.worker
            self._deferred.append(reservation)
            self._deferred_ms[worker] = self._deferred_ms.get(worker, 0.0) + reservation.inc_ms
            self._wake.set()
        # else: queued before a reset (Redis was lost): it decays away wherever it landed

    async def remove(self, worker: str) -> None:
        self._loads.pop(worker, None)
        self._wanted.pop(worker, None)
        self._queued.drop(worker)
        await self.redis.remove(worker)

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "sync_interval_ms": self.interval_s * 1000.0,
            # How old the copy is now: the most another replica's operations can be unseen
            # here, beyond their own batch interval (None before the first sync).
            "copy_age_ms": (
                round(_now_ms() - self._local_ms, 3) if self._local_ms > -math.inf else None
            ),
            "syncs": self.syncs,
            "operations_sent": self.operations_sent,
            "cancelled_reservations": self.cancelled,
        }

    # -- syncing -----------------------------------------------------------------------------
    def _server_tick(self, now_ms: float) -> int:
        return int((now_ms + self._offset_ms) // DECAY_TICK_MS)

    def _learn_offset(self, server_ms: float, sent_ms: float, received_ms: float) -> None:
        sample = (server_ms - received_ms, server_ms - sent_ms)
        self._offsets.append(sample)
        low = max(lo for lo, _ in self._offsets)
        high = min(hi for _, hi in self._offsets)
        if low > high:  # the clocks moved apart (a wall-clock step on the server): start over
            self._offsets.clear()
            self._offsets.append(sample)
            low, high = sample
        self._offset_ms = (low + high) / 2.0

    async def refresh(self, workers: Sequence[str] = ()) -> None:
        """Sync now and wait for it (at start and after a reconnect, before traffic)."""
        await self._synced(list(workers))

    def _request_sync(self) -> None:
        self._wake.set()
        self._urgent.set()

    async def _synced(self, workers: list[str]) -> None:
        """Wait for a sync that starts after this call and reads ``workers``."""
        self._wanted.update(dict.fromkeys(workers))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._request_sync()
        await fut

    def _stopped(self) -> bool:
        """``close()`` was called (read after every await: it can change meanwhile)."""
        return self._closing

    async def _run(self) -> None:
        while not self._stopped():
            await self._wake.wait()
            if self._stopped():
                return
            if not self._urgent.is_set():  # writes only: let a batch form
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await self._urgent.wait()
            refresh = self._urgent.is_set()
            self._wake.clear()
            self._urgent.clear()
            if not (refresh or self._waiters or self._queued):
                continue  # everything queued was cancelled meanwhile
            waiters, self._waiters = self._waiters, []
            self._in_flight = True
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._sync_once()
            except Exception as exc:  # the loop must live on, and no read may wait forever
                if not isinstance(exc, RedisError | OSError | TimeoutError):
                    log.exception("load sync failed")
                for fut in waiters:
                    if not fut.done():
                        fut.set_exception(ConnectionError(f"load sync failed: {exc!r}"))
                if self._stopped():
                    return  # a close cancelled the sync (the error may be the cancellation)
                if self.on_error is not None:
                    self.on_error(exc)
            else:
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)
            finally:
                self._in_flight = False

    async def _sync_once(self) -> None:
        self._in_batch, self._queued = self._queued, _Ops()
        reserves = list(self._in_batch.reserves.values())
        releases = self._in_batch.releases  # every one has its tick
        workers = list(self._wanted)  # every worker the copy holds was wanted once
        keys = [self.redis.key(w) for w in workers]
        index = {w: i + 1 for i, w in enumerate(workers)}

        def key_index(worker: str) -> int:
            if worker not in index:
                keys.append(self.redis.key(worker))
                index[worker] = len(keys)
            return index[worker]

        args: list[Any] = [len(workers), len(reserves), len(releases)]
        for res in reserves:
            args += [key_index(res.worker), repr(float(res.inc_ms))]
        for res in releases:
            args += [key_index(res.worker), repr(float(res.inc_ms)), res.tick]
        sent_ms = _now_ms()
        try:
            reply = await self._sync(keys=keys, args=args)
            server_ms, tick = float(reply[0]), int(reply[1])
        except BaseException:
            # The batch is lost with Redis (a reset follows): its reservations never got a
            # tick, so the releases deferred on them have nothing to undo.
            self._end_batch()
            raise
        received_ms = _now_ms()
        self._rtt_ms = received_ms - sent_ms
        self._learn_offset(server_ms, sent_ms, received_ms)
        self._local_ms = sent_ms
        self._loads = {w: (float(v), tick) for w, v in zip(workers, reply[2:], strict=True)}
        for res in reserves:
            res.tick = tick
        self._end_batch(applied=True)
        self.syncs += 1
        self.operations_sent += len(reserves) + len(releases)

    def _end_batch(self, applied: bool = False) -> None:
        """The batch on the wire is in the copy (or lost); releases deferred on its
        reservations queue with their tick, for the next sync (or are dropped)."""
        self._in_batch = _Ops()
        deferred, self._deferred, self._deferred_ms = self._deferred, [], {}
        if applied:
            for res in deferred:
                self._queued.release(res)

    def _fail_waiters(self, exc: Exception) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(exc)


class FallbackStore:
    """Redis first; the embedded store while Redis is unreachable; never blocks for long."""

    def __init__(
        self, redis_store: RedisStore, timeout_ms: float = 50.0, sync_ms: float = 0.0
    ) -> None:
        self.redis = redis_store
        # sync_ms > 0: the mirror (no round trip per operation); 0: one script per operation.
        self.backend: RedisStore | RedisMirror = (
            RedisMirror(redis_store, sync_ms, on_error=self._degrade)
            if sync_ms > 0
            else redis_store
        )
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

    async def start(self, workers: Sequence[str] = ()) -> None:
        """Warm the Redis connection (and the mirror's copy of ``workers``' loads) before
        serving, with more time than one operation gets; if Redis does not answer, start
        degraded and keep reconnecting."""
        try:
            await asyncio.wait_for(self._warm(workers), max(self.timeout_s, 2.0))
        except (RedisError, OSError, TimeoutError) as exc:
            self._degrade(exc)

    async def _warm(self, workers: Sequence[str]) -> None:
        await self.backend.start()
        if isinstance(self.backend, RedisMirror):
            await self.backend.refresh(workers)

    async def _call(self, op: str, *args: Any) -> Any:
        if not self.degraded:
            try:
                async with asyncio.timeout(self.timeout_s):  # no extra task, unlike wait_for
                    return await getattr(self.backend, op)(*args)
            except (RedisError, OSError, TimeoutError) as exc:
                self._degrade(exc)
        self.fallbacks += 1
        return await getattr(self.embedded, op)(*args)

    def _degrade(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        if not self.degraded:
            self.degraded = True
            self.outages += 1
            if isinstance(self.backend, RedisMirror):
                self.backend.reset()  # what it held or queued may be gone with Redis
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
                await drop_connections(self.redis.client)
                # A restarted Redis has lost the scripts: reload them before traffic returns.
                await asyncio.wait_for(self.backend.start(), max(self.timeout_s, 0.5))
                if isinstance(self.backend, RedisMirror):
                    # Fresh loads before traffic returns, so that no read waits on a busy loop.
                    self.backend.reset()
                    await asyncio.wait_for(self.backend.refresh(), max(self.timeout_s, 0.5))
            except (RedisError, OSError, TimeoutError):
                delay = min(delay * 2, 5.0)
                continue
            self.degraded = False
            log.warning("Redis is back; shared load store restored")

    async def read_many(self, workers: list[str]) -> dict[str, float]:
        mirror = self.backend
        if isinstance(mirror, RedisMirror) and not self.degraded:
            if mirror.must_wait():  # an idle replica's old copy: a fresh one is quick to get
                try:
                    async with asyncio.timeout(self.timeout_s):
                        return await mirror.read_many(workers)
                except TimeoutError:
                    pass  # a busy loop, not an outage (the syncer reports those): use the copy
                except (RedisError, OSError) as exc:
                    self._degrade(exc)
                    self.fallbacks += 1
                    return await self.embedded.read_many(workers)
            return mirror.read_local(workers)  # no I/O on the hot path
        values: dict[str, float] = await self._call("read_many", workers)
        return values

    async def reserve(self, worker: str, inc_ms: float) -> StoreReservation:
        if isinstance(self.backend, RedisMirror) and not self.degraded:
            return await self.backend.reserve(worker, inc_ms)  # queued: never fails
        res: StoreReservation = await self._call("reserve", worker, inc_ms)
        return res

    async def release(self, reservation: StoreReservation) -> None:
        if reservation.store == "embedded":
            await self.embedded.release(reservation)
        elif isinstance(self.backend, RedisMirror):
            if not self.degraded:  # if Redis is gone the reservation decays away there
                await self.backend.release(reservation)  # queued: never fails
        elif not self.degraded:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.timeout_s):
                    await self.backend.release(reservation)

    async def remove(self, worker: str) -> None:
        await self.embedded.remove(worker)
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.backend.remove(worker), self.timeout_s)

    def status(self) -> dict[str, Any]:
        out = {
            "mode": self.mode,
            "redis_connected": not self.degraded,
            "fallback_operations": self.fallbacks,
            "outages": self.outages,
            "last_error": self.last_error,
        }
        if isinstance(self.backend, RedisMirror):
            out |= {k: v for k, v in self.backend.status().items() if k != "mode"}
        return out

    async def close(self) -> None:
        if self._reconnect is not None:
            self._reconnect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnect
        await self.backend.close()


def make_store(
    redis_url: str | None,
    cluster: str,
    timeout_ms: float,
    time_scale: float = 1.0,
    sync_ms: float = 0.0,
) -> LoadStore:
    if not redis_url:
        return EmbeddedStore(time_scale)
    client = connect(
        redis_url,
        socket_connect_timeout=max(timeout_ms / 1000.0, 0.2),
        socket_timeout=max(timeout_ms / 1000.0, 0.2),
        health_check_interval=0,
    )
    return FallbackStore(RedisStore(client, cluster), timeout_ms, sync_ms)
