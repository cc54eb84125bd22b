"""Decayed queue load for the service: embedded, Redis, and Redis with embedded fallback.

The semantics of ``routing.load`` (a load in ms per worker that decays by 31/32 every 20 ms,
reservations and decayed-remainder releases) behind one async interface
(``interface.LoadStore``), in four stores:

- ``EmbeddedStore`` (``embedded``): in process, one replica, no set-up.
- ``RedisStore`` (``redis_store``): shared by all replicas, one Lua script per operation
  (``scripts``: the keys ``kvroute:{cluster}:load:{worker}``, on the server's clock).
- ``RedisMirror`` (``mirror``): the same keys and semantics without a round trip per
  operation: decisions read a local copy, writes leave in batches (the service's default,
  ``load_sync_ms`` 5; 0 uses ``RedisStore`` directly).
- ``FallbackStore`` (``fallback``): Redis (either of the two above, the ``SharedStore``
  interface) while it answers within a small timeout; otherwise the embedded store, counted
  and reported in ``/health``, while a background task reconnects with backoff.

``make_store`` builds the one the settings ask for. Every store takes a ``Clock``.
"""

from router_service.load_store.clock import Clock, MonotonicClock
from router_service.load_store.embedded import EmbeddedStore
from router_service.load_store.factory import make_store
from router_service.load_store.fallback import FallbackStore
from router_service.load_store.interface import (
    REDIS_FAILURES,
    LoadOperations,
    LoadStore,
    SharedStore,
    Ticket,
)
from router_service.load_store.mirror import RedisMirror
from router_service.load_store.redis_store import RedisStore

__all__ = [
    "REDIS_FAILURES",
    "Clock",
    "EmbeddedStore",
    "FallbackStore",
    "LoadOperations",
    "LoadStore",
    "MonotonicClock",
    "RedisMirror",
    "RedisStore",
    "SharedStore",
    "Ticket",
    "make_store",
]
