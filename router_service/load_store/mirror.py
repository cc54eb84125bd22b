"""``RedisMirror``: the Redis load store without a round trip per operation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from router_service.load_store import scripts
from router_service.load_store.clock import Clock, MonotonicClock
from router_service.load_store.interface import REDIS_FAILURES, Ticket
from router_service.load_store.pending import PendingOps
from router_service.load_store.redis_store import RedisStore
from router_service.routing.load import DECAY_TICK_MS, decayed

__all__ = ["RedisMirror"]

log = logging.getLogger("kvroute.load_store")

# A sync that came back within half a decay tick: the loop is not busy, a read may wait.
_QUICK_SYNC_MS = DECAY_TICK_MS / 2


class RedisMirror:
    """The Redis store without a round trip per operation: reads from a local mirror,
    writes in batches.

    The per-operation store makes three round trips per request, two of them before the
    request can leave (read every worker's load, reserve) and one after (release). Here a
    decision reads a local copy of the loads, decayed to now on the server's clock (estimated
    from the last sync), plus this replica's own operations that the copy does not hold yet;
    reserve and release only queue, and never fail. One script per sync (``scripts.SYNC``)
    applies the queued operations atomically on the server's clock and reads every worker's
    load back, so ``routing.load``'s semantics hold (a release subtracts the remainder decayed
    since the tick its reservation reached Redis at). A reservation released before its batch
    left is cancelled locally and never reaches Redis.

    Syncs run in one background task, one at a time: queued writes wait up to ``interval_ms``
    so that they leave together. A read of a copy older than ``max_age_ms`` (one decay tick)
    asks for a sync. It waits for that sync only if the copy is older than ``stale_ms``, no
    sync is on the wire and the last one came back within half a tick (``must_wait``: a
    replica between requests, whose loop answers at once), and at most ``read_wait_ms`` (the
    fallback store passes the Redis timeout); then it uses the copy: a busy event loop never
    stalls requests on Redis, nor reads as an outage (the syncer's own failures report
    those). Other replicas' operations show after about ``interval_ms`` plus one sync of the
    reader's. A worker new to the copy reads 0 until the sync it asks for. A failed sync fails
    the reads waiting for it and calls ``on_error``; the fallback store then degrades and
    resets the mirror. ``on_read_age`` is called with the copy's age in seconds at every read
    (``kvroute_load_copy_age_seconds``).
    """

    mode = "redis"

    def __init__(
        self,
        redis_store: RedisStore,
        interval_ms: float = 5.0,
        *,
        max_age_ms: float = float(DECAY_TICK_MS),
        stale_ms: float = float(DECAY_TICK_MS),
        read_wait_ms: float | None = None,
        timeout_ms: float = 1000.0,
        on_error: Callable[[BaseException], None] | None = None,
        on_read_age: Callable[[float], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be > 0, got {interval_ms}")
        self.redis = redis_store
        self.interval_s = interval_ms / 1000.0
        self.max_age_ms = max_age_ms
        self.stale_ms = max(stale_ms, max_age_ms)
        self.read_wait_s = read_wait_ms / 1000.0 if read_wait_ms is not None else None
        # Off the request path, so generous: a busy event loop must not read as an outage.
        self.timeout_s = timeout_ms / 1000.0
        self.on_error = on_error
        self.on_read_age = on_read_age
        self._clock = clock or MonotonicClock()
        self._sync = redis_store.client.register_script(scripts.SYNC)
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
        self._loads: dict[str, tuple[float, int]] = {}  # worker -> (value, tick) at last sync
        self._wanted: dict[str, None] = {}  # workers to read back (an ordered set)
        self._offset_ms = 0.0
        self.reset()

    def _now_ms(self) -> float:
        return self._clock.now_s() * 1000.0

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
        self._queued = PendingOps()
        self._in_batch = PendingOps()  # in the sync now in flight
        # Released while their reservation was in flight (its tick comes with the reply):
        # they count undecayed until then, and queue with their tick after it.
        self._deferred: list[Ticket] = []
        self._deferred_ms: dict[str, float] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.redis.start()
        await self.redis.client.script_load(scripts.SYNC)
        if self._task is None or self._task.done():
            self._closing = False
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def refresh(self, workers: Sequence[str] = ()) -> None:
        """Sync now and wait for it (at start and after a reconnect, before traffic)."""
        await self._synced(list(workers))

    async def close(self) -> None:
        """Send what is queued (the releases of requests that ended while draining), then
        stop; if Redis does not take it in time, those loads decay there on their own."""
        task = self._task
        if task is not None:
            if (self._queued or self._deferred) and not task.done():
                with contextlib.suppress(*REDIS_FAILURES):
                    async with self._clock.timeout(self.timeout_s):
                        await self.refresh()
            # The flag stops the loop even if the cancellation is swallowed on the way (the
            # Redis client may turn a CancelledError mid-command into a connection error).
            self._closing = True
            self._wake.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with self._clock.timeout(max(self.timeout_s, 1.0)):
                    await asyncio.wait({task})
            self._task = None
        self._fail_waiters(ConnectionError("load store closed"))
        await self.redis.close()

    # -- operations --------------------------------------------------------------------------
    async def read_many(self, workers: list[str]) -> dict[str, float]:
        """The loads, after a fresh copy if ``must_wait`` (at most ``read_wait_ms``)."""
        if self.must_wait():
            if not workers:
                return {}
            asked_ms = self._now_ms()
            try:
                async with self._clock.timeout(self.read_wait_s):
                    await self._synced(workers)
            except TimeoutError:
                pass  # a busy loop, not an outage (the syncer reports those): use the copy
            else:
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
        if self._now_ms() - self._local_ms <= self.stale_ms or self._in_flight:
            return False
        return self._rtt_ms <= _QUICK_SYNC_MS

    def read_local(self, workers: list[str]) -> dict[str, float]:
        """The loads from the copy; a worker it does not cover yet reads 0 until the sync
        this asks for (a worker just added, whose load is 0 unless others sent to it)."""
        now_ms = self._now_ms()
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

    async def reserve(self, worker: str, inc_ms: float) -> Ticket:
        ticket = Ticket(worker, inc_ms, -1, "redis")
        self._queued.reserve(ticket)
        self._wanted.setdefault(worker)  # read its load back with the batch
        self._wake.set()
        return ticket

    async def release(self, ticket: Ticket) -> None:
        if self._queued.cancel(ticket):
            self.cancelled += 1  # never sent: nothing to undo in Redis
        elif ticket.tick >= 0:  # sent and applied
            self._queued.release(ticket)
            self._wake.set()
        elif id(ticket) in self._in_batch.reserves:  # its tick comes with the reply
            worker = ticket.worker
            self._deferred.append(ticket)
            self._deferred_ms[worker] = self._deferred_ms.get(worker, 0.0) + ticket.inc_ms
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
                round(self._now_ms() - self._local_ms, 3) if self._local_ms > -math.inf else None
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
                    async with self._clock.timeout(self.interval_s):
                        await self._urgent.wait()
            refresh = self._urgent.is_set()
            self._wake.clear()
            self._urgent.clear()
            if not (refresh or self._waiters or self._queued):
                continue  # everything queued was cancelled meanwhile
            waiters, self._waiters = self._waiters, []
            self._in_flight = True
            try:
                async with self._clock.timeout(self.timeout_s):
                    await self._sync_once()
            except Exception as exc:  # the loop must live on, and no read may wait forever
                if not isinstance(exc, REDIS_FAILURES):
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
        self._in_batch, self._queued = self._queued, PendingOps()
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
        for ticket in reserves:
            args += [key_index(ticket.worker), repr(float(ticket.inc_ms))]
        for ticket in releases:
            args += [key_index(ticket.worker), repr(float(ticket.inc_ms)), ticket.tick]
        sent_ms = self._now_ms()
        try:
            reply = await self._sync(keys=keys, args=args)
            server_ms, tick = float(reply[0]), int(reply[1])
        except BaseException:
            # The batch is lost with Redis (a reset follows): its reservations never got a
            # tick, so the releases deferred on them have nothing to undo.
            self._end_batch()
            raise
        received_ms = self._now_ms()
        self._rtt_ms = received_ms - sent_ms
        self._learn_offset(server_ms, sent_ms, received_ms)
        self._local_ms = sent_ms
        self._loads = {w: (float(v), tick) for w, v in zip(workers, reply[2:], strict=True)}
        for ticket in reserves:
            ticket.tick = tick
        self._end_batch(applied=True)
        self.syncs += 1
        self.operations_sent += len(reserves) + len(releases)

    def _end_batch(self, applied: bool = False) -> None:
        """The batch on the wire is in the copy (or lost); releases deferred on its
        reservations queue with their tick, for the next sync (or are dropped)."""
        self._in_batch = PendingOps()
        deferred, self._deferred, self._deferred_ms = self._deferred, [], {}
        if applied:
            for ticket in deferred:
                self._queued.release(ticket)

    def _fail_waiters(self, exc: Exception) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(exc)
