"""``RedisMirror``: the Redis load store without a round trip per operation, against a real
redis-server. A decision reads a local mirror plus this replica's unsent operations; writes
leave in batches; the server applies them on its own clock with ``routing.load``'s semantics."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from router_harness import RedisServer
from router_harness import redis_tick as server_tick
from router_harness import run_async as run

from router_service.load_store import (
    FallbackStore,
    RedisMirror,
    RedisStore,
    StoreReservation,
    make_store,
)
from router_service.routing.load import DECAY_FACTOR, decayed

W = "http://127.0.0.1:30001"
V = "http://127.0.0.1:30002"
F = DECAY_FACTOR


async def _mirror(
    server: RedisServer, cluster: str, interval_ms: float, max_age_ms: float = 10_000.0
) -> RedisMirror:
    """``max_age_ms`` 0: every read waits for a fresh sync; else reads use the copy."""
    mirror = RedisMirror(
        RedisStore(aioredis.Redis.from_url(server.url), cluster),
        interval_ms,
        max_age_ms=max_age_ms,
        stale_ms=max_age_ms,
    )
    await mirror.start()
    return mirror


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _raw(mirror: RedisMirror, worker: str) -> float | None:
    value = await mirror.redis.client.hget(mirror.redis.key(worker), "v")
    return None if value is None else float(value)


def test_own_operations_show_at_once_and_reach_redis_in_the_next_batch(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        a = await _mirror(redis_server, cluster_name, interval_ms=150)
        b = await _mirror(redis_server, cluster_name, interval_ms=150, max_age_ms=0)
        try:
            assert await a.read_many([W, V]) == {W: 0.0, V: 0.0}  # first read: one sync
            syncs = a.syncs
            res = await a.reserve(W, 100.0)
            assert res.tick == -1  # queued, not sent
            assert (await a.read_many([W, V]))[W] == pytest.approx(100.0)  # no round trip
            assert a.syncs == syncs
            assert await _raw(a, W) is None  # the batch has not left yet
            before = await server_tick(a.redis.client)
            await _until(lambda: res.tick >= 0)
            after = await server_tick(a.redis.client)
            assert before <= res.tick <= after  # applied on the server's clock
            assert await _raw(a, W) == pytest.approx(100.0)
            seen = (await b.read_many([W]))[W]  # another replica: one sync, then the value
            assert 100.0 * F ** (after - res.tick + 2) <= seen <= 100.0

            await a.release(res)
            assert (await a.read_many([W]))[W] == pytest.approx(0.0, abs=1e-9)  # at once
            sent = a.operations_sent
            await _until(lambda: a.operations_sent == sent + 1)
            assert await _raw(a, W) == pytest.approx(0.0, abs=1e-9)
            assert (await b.read_many([W]))[W] == pytest.approx(0.0, abs=1e-9)
        finally:
            await a.close()
            await b.close()

    run(body)


def test_a_reservation_released_before_its_batch_leaves_never_reaches_redis(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=100)
        try:
            await mirror.read_many([W])
            syncs = mirror.syncs
            res = await mirror.reserve(W, 80.0)
            await mirror.release(res)
            assert mirror.status()["cancelled_reservations"] == 1
            await asyncio.sleep(0.3)  # several intervals: nothing was left to send
            assert mirror.syncs == syncs
            assert mirror.operations_sent == 0
            exists = await mirror.redis.client.exists(mirror.redis.key(W))
            assert exists == 0
            await mirror.release(res)  # a second release of it is a no-op
            assert (await mirror.read_many([W]))[W] == 0.0
        finally:
            await mirror.close()

    run(body)


def test_operations_within_an_interval_go_in_one_round_trip(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=200)
        try:
            await mirror.read_many([W, V])
            syncs = mirror.syncs
            held = [await mirror.reserve(W if i % 2 else V, 10.0) for i in range(20)]
            await _until(lambda: mirror.operations_sent == 20)
            assert mirror.syncs == syncs + 1  # twenty reservations, one script call
            assert await _raw(mirror, W) == pytest.approx(100.0)
            assert await _raw(mirror, V) == pytest.approx(100.0)
            for res in held:
                await mirror.release(res)
            await _until(lambda: mirror.operations_sent == 40)
            assert mirror.syncs == syncs + 2
            assert await _raw(mirror, W) == pytest.approx(0.0, abs=1e-6)
        finally:
            await mirror.close()

    run(body)


def test_release_subtracts_the_remainder_decayed_from_the_tick_it_reached_redis(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=5)
        try:
            first = await mirror.reserve(W, 100.0)
            second = await mirror.reserve(W, 50.0)
            await _until(lambda: second.tick >= 0)
            assert first.tick == second.tick  # one batch
            await asyncio.sleep(0.1)
            await mirror.release(first)
            await _until(lambda: mirror.operations_sent == 3)
            value = await _raw(mirror, W)
            now = await server_tick(mirror.redis.client)
            assert value is not None
            # (100 + 50) F^k - 100 F^k = 50 F^k, k = ticks since the batch (one tick slack)
            assert 50.0 * F ** (now - first.tick + 1) <= value <= 50.0 * F ** (now - first.tick - 6)
            assert value < 50.0 * F**3  # the 100 ms sleep is ~5 ticks of decay
        finally:
            await mirror.close()

    run(body)


def test_reads_decay_locally_on_the_servers_clock(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=5)
        try:
            res = await mirror.reserve(W, 100.0)
            await _until(lambda: res.tick >= 0)
            await mirror.read_many([W])
            syncs = mirror.syncs
            await asyncio.sleep(0.2)
            local = (await mirror.read_many([W]))[W]  # max age 10 s: from the mirror
            server = (await mirror.redis.read_many([W]))[W]
            assert mirror.syncs == syncs
            assert local < 100.0 * F**5  # ~10 ticks passed
            assert server * F * 0.999 <= local <= server / F * 1.001  # within a tick
        finally:
            await mirror.close()

    run(body)


def test_a_replica_always_sees_its_own_reservations_even_while_a_batch_is_in_flight(
    redis_server: RedisServer, cluster_name: str
) -> None:
    """Many concurrent requests: each one's read right after its reserve includes it, whether
    it is queued, in the batch on the wire, or applied; all released, the load returns to 0."""

    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=1, max_age_ms=3)
        rng = random.Random(7)
        low: list[float] = []

        async def request(i: int) -> None:
            await asyncio.sleep(rng.random() * 0.2)
            res = await mirror.reserve(W, 1000.0)
            low.append((await mirror.read_many([W]))[W])
            await asyncio.sleep(rng.random() * 0.01)
            await mirror.release(res)

        try:
            await asyncio.gather(*(request(i) for i in range(200)))
            assert min(low) >= 1000.0 * F  # its own reservation, at most a tick decayed
            await _until(lambda: not mirror._queued, 2.0)
            await asyncio.sleep(0.05)
            assert (await mirror.read_many([W]))[W] == pytest.approx(0.0, abs=1e-6)
            assert (await mirror.redis.read_many([W]))[W] == pytest.approx(0.0, abs=1e-6)
            assert mirror.syncs < 400  # fewer round trips than operations
        finally:
            await mirror.close()

    run(body)


def _listed(mirror: RedisMirror, workers: list[str], now_ms: float) -> dict[str, float]:
    """``read_local`` computed the plain way, operation by operation (its sums must agree)."""
    tick = mirror._server_tick(now_ms)
    out = {}
    for w in workers:
        value, at = mirror._loads.get(w, (0.0, tick))
        out[w] = decayed(value, tick - at)
    for res in (*mirror._queued.reserves.values(), *mirror._in_batch.reserves.values()):
        out[res.worker] += res.inc_ms
    for res in (*mirror._queued.releases, *mirror._in_batch.releases):
        out[res.worker] -= decayed(res.inc_ms, tick - res.tick)
    for res in mirror._deferred:  # their reservation is in flight: no tick yet
        out[res.worker] -= res.inc_ms
    return {w: max(0.0, v) for w, v in out.items()}


def test_reads_sum_pending_operations_exactly_as_listing_them_would(
    redis_server: RedisServer, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random reserves, cancellations and releases of queued, in-flight and applied
    reservations, with syncs (some held on the wire by CLIENT PAUSE): at every step the
    per-worker sums give what listing every pending operation gives."""
    import router_service.load_store as load_store

    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=2)
        admin = aioredis.Redis.from_url(redis_server.url)
        rng = random.Random(11)
        live: list[StoreReservation] = []
        compared = deferred_seen = 0
        try:
            await mirror.read_many([W, V])
            for step in range(400):
                roll = rng.random()
                if roll < 0.45 or not live:
                    live.append(await mirror.reserve(rng.choice((W, V)), rng.uniform(1, 500)))
                elif roll < 0.9:
                    await mirror.release(live.pop(rng.randrange(len(live))))
                elif roll < 0.93 and not mirror._in_flight:
                    await admin.client_pause(30, all=False)  # holds the next batch's reply
                else:
                    await asyncio.sleep(rng.random() * 0.01)
                deferred_seen += bool(mirror._deferred)
                now_ms = load_store._now_ms()
                monkeypatch.setattr(load_store, "_now_ms", lambda t=now_ms: t)
                got = mirror.read_local([W, V])
                monkeypatch.undo()
                assert got == pytest.approx(_listed(mirror, [W, V], now_ms), abs=1e-6), step
                compared += 1
            for res in live:
                await mirror.release(res)
            await _until(lambda: not (mirror._queued or mirror._deferred))
            await mirror.refresh()
            assert await mirror.read_many([W, V]) == pytest.approx({W: 0.0, V: 0.0}, abs=1e-6)
            assert await mirror.redis.read_many([W, V]) == pytest.approx({W: 0.0, V: 0.0}, abs=1e-6)
        finally:
            await admin.aclose()
            await mirror.close()
        assert compared == 400
        assert deferred_seen > 0  # the in-flight path was exercised

    run(body)


