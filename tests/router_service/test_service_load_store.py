"""The service's load stores against a real redis-server: decay on the server's clock,
decayed-remainder release floored at 0, per-cluster keys, and the embedded fallback.

Redis' clock cannot be moved, so a test that needs ticks to pass moves a key's tick back
instead; the stores' own timers run on a ``ManualClock``."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from manual_clock import ManualClock, until
from router_harness import RedisServer
from router_harness import redis_tick as server_tick
from router_harness import run_async as run

from router_service.load_store import EmbeddedStore, FallbackStore, RedisStore, Ticket, make_store
from router_service.routing.load import DECAY_FACTOR

W = "http://127.0.0.1:30001"
F = DECAY_FACTOR


def _store(server: RedisServer, cluster: str) -> RedisStore:
    return RedisStore(aioredis.Redis.from_url(server.url), cluster)


def test_reservation_carries_the_server_tick(redis_server: RedisServer, cluster_name: str) -> None:
    async def body() -> tuple[int, Ticket, int]:
        store = _store(redis_server, cluster_name)
        try:
            before = await server_tick(store.client)
            res = await store.reserve(W, 100.0)
            after = await server_tick(store.client)
            return before, res, after
        finally:
            await store.close()

    before, res, after = run(body)
    assert before <= res.tick <= after
    assert (res.worker, res.inc_ms, res.store) == (W, 100.0, "redis")


def test_load_decays_by_31_32_per_20ms_tick(redis_server: RedisServer, cluster_name: str) -> None:
    async def body() -> tuple[int, int, int, float]:
        store = _store(redis_server, cluster_name)
        try:
            res = await store.reserve(W, 100.0)
            tick = res.tick - 10  # as if reserved ten ticks (200 ms) ago
            await store.client.hset(store.key(W), "t", tick)
            before = await server_tick(store.client)
            value = (await store.read_many([W]))[W]
            after = await server_tick(store.client)
            return tick, before, after, value
        finally:
            await store.close()

    tick, before, after, value = run(body)
    # Exactly the decay for the ticks the server's clock says passed: ten, and the few that
    # passed meanwhile. 100 * (31/32)^10 ~ 72.8.
    assert 100 * F ** (after - tick) - 1e-9 <= value <= 100 * F ** (before - tick) + 1e-9
    assert before - tick >= 10
    assert value <= 100 * F**10 + 1e-9


def test_release_subtracts_the_decayed_remainder(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> tuple[Ticket, int, int, float]:
        store = _store(redis_server, cluster_name)
        try:
            first = await store.reserve(W, 100.0)
            second = await store.reserve(W, 50.0)
            # As if both had been made five ticks (100 ms) earlier: the key's tick and theirs.
            await store.client.hset(store.key(W), "t", second.tick - 5)
            first.tick -= 5
            second.tick -= 5
            before = await server_tick(store.client)
            await store.release(first)
            value = (await store.read_many([W]))[W]
            after = await server_tick(store.client)
            return second, before, after, value
        finally:
            await store.close()

    second, before, after, value = run(body)
    # What is left is the second reservation, decayed as it would have anyway (the first's
    # undecayed 100 would leave 150 F^k - 100, below these bounds: k is five or more).
    assert (
        50 * F ** (after - second.tick) - 1e-6 <= value <= 50 * F ** (before - second.tick) + 1e-6
    )


def test_release_floors_at_zero(redis_server: RedisServer, cluster_name: str) -> None:
    async def body() -> tuple[float, float, Any]:
        store = _store(redis_server, cluster_name)
        try:
            res = await store.reserve(W, 100.0)
            await store.release(res)
            once = (await store.read_many([W]))[W]
            await store.release(res)  # a double release must not go negative
            twice = (await store.read_many([W]))[W]
            raw = await store.client.hget(store.key(W), "v")
            return once, twice, raw
        finally:
            await store.close()

    once, twice, raw = run(body)
    assert once == pytest.approx(0.0, abs=1e-9)
    assert twice == 0.0
    assert float(raw) == 0.0


def test_release_of_unknown_worker_writes_nothing(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> int:
        store = _store(redis_server, cluster_name)
        try:
            await store.release(Ticket("http://never:1", 10.0, 0, "redis"))
            exists: int = await store.client.exists(store.key("http://never:1"))
            return exists
        finally:
            await store.close()

    assert run(body) == 0


def test_keys_are_namespaced_per_cluster(redis_server: RedisServer, cluster_name: str) -> None:
    async def body() -> tuple[dict[str, float], dict[str, float], list[bytes], int]:
        one, other = _store(redis_server, cluster_name), _store(redis_server, cluster_name + "-2")
        try:
            await one.reserve(W, 80.0)
            seen_by_other = await other.read_many([W, "http://x:1"])
            seen_by_one = await one.read_many([W])
            keys = await one.client.keys(f"kvroute:{{{cluster_name}}}*")
            ttl: int = await one.client.ttl(one.key(W))
            return seen_by_one, seen_by_other, keys, ttl
        finally:
            await one.close()
            await other.close()

    seen_by_one, seen_by_other, keys, ttl = run(body)
    assert seen_by_one[W] > 70
    assert seen_by_other == {W: 0.0, "http://x:1": 0.0}
    assert keys == [f"kvroute:{{{cluster_name}}}:load:{W}".encode()]
    assert 3500 < ttl <= 3600  # idle keys expire


def test_remove_deletes_the_key(redis_server: RedisServer, cluster_name: str) -> None:
    async def body() -> tuple[int, dict[str, float], dict[str, float]]:
        store = _store(redis_server, cluster_name)
        try:
            await store.reserve(W, 10.0)
            await store.remove(W)
            exists: int = await store.client.exists(store.key(W))
            return exists, await store.read_many([W]), await store.read_many([])
        finally:
            await store.close()

    assert run(body) == (0, {W: 0.0}, {})


def test_embedded_store_has_the_same_semantics() -> None:
    async def body() -> tuple[float, float, float, float]:
        clock = ManualClock()
        store = EmbeddedStore(clock=clock)
        res = await store.reserve(W, 100.0)
        fresh = (await store.read_many([W]))[W]
        clock.advance(0.04)
        later = (await store.read_many([W]))[W]
        await store.release(res)
        released = (await store.read_many([W]))[W]
        await store.release(res)
        return fresh, later, released, (await store.read_many([W]))[W]

    fresh, later, released, twice = run(body)
    assert fresh == 100.0
    assert later == pytest.approx(100.0 * F**2)  # two ticks on its clock
    assert released == 0.0
    assert twice == 0.0
    assert EmbeddedStore().status() == {"mode": "embedded"}


def test_make_store_picks_by_url(redis_server: RedisServer) -> None:
    assert isinstance(make_store(None, "c", 50), EmbeddedStore)
    store = make_store(redis_server.url, "c", 50)
    assert isinstance(store, FallbackStore)
    assert store.status()["mode"] == "redis"
    run(store.close)


def test_fallback_store_survives_an_outage_and_reconnects(
    own_redis: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        clock = ManualClock()
        store = make_store(own_redis.url, cluster_name, 100, clock=clock)
        assert isinstance(store, FallbackStore)
        try:
            before = await store.reserve(W, 100.0)
            assert before.store == "redis"
            assert store.status()["redis_connected"] is True

            own_redis.stop()
            started = time.monotonic()
            during = await store.reserve(W, 40.0)
            assert time.monotonic() - started < 1.0  # never blocks for long
            assert during.store == "embedded"
            status = store.status()
            assert status["mode"] == "embedded-fallback"
            assert status["redis_connected"] is False
            assert status["outages"] == 1
            assert status["fallback_operations"] >= 1
            assert status["last_error"]
            # Reads come from the embedded store now; a Redis reservation's release is dropped.
            assert (await store.read_many([W]))[W] == pytest.approx(40.0, rel=0.1)
            await store.release(before)
            await store.release(during)
            assert (await store.read_many([W]))[W] == pytest.approx(0.0, abs=1e-9)

            own_redis.start()
            # The reconnect's backoff runs on the clock: 0.1 s, 0.2 s, 0.4 s, ...
            await until(lambda: store.mode == "redis", 10.0, clock=clock, step_s=0.05)
            after = await store.reserve(W, 25.0)
            assert after.store == "redis"
            assert store.status()["outages"] == 1
            assert (await store.redis.read_many([W]))[W] == pytest.approx(25.0, rel=0.1)
        finally:
            await store.close()

    run(body)
    assert own_redis.exists(f"kvroute:{{{cluster_name}}}:load:{W}") == 1
