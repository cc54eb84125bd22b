"""``make_store``: the load store the settings ask for."""

from __future__ import annotations

from collections.abc import Callable

from router_service.load_store.clock import Clock
from router_service.load_store.embedded import EmbeddedStore
from router_service.load_store.fallback import FallbackStore
from router_service.load_store.interface import LoadStore
from router_service.load_store.redis_store import RedisStore
from router_service.redis_client import connect

__all__ = ["make_store"]


def make_store(
    redis_url: str | None,
    cluster: str,
    timeout_ms: float,
    time_scale: float = 1.0,
    sync_ms: float = 0.0,
    *,
    on_read_age: Callable[[float], None] | None = None,
    clock: Clock | None = None,
) -> LoadStore:
    """The embedded store without ``redis_url``; with one, Redis (single, Cluster or
    Sentinel: ``redis_client.connect``) behind a ``FallbackStore``, each operation bounded by
    ``timeout_ms``, through the mirror when ``sync_ms`` > 0."""
    if not redis_url:
        return EmbeddedStore(time_scale, clock=clock)
    client = connect(
        redis_url,
        socket_connect_timeout=max(timeout_ms / 1000.0, 0.2),
        socket_timeout=max(timeout_ms / 1000.0, 0.2),
        health_check_interval=0,
    )
    redis_store = RedisStore(client, cluster, timeout_ms, clock=clock)
    return FallbackStore(redis_store, sync_ms, on_read_age=on_read_age, clock=clock)