def test_fallback_with_the_mirror_survives_an_outage_and_reconnects(
    own_redis: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        store = make_store(own_redis.url, cluster_name, 100, sync_ms=5)
        assert isinstance(store, FallbackStore)
        assert isinstance(store.backend, RedisMirror)
        await store.start()
        try:
            before = await store.reserve(W, 100.0)
            assert before.store == "redis"
            await _until(lambda: before.tick >= 0)
            assert store.status()["syncs"] >= 1

            own_redis.stop()
            await asyncio.sleep(0.05)  # the copy is now older than a tick: a read asks to sync
            started = time.monotonic()
            await store.read_many([W])
            assert time.monotonic() - started < 1.0  # never blocks for long
            await _until(lambda: store.mode == "embedded-fallback", 2.0)  # that sync failed
            status = store.status()
            assert status["mode"] == "embedded-fallback"
            assert status["outages"] == 1
            during = await store.reserve(W, 40.0)
            assert during.store == "embedded"
            assert (await store.read_many([W]))[W] == pytest.approx(40.0, rel=0.1)
            await store.release(before)  # Redis is gone: it decays there on its own
            await store.release(during)
            assert (await store.read_many([W]))[W] == pytest.approx(0.0, abs=1e-9)

            own_redis.start()
            await _until(lambda: store.mode == "redis", 10.0)
            after = await store.reserve(W, 25.0)
            assert after.store == "redis"
            await _until(lambda: after.tick >= 0)
            assert (await store.redis.read_many([W]))[W] == pytest.approx(25.0, rel=0.1)
            assert (await store.read_many([W]))[W] == pytest.approx(25.0, rel=0.1)
            assert store.status()["outages"] == 1
        finally:
            await store.close()

    run(body)
    assert own_redis.exists(f"kvroute:{{{cluster_name}}}:load:{W}") == 1


def test_remove_forgets_the_worker_everywhere(redis_server: RedisServer, cluster_name: str) -> None:
    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=5)
        try:
            res = await mirror.reserve(W, 10.0)
            await _until(lambda: res.tick >= 0)
            await mirror.reserve(W, 5.0)  # queued
            await mirror.remove(W)
            assert await mirror.redis.client.exists(mirror.redis.key(W)) == 0
            assert (await mirror.read_many([W]))[W] == 0.0
            await asyncio.sleep(0.05)
            assert await mirror.redis.client.exists(mirror.redis.key(W)) == 0
        finally:
            await mirror.close()

    run(body)


