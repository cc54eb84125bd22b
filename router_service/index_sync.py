"""Shared prefix knowledge between router replicas, through a Redis stream.

Every replica appends what it routes to ``kvroute:{cluster}:index`` as compact events: the
chained block digests of the prompt (``routing.block_keys``; never text), the worker and the
wall-clock time of the decision. Every replica reads the stream and applies the other
replicas' events to its own prefix index with their original timestamps, so all indexes hold
the same keys with the same recency and the periodic LRU trim removes the same entries
everywhere. Worker registration and removal travel on the same stream. A replica that starts
replays the stream's retained history first, so it joins warm.

Publishing never waits on the request path: events go to a queue that a background task
writes in pipelined batches. Both directions coalesce: the publisher waits ``coalesce_s``
(5 ms) after the first queued event, and the subscriber the same after a read that drained
the stream, so that under load one Redis round trip carries many events instead of one
(a round trip costs the replica far more CPU than applying an event). That adds at most
about twice ``coalesce_s`` to the sync lag. While Redis is unreachable events are dropped
(counted); the index then only knows this replica's own routing until Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from router_service.routing import Router
from router_service.routing.block_keys import digests_to_key, key_to_digests

__all__ = ["IndexSync"]

log = logging.getLogger("kvroute.index_sync")

_BATCH = 256
_READ_COUNT = 1000
_Event = dict[
    bytes | bytearray | memoryview | str | int | float,
    bytes | bytearray | memoryview | str | int | float,
]


class IndexSync:
    """One replica's publisher and subscriber of the shared index stream."""

    def __init__(
        self,
        client: aioredis.Redis,
        cluster: str,
        replica_id: str,
        router: Router,
        *,
        on_worker_added: Callable[[str], None] | None = None,
        on_worker_removed: Callable[[str], None] | None = None,
        on_lag: Callable[[float], None] | None = None,
        max_len: int = 200_000,
        coalesce_s: float = 0.005,
    ) -> None:
        self.client = client
        self.stream = f"kvroute:{cluster}:index"
        self.replica_id = replica_id
        # Events are tagged with this process's own origin, not just the replica id: a replica
        # restarted under the same id must replay what its previous life published.
        self.origin = f"{replica_id}/{secrets.token_hex(4)}"
        self.router = router
        self.on_worker_added = on_worker_added
        self.on_worker_removed = on_worker_removed
        self.on_lag = on_lag
        self.max_len = max_len
        self.coalesce_s = coalesce_s
        self._queue: asyncio.Queue[_Event] = asyncio.Queue(maxsize=100_000)
        self.published = self.applied = self.dropped = self.errors = self.replayed = 0
        # Events decided before this replica started are history it replays, not sync lag.
        self.started_ms = time.time() * 1000.0
        self.last_id = "0-0"
        self.last_lag_s: float | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- publishing (request path: never awaits) -----------------------------------------
    def _put(self, event: _Event) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1

    def publish_insert(self, worker: str, index_key: str, ts_ms: float) -> None:
        if index_key:
            self._put(
                {
                    "r": self.origin,
                    "o": "i",
                    "w": worker,
                    "d": key_to_digests(index_key),
                    "t": repr(ts_ms),
                }
            )

    def publish_worker(self, worker: str, added: bool) -> None:
        self._put(
            {
                "r": self.origin,
                "o": "a" if added else "x",
                "w": worker,
                "t": repr(time.time() * 1000.0),
            }
        )

    # -- background tasks ------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._publisher(), name="index-publish"),
            loop.create_task(self._subscriber(), name="index-subscribe"),
        ]

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
                    # redis-py does not retry a pipeline on a pooled connection that died
                    # while idle (Redis restarted): once more, on a fresh connection. A batch
                    # sent twice is harmless: applying an event again changes nothing.
                    await self._send(batch)
                self.published += len(batch)
            except (RedisError, OSError) as exc:
                self.dropped += len(batch)
                self.errors += 1
                log.debug("index events dropped, Redis unavailable: %s", exc)
                await asyncio.sleep(0.5)

    async def _send(self, batch: list[_Event]) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for event in batch:
                pipe.xadd(self.stream, event, maxlen=self.max_len, approximate=True)
            await pipe.execute()

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
            read = 0
            for _stream, entries in replies or ():
                read += len(entries)
                for entry_id, fields in entries:
                    self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    self._apply(fields)
            if 0 < read < _READ_COUNT and self.coalesce_s > 0:
                await asyncio.sleep(self.coalesce_s)  # drained: let the next events gather

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"r", b"").decode() == self.origin:
            return  # this process's own event: applied when it routed
        op, worker = fields.get(b"o", b""), fields.get(b"w", b"").decode()
        ts_ms = float(fields.get(b"t", b"0"))
        if op == b"i":
            self.router.index.insert(digests_to_key(fields.get(b"d", b"")), worker, ts_ms)
            if ts_ms < self.started_ms:
                self.replayed += 1
            else:
                lag_s = max(0.0, time.time() - ts_ms / 1000.0)
                self.last_lag_s = lag_s
                if self.on_lag is not None:
                    self.on_lag(lag_s)
        elif op == b"x" and self.on_worker_removed is not None:
            self.on_worker_removed(worker)
        elif op == b"a" and self.on_worker_added is not None:
            self.on_worker_added(worker)
        self.applied += 1

    def status(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "published": self.published,
            "applied": self.applied,
            "dropped": self.dropped,
            "errors": self.errors,
            "replayed": self.replayed,
            "last_lag_s": self.last_lag_s,
            "queued": self._queue.qsize(),
        }
