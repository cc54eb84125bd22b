"""Shared prefix knowledge between router replicas, through a Redis stream.

Every replica appends what it routes to ``kvroute:{cluster}:index`` as compact events: the
chained block digests of the prompt (``routing.block_keys``; never text), the worker and the
wall-clock time of the decision. Every replica reads the stream and applies the other
replicas' events to its own prefix index with their original timestamps, so all indexes hold
the same keys with the same recency and the periodic LRU trim removes the same entries
everywhere. Worker registration and removal travel on the same stream. A replica that starts
replays the stream's retained history first, so it joins warm.

Publishing never waits on the request path: events go to a queue that a background task
writes in batches, **one stream entry per batch** (``encode_batch``: the events' operations,
workers, times and block counts as packed arrays, and all their digests concatenated), so a
batch costs one XADD to write and one entry to parse on every replica, and the digests of a
whole batch convert to and from index keys in one vectorised call each. Both directions
coalesce: the publisher waits ``coalesce_s`` (5 ms) after the first queued event, and the
subscriber the same after a read that drained the stream, so that under load one Redis round
trip carries many events instead of one (a round trip costs the replica far more CPU than
applying an event). That adds at most about twice ``coalesce_s`` to the sync lag. While
Redis is unreachable events are dropped (counted); the index then only knows this replica's
own routing until Redis is back.

The stream keeps about ``max_len`` *events* (not entries): the trim length in entries follows
the mean events per entry so far. Entries written one event each by kvroute versions before
batching (fields ``o``, ``w``, ``d``, ``t``) are still applied, so a rolling upgrade keeps the
old replicas' events (the old replicas skip the new batch entries until they are upgraded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from router_service.redis_client import RedisClient, key_prefix
from router_service.routing import Router
from router_service.routing.block_keys import (
    CHARS_PER_BLOCK,
    DIGEST_BYTES,
    digests_to_key,
    key_to_digests,
)

__all__ = ["IndexSync", "decode_batch", "encode_batch"]

log = logging.getLogger("kvroute.index_sync")

_BATCH = 256  # events per stream entry at most
_READ_COUNT = 64  # entries per read: a replay applies at most 64 x 256 events between awaits
_Fields = dict[
    bytes | bytearray | memoryview | str | int | float,
    bytes | bytearray | memoryview | str | int | float,
]
# One routing or membership event: (operation, worker, index key, decision time in ms).
# Operations: "i" insert (the key was sent to the worker), "a" worker added, "x" removed.
Event = tuple[str, str, str, float]


def encode_batch(origin: str, events: list[Event]) -> _Fields:
    """One stream entry's fields for ``events``, in order. Arrays are little endian:
    ``i`` worker index (u2) into ``w`` (newline-separated), ``t`` time in ms (f8), ``n``
    digests of each event (u4); ``ops`` one byte per event; ``d`` every event's digests,
    concatenated (``block_keys`` wire format)."""
    table: dict[str, int] = {}
    ops, index, times, counts, keys = [], [], [], [], []
    for op, worker, key, ts_ms in events:
        if len(key) % CHARS_PER_BLOCK:
            key = key[: len(key) - len(key) % CHARS_PER_BLOCK]
        ops.append(op)
        index.append(table.setdefault(worker, len(table)))
        times.append(ts_ms)
        counts.append(len(key) // CHARS_PER_BLOCK)
        keys.append(key)
    return {
        "r": origin,
        "o": "b",
        "ops": "".join(ops),
        "w": "\n".join(table),
        "i": np.asarray(index, dtype="<u2").tobytes(),
        "t": np.asarray(times, dtype="<f8").tobytes(),
        "n": np.asarray(counts, dtype="<u4").tobytes(),
        "d": key_to_digests("".join(keys)),
    }


def decode_batch(fields: dict[bytes, bytes]) -> list[Event]:
    """The events of an entry ``encode_batch`` wrote; ValueError if it is malformed."""
    try:
        ops = fields[b"ops"].decode()
        workers = fields[b"w"].decode().split("\n")
        index = np.frombuffer(fields[b"i"], dtype="<u2").tolist()
        times = np.frombuffer(fields[b"t"], dtype="<f8").tolist()
        counts = np.frombuffer(fields[b"n"], dtype="<u4").tolist()
        digests = fields[b"d"]
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed index batch: {exc}") from exc
    if not len(ops) == len(index) == len(times) == len(counts):
        raise ValueError("malformed index batch: arrays of different lengths")
    if sum(counts) * DIGEST_BYTES != len(digests) or (index and max(index) >= len(workers)):
        raise ValueError("malformed index batch: digests or workers do not match the events")
    whole = digests_to_key(digests)
    events, pos = [], 0
    for op, w, ts_ms, count in zip(ops, index, times, counts, strict=True):
        end = pos + count * CHARS_PER_BLOCK
        events.append((op, workers[w], whole[pos:end], ts_ms))
        pos = end
    return events


class IndexSync:
    """One replica's publisher and subscriber of the shared index stream."""

    def __init__(
        self,
        client: RedisClient,
        cluster: str,
        replica_id: str,
        router: Router,
        *,
        on_worker_added: Callable[[str], None] | None = None,
        on_worker_removed: Callable[[str], None] | None = None,
        on_lag: Callable[[float], None] | None = None,
        accept_worker: Callable[[str], str | None] | None = None,
        max_len: int = 200_000,
        coalesce_s: float = 0.005,
    ) -> None:
        self.client = client
        self.stream = key_prefix(cluster) + "index"
        self.replica_id = replica_id
        # Events are tagged with this process's own origin, not just the replica id: a replica
        # restarted under the same id must replay what its previous life published.
        self.origin = f"{replica_id}/{secrets.token_hex(4)}"
        self.router = router
        self.on_worker_added = on_worker_added
        self.on_worker_removed = on_worker_removed
        self.on_lag = on_lag
        # Anything in the stream could have been written by anyone with access to Redis: a
        # worker URL is applied only if it passes the checks POST /workers applies (its
        # normalized form, or None to refuse it).
        self.accept_worker = accept_worker or (lambda url: url)
        self.max_len = max_len
        self.coalesce_s = coalesce_s
        self._queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=100_000)
        self.published = self.applied = self.dropped = self.errors = self.replayed = 0
        self.entries_published = 0  # stream entries written (each a batch of events)
        self.malformed = 0  # entries that could not be decoded (skipped)
        self.refused = 0  # events naming a worker the allow-list refuses, or malformed
        self.restarts = 0  # background tasks restarted after an unexpected error
        self.last_error: str | None = None
        self.failing_since: float | None = None  # a task is down and waiting to restart
        # Events decided before this replica started are history it replays, not sync lag.
        self.started_ms = time.time() * 1000.0
        self.last_id = "0-0"
        self.last_lag_s: float | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- publishing (request path: never awaits) -----------------------------------------
    def _put(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1

    def publish_insert(self, worker: str, index_key: str, ts_ms: float) -> None:
        if index_key:  # encoded with its batch, off the request path
            self._put(("i", worker, index_key, ts_ms))

    def publish_worker(self, worker: str, added: bool) -> None:
        self._put(("a" if added else "x", worker, "", time.time() * 1000.0))

    # -- background tasks ------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._supervised(self._publisher), name="index-publish"),
            loop.create_task(self._supervised(self._subscriber), name="index-subscribe"),
        ]

    async def _supervised(self, body: Callable[[], Any]) -> None:
        """Run a background loop; an unexpected error restarts it (logged, counted, shown in
        /health) instead of ending index sync for good while everything looks fine."""
        delay = 0.1
        while True:
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad entry must not stop the sync
                self.restarts += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                self.failing_since = self.failing_since or time.time()
                log.exception("index sync task failed; restarting in %.1f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _publisher(self) -> None:
        while True:
            batch = [await self._queue.get()]
            if self.coalesce_s > 0:
                await asyncio.sleep(self.coalesce_s)
            while len(batch) < _BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                try:
                    await self._send(batch)
                except RedisConnectionError:
                    # A pooled connection that died while idle (Redis restarted): once more,
                    # on a fresh connection. A batch sent twice is harmless: applying an
                    # event again changes nothing.
                    await self._send(batch)
                self.published += len(batch)
            except (RedisError, OSError) as exc:
                self.dropped += len(batch)
                self.errors += 1
                log.debug("index events dropped, Redis unavailable: %s", exc)
                await asyncio.sleep(0.5)

    async def _send(self, batch: list[Event]) -> None:
        # Retain about max_len events: the trim length in entries follows the mean batch.
        mean = (self.published + len(batch)) / (self.entries_published + 1)
        max_entries = max(1, round(self.max_len / mean))
        fields = encode_batch(self.origin, batch)
        await self.client.xadd(self.stream, fields, maxlen=max_entries, approximate=True)
        self.entries_published += 1

    async def _subscriber(self) -> None:
        delay = 0.1
        while True:
            try:
                replies: Any = await self.client.xread(
                    {self.stream: self.last_id}, count=_READ_COUNT, block=1000
                )
            except (RedisError, OSError):
                self.errors += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            self.failing_since = None
            read = 0
            for _stream, entries in replies or ():
                read += len(entries)
                for entry_id, fields in entries:
                    self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    try:
                        self._apply(fields)
                    except (ValueError, TypeError, UnicodeDecodeError, OverflowError) as exc:
                        self.malformed += 1
                        log.warning("index stream entry %s skipped: %s", self.last_id, exc)
            if 0 < read < _READ_COUNT and self.coalesce_s > 0:
                await asyncio.sleep(self.coalesce_s)  # drained: let the next events gather

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        """Apply one stream entry: a batch, or one event of a pre-batching replica."""
        if fields.get(b"r", b"").decode() == self.origin:
            return  # this process's own events: applied when it routed
        op = fields.get(b"o", b"").decode()
        if op == "b":
            try:
                events = decode_batch(fields)
            except ValueError as exc:
                self.malformed += 1
                log.warning("index stream entry skipped: %s", exc)
                return
            now_s = time.time()
            for event in events:
                self._apply_event(*event, now_s)
        else:  # one event per entry, digests per event (kvroute before batching)
            worker = fields.get(b"w", b"").decode()
            key = digests_to_key(fields.get(b"d", b""))
            self._apply_event(op, worker, key, float(fields.get(b"t", b"0")), time.time())

    def _apply_event(self, op: str, worker: str, key: str, ts_ms: float, now_s: float) -> None:
        accepted = self.accept_worker(worker) if op in ("i", "a", "x") else None
        if accepted is None or not math.isfinite(ts_ms):
            self.refused += 1
            if self.refused <= 10 or self.refused % 1000 == 0:
                log.warning(
                    "index stream event refused (%d so far): op %r, worker %r",
                    self.refused,
                    op[:8],
                    worker[:100],
                )
            return
        worker = accepted
        if op == "i":
            self.router.index.insert(key, worker, ts_ms)
            if ts_ms < self.started_ms:
                self.replayed += 1
            else:
                lag_s = max(0.0, now_s - ts_ms / 1000.0)
                self.last_lag_s = lag_s
                if self.on_lag is not None:
                    self.on_lag(lag_s)
        elif op == "x" and self.on_worker_removed is not None:
            self.on_worker_removed(worker)
        elif op == "a" and self.on_worker_added is not None:
            self.on_worker_added(worker)
        self.applied += 1

    def status(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "published": self.published,
            "entries_published": self.entries_published,
            "applied": self.applied,
            "malformed": self.malformed,
            "dropped": self.dropped,
            "errors": self.errors,
            "replayed": self.replayed,
            "refused": self.refused,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "state": "restarting" if self.failing_since is not None else "running",
            "last_lag_s": self.last_lag_s,
            "queued": self._queue.qsize(),
        }