def test_interval_must_be_positive(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    with pytest.raises(ValueError, match="interval_ms"):
        RedisMirror(RedisStore(client, "c"), 0)
    per_operation = make_store(redis_server.url, "c", 50)
    assert isinstance(per_operation, FallbackStore)
    assert isinstance(per_operation.backend, RedisStore)  # sync_ms 0: the old path
    run(per_operation.close)
    run(client.aclose)


def test_a_worker_new_to_the_copy_reads_0_at_once_and_its_load_arrives_with_the_next_sync(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        writer = await _mirror(redis_server, cluster_name, interval_ms=1)
        reader = await _mirror(redis_server, cluster_name, interval_ms=1)
        try:
            res = await writer.reserve(V, 300.0)  # load another replica put on V
            await _until(lambda: res.tick >= 0)
            await reader.read_many([W])  # the reader's copy covers W only
            syncs = reader.syncs
            assert not reader.must_wait()
            assert reader.read_local([W, V])[V] == 0.0  # not waited for: V is new to it
            await _until(lambda: reader.syncs > syncs)  # ...which asked for a sync
            assert 300.0 * F**3 <= reader.read_local([W, V])[V] <= 300.0
        finally:
            await writer.close()
            await reader.close()

    run(body)


def test_the_fallback_store_copies_the_loads_before_serving(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        writer = await _mirror(redis_server, cluster_name, interval_ms=1)
        store = make_store(redis_server.url, cluster_name, 50, sync_ms=5)
        assert isinstance(store, FallbackStore)
        assert isinstance(store.backend, RedisMirror)
        try:
            res = await writer.reserve(W, 200.0)
            await _until(lambda: res.tick >= 0)
            assert store.status()["copy_age_ms"] is None  # nothing copied yet
            await store.start([W, V])
            assert store.status()["syncs"] == 1
            assert 0 <= store.status()["copy_age_ms"] < 1000
            assert not store.backend.must_wait()  # the first request does not wait on Redis
            loads = await store.read_many([W, V])
            after = await server_tick(writer.redis.client)  # decayed by the ticks gone since
            assert 200.0 * F ** (after - res.tick + 2) <= loads[W] <= 200.0
            assert loads[V] == 0.0
        finally:
            await writer.close()
            await store.close()

    run(body)


def test_close_sends_what_is_queued(redis_server: RedisServer, cluster_name: str) -> None:
    """A replica that drains and stops sends its last releases instead of leaving their
    reservations to decay in Redis."""

    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=60_000)
        res = await mirror.reserve(W, 100.0)
        await mirror.refresh()  # sent now; the release below would wait a minute
        assert res.tick >= 0
        await mirror.release(res)
        assert await _raw(mirror, W) == pytest.approx(100.0, rel=0.1)
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            await mirror.close()
            value = await client.hget(mirror.redis.key(W), "v")
            assert value is not None
            assert float(value) == pytest.approx(0.0, abs=1e-9)
        finally:
            await client.aclose()

    run(body)


def test_a_read_waits_for_a_fresh_copy_only_on_a_loop_that_answers_quickly(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        mirror = RedisMirror(
            RedisStore(aioredis.Redis.from_url(redis_server.url), cluster_name), 5.0
        )
        await mirror.start()
        try:
            assert mirror.must_wait()  # no copy yet
            await mirror.read_many([W])
            assert not mirror.must_wait()  # fresh
            await asyncio.sleep(0.05)  # older than a tick, nothing on the wire
            assert mirror._rtt_ms < 10.0  # loopback, idle loop
            assert mirror.must_wait()
            mirror._rtt_ms = 60.0  # as if the last sync had taken 60 ms: a busy loop
            assert not mirror.must_wait()  # use the copy, and ask for a sync
            syncs = mirror.syncs
            assert mirror.read_local([W]) == {W: 0.0}
            await _until(lambda: mirror.syncs > syncs)
        finally:
            await mirror.close()

    run(body)


def test_close_stops_the_sync_loop_even_when_the_client_swallows_the_cancellation(
    redis_server: RedisServer, cluster_name: str
) -> None:
    """redis-py may turn a CancelledError raised mid-command into a connection error; the
    loop must still stop on close() instead of waiting for the next wake-up forever."""

    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=1)
        in_command = asyncio.Event()

        async def stuck_sync(**_: Any) -> Any:
            in_command.set()
            try:
                await asyncio.Event().wait()  # a reply that never comes
            except asyncio.CancelledError:
                raise ConnectionError("connection closed by cancellation") from None

        mirror._sync = stuck_sync  # type: ignore[method-assign,assignment]
        await mirror.reserve(W, 100.0)
        await asyncio.wait_for(in_command.wait(), 5.0)
        task = mirror._task
        assert task is not None
        closing = asyncio.ensure_future(mirror.close())
        done, _ = await asyncio.wait({closing}, timeout=5.0)  # not wait_for: no second cancel
        if not done:  # the bug: clean up, then fail
            task.cancel()
            closing.cancel()
            await asyncio.gather(closing, return_exceptions=True)
        assert closing in done, "close() hung on a sync loop that swallowed its cancellation"
        assert task.done()

    run(body)
