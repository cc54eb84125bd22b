"""Where a replica's residual models are kept between runs: a file, and Redis.

Models are kept per replica, not merged: each replica learns from the outcomes of the
requests it routed, and River's incremental learners have no general merge. What replicas
share is a starting point: every snapshot is also written to
``kvroute:{cluster}:models:latest`` (and ``...:models:{replica_id}``), and a replica that
starts with no snapshot of its own warm-loads the latest one, so a new or restarted replica
routes with learned residuals from its first request.

Snapshots are signed with a dedicated key (``KVROUTE_MODEL_SNAPSHOT_KEY``) and stored as JSON
(``models.persistence``); one that does not verify is never read. Without a key nothing is
read or written: with Redis, snapshots are off (the start-up log says so); a file path
without a key is refused by the settings.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from redis.exceptions import RedisError

from models import ModelSlot
from models.persistence import SnapshotError, dumps, load, loads, save
from router_service.redis_client import RedisClient, key_prefix

__all__ = ["ModelSnapshots"]

log = logging.getLogger("kvroute.models")


class ModelSnapshots:
    def __init__(
        self,
        path: Path | None,
        client: RedisClient | None,
        cluster: str,
        replica_id: str,
        key: bytes | None,
    ) -> None:
        self.path = path
        self.client = client
        self.prefix = key_prefix(cluster) + "models:"  # both keys in one Redis Cluster slot
        self.replica_id = replica_id
        self.key = key
        self.saved = 0
        self.refused = 0  # snapshots found but not loaded (bad signature, old format, ...)
        self.source: str | None = None

    @property
    def enabled(self) -> bool:
        return self.key is not None and (self.path is not None or self.client is not None)

    def status(self) -> dict[str, object]:
        where = [str(self.path)] if self.path is not None else []
        if self.client is not None:
            where.append(self.prefix + "{latest," + self.replica_id + "}")
        return {
            "enabled": self.enabled,
            "signed": self.key is not None,
            "where": where if self.enabled else [],
            "loaded_from": self.source,
            "saved": self.saved,
            "refused": self.refused,
        }

    async def restore(self) -> ModelSlot | None:
        """This replica's file snapshot, else the cluster's latest in Redis, else None."""
        key = self.key
        if key is None:
            return None
        if self.path is not None and self.path.exists():
            try:
                slot = load(self.path, key)
            except (SnapshotError, OSError) as exc:
                self.refused += 1
                log.warning("ignoring model snapshot %s: %s", self.path, exc)
            else:
                self.source = str(self.path)
                return slot
        if self.client is None:
            return None
        try:
            # Once, at start-up, before serving: worth waiting for a loaded Redis.
            data = await asyncio.wait_for(self.client.get(self.prefix + "latest"), 10.0)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("no model snapshot from Redis: %s", exc)
            return None
        if not isinstance(data, bytes) or not data:
            return None
        try:
            slot = loads(data, key)
        except SnapshotError as exc:
            self.refused += 1
            log.warning("ignoring the cluster's model snapshot: %s", exc)
            return None
        self.source = self.prefix + "latest"
        return slot

    async def save(self, slot: ModelSlot) -> None:
        key = self.key
        if key is None:
            return
        if self.path is not None:
            try:
                save(slot, self.path, key)
            except OSError as exc:
                log.warning("model snapshot to %s failed: %s", self.path, exc)
        if self.client is not None:
            data = dumps(slot, key)
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.set(self.prefix + self.replica_id, data, ex=7 * 24 * 3600)
                    pipe.set(self.prefix + "latest", data, ex=7 * 24 * 3600)
                    await asyncio.wait_for(pipe.execute(), 2.0)
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("model snapshot to Redis failed: %s", exc)
                return
        self.saved += 1
