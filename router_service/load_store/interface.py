"""What the service asks of a load store, and what a store hands out for a reservation.

Two layers, one set of operations (``LoadOperations``):

- ``LoadStore``: what the service holds (``ServiceState.store``): ``EmbeddedStore``, or
  ``FallbackStore`` (Redis with the embedded store behind it). Its operations never fail.
- ``SharedStore``: the Redis side a ``FallbackStore`` drives: ``RedisStore`` (one script per
  operation) or ``RedisMirror`` (a local copy, writes in batches). Its operations raise one
  of ``REDIS_FAILURES`` when Redis fails or is too slow, and the fallback store turns that
  into an outage: counted, served embedded, reconnected in the background.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from redis.exceptions import RedisError

__all__ = ["REDIS_FAILURES", "LoadOperations", "LoadStore", "SharedStore", "Ticket"]

# What a shared store raises when Redis is gone or too slow (a cluster's own failures
# arrive as RedisError too: redis_client.ClusterClient).
REDIS_FAILURES = (RedisError, OSError, TimeoutError)


@dataclass(slots=True)
class Ticket:
    """A reservation as a store hands it out, to give back to ``release``.

    The routing core's ``Reservation`` plus which store holds it (released where it was
    made). ``tick`` is the decay tick it was added at; ``RedisMirror`` queues reservations
    and fills it in when their batch reaches Redis (``-1`` until then).
    """

    worker: str
    inc_ms: float
    tick: int
    store: Literal["embedded", "redis"]


class LoadOperations(Protocol):
    """Decayed queue load per worker (ms), the semantics of ``routing.load``."""

    async def read_many(self, workers: list[str]) -> dict[str, float]: ...

    async def reserve(self, worker: str, inc_ms: float) -> Ticket: ...

    async def release(self, ticket: Ticket) -> None: ...

    async def remove(self, worker: str) -> None: ...

    def status(self) -> dict[str, Any]:
        """The store's figures for ``/health`` (``store``) and ``/metrics``."""
        ...

    async def close(self) -> None: ...


class LoadStore(LoadOperations, Protocol):
    """The service's store: operations never fail; ``mode`` names what serves them now."""

    @property
    def mode(self) -> str: ...

    async def start(self, workers: Sequence[str] = ()) -> None:
        """Connect and copy ``workers``' loads before serving (nothing to do embedded)."""
        ...


class SharedStore(LoadOperations, Protocol):
    """A store shared through Redis; its operations raise ``REDIS_FAILURES``."""

    async def start(self) -> None:
        """Connect and load the scripts (again after a reconnect: a restarted Redis has
        lost them)."""
        ...

    async def refresh(self, workers: Sequence[str] = ()) -> None:
        """Bring whatever the store reads locally up to date, ``workers`` included, and
        wait for it (before traffic: at start and after a reconnect)."""
        ...

    def reset(self) -> None:
        """Redis was lost: drop what is queued for it, mark what was copied stale."""
        ...
