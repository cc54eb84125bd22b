"""``RedisMirror``: the Redis load store without a round trip per operation, against a real
redis-server. A decision reads a local mirror plus this replica's unsent operations; writes
leave in batches; the server applies them on its own clock with ``routing.load``'s semantics.

The mirror's own time (batching interval, the copy's age, the local decay) runs on a
``ManualClock`` that the tests advance; only Redis' answers are waited for."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from manual_clock import ManualClock, until
from router_harness import RedisServer
from router_harness import redis_tick as server_tick
from router_harness import run_async as run

from router_service.load_store import (
    Clock,
    FallbackStore,
    MonotonicClock,
    RedisMirror,
    RedisStore,
    Ticket,
    make_store,
)
from router_service.routing.load import DECAY_FACTOR, decayed

W = "http://127.0.0.1:30001"
V = "http://127.0.0.1:30002"
F = DECAY_FACTOR
EXACT = 1e-9  # relative: Redis keeps a load as 14 significant digits


async def _mirror(
    server: RedisServer,
    cluster: str,
    interval_ms: float,
    max_age_ms: float = 10_000.0,
    clock: Clock | None = None,
) -> RedisMirror:
    """``max_age_ms`` 0: every read waits for a fresh sync; else reads use the copy."""
    mirror = RedisMirror(
        RedisStore(aioredis.Redis.from_url(server.url), cluster),
        interval_ms,
        max_age_ms=max_age_ms,
        stale_ms=max_age_ms,
        clock=clock,
    )
    await mirror.start()
    return mirror


async def _let_the_batch_leave(mirror: RedisMirror, clock: ManualClock) -> None:
    """Pass the batching interval once the sync loop waits in it (a timer, no sync on the
    wire)."""
    await until(lambda: clock.timers > 0 and not mirror._in_flight)
    clock.advance(mirror.interval_s)


async def _raw(mirror: RedisMirror, worker: str) -> float | None:
    value = await mirror.redis.client.hget(mirror.redis.key(worker), "v")
    return None if value is None else float(value)


def test_own_operations_show_at_once_and_reach_redis_in_the_next_batch(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        clock = ManualClock()
        a = await _mirror(redis_server, cluster_name, interval_ms=150, clock=clock)
        b = await _mirror(redis_server, cluster_name, interval_ms=150, clock=ManualClock())
        client = a.redis.client
        try:
            assert await a.read_many([W, V]) == {W: 0.0, V: 0.0}  # first read: one sync
            syncs = a.syncs
            res = await a.reserve(W, 100.0)
            assert res.tick == -1  # queued, not sent
            assert (await a.read_many([W, V]))[W] == pytest.approx(100.0)  # no round trip
            assert a.syncs == syncs
            await until(lambda: clock.timers > 0)  # the batch waits for its interval...
            clock.advance(0.149)
            assert await _raw(a, W) is None  # ...which has not passed yet
            before = await server_tick(client)
            clock.advance(0.002)
            await until(lambda: res.tick >= 0)
            after = await server_tick(client)
            assert a.syncs == syncs + 1
            assert before <= res.tick <= after  # applied on the server's clock
            assert await _raw(a, W) == pytest.approx(100.0)
            await b.refresh([W])  # another replica: one sync, then the value
            seen = b.read_local([W])[W]
            after = await server_tick(client)
            assert 100.0 * F ** (after - res.tick) * (1 - EXACT) <= seen <= 100.0

            await a.release(res)
            assert (await a.read_many([W]))[W] == pytest.approx(0.0, abs=1e-9)  # at once
            sent = a.operations_sent
            await _let_the_batch_leave(a, clock)
            await until(lambda: a.operations_sent == sent + 1)
            assert await _raw(a, W) == pytest.approx(0.0, abs=1e-9)
            await b.refresh([W])
            assert b.read_local([W])[W] == pytest.approx(0.0, abs=1e-9)
        finally:
            await a.close()
            await b.close()

    run(body)


def test_a_reservation_released_before_its_batch_leaves_never_reaches_redis(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        clock = ManualClock()
        mirror = await _mirror(redis_server, cluster_name, interval_ms=100, clock=clock)
        try:
            await mirror.read_many([W])
            syncs = mirror.syncs
            res = await mirror.reserve(W, 80.0)
            await mirror.release(res)
            assert mirror.status()["cancelled_reservations"] == 1
            await _let_the_batch_leave(mirror, clock)
            # The loop looked at the batch, found nothing left to send, and sleeps again.
            await until(lambda: not mirror._wake.is_set() and clock.timers == 0)
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
        clock = ManualClock()
        mirror = await _mirror(redis_server, cluster_name, interval_ms=200, clock=clock)
        try:
            await mirror.read_many([W, V])
            syncs = mirror.syncs
            held = [await mirror.reserve(W if i % 2 else V, 10.0) for i in range(20)]
            await _let_the_batch_leave(mirror, clock)
            await until(lambda: mirror.operations_sent == 20)
            assert mirror.syncs == syncs + 1  # twenty reservations, one script call
            assert await _raw(mirror, W) == pytest.approx(100.0)
            assert await _raw(mirror, V) == pytest.approx(100.0)
            for res in held:
                await mirror.release(res)
            await _let_the_batch_leave(mirror, clock)
            await until(lambda: mirror.operations_sent == 40)
            assert mirror.syncs == syncs + 2
            assert await _raw(mirror, W) == pytest.approx(0.0, abs=1e-6)
        finally:
            await mirror.close()

    run(body)


def test_release_subtracts_the_remainder_decayed_from_the_tick_it_reached_redis(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=5, clock=ManualClock())
        client = mirror.redis.client
        try:
            first = await mirror.reserve(W, 100.0)
            second = await mirror.reserve(W, 50.0)
            await mirror.refresh()  # the batch leaves now
            assert first.tick == second.tick >= 0  # one batch
            # As if that batch had reached Redis five ticks ago: the key's tick and theirs.
            await client.hset(mirror.redis.key(W), "t", first.tick - 5)
            first.tick -= 5
            before = await server_tick(client)
            await mirror.release(first)
            await mirror.refresh()
            after = await server_tick(client)
            value = await _raw(mirror, W)
            assert value is not None
            # (100 + 50) F^k - 100 F^k = 50 F^k, k = ticks since the batch (five or more; the
            # undecayed 100 would leave 150 F^k - 100, below these bounds).
            at = first.tick
            low, high = 50.0 * F ** (after - at), 50.0 * F ** (before - at)
            assert low * (1 - EXACT) <= value <= high * (1 + EXACT)
        finally:
            await mirror.close()

    run(body)


def test_reads_decay_locally_on_the_servers_clock(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        clock = ManualClock()
        mirror = await _mirror(redis_server, cluster_name, interval_ms=5, clock=clock)
        try:
            res = await mirror.reserve(W, 100.0)
            await mirror.refresh()
            # The copy's clock reads the server's tick (the sync took no time on this clock).
            assert mirror._server_tick(clock.now_s() * 1000.0) == res.tick
            syncs = mirror.syncs
            clock.advance(0.2)  # ten ticks
            local = (await mirror.read_many([W]))[W]  # max age 10 s: from the mirror
            assert mirror.syncs == syncs
            assert local == pytest.approx(100.0 * F**10, rel=EXACT)
        finally:
            await mirror.close()

    run(body)


def test_a_replica_always_sees_its_own_reservations_even_while_a_batch_is_in_flight(
    redis_server: RedisServer, cluster_name: str
) -> None:
    """Many concurrent requests at random times (real ones: the batches race the requests):
    each one's read right after its reserve includes it, whether it is queued, in the batch on
    the wire, or applied; all released, the load returns to 0."""

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
            await mirror.refresh()  # after the batch on the wire: every release is applied
            assert not mirror._queued
            assert not mirror._in_batch
            assert not mirror._deferred
            assert (await mirror.read_many([W]))[W] == pytest.approx(0.0, abs=1e-6)
            assert (await mirror.redis.read_many([W]))[W] == pytest.approx(0.0, abs=1e-6)
            assert mirror.syncs < 400  # fewer round trips than operations
        finally:
            await mirror.close()

    run(body)


class _HeldClock(MonotonicClock):
    """The monotonic clock, held still while a test compares two reads."""

    held_s: float | None = None

    def now_s(self) -> float:
        return self.held_s if self.held_s is not None else super().now_s()


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
    redis_server: RedisServer, cluster_name: str
) -> None:
    """Random reserves, cancellations and releases of queued, in-flight and applied
    reservations, with syncs (some held on the wire by CLIENT PAUSE, and random pauses of the
    sequence, so that batches leave and come back at random points of it): at every step the
    per-worker sums give what listing every pending operation gives."""

    async def body() -> None:
        clock = _HeldClock()
        mirror = await _mirror(redis_server, cluster_name, interval_ms=2, clock=clock)
        admin = aioredis.Redis.from_url(redis_server.url)
        rng = random.Random(11)
        live: list[Ticket] = []
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
                clock.held_s = clock.now_s()
                got = mirror.read_local([W, V])
                expected = _listed(mirror, [W, V], clock.held_s * 1000.0)
                clock.held_s = None
                assert got == pytest.approx(expected, abs=1e-6), step
                compared += 1
            for res in live:
                await mirror.release(res)
            await mirror.refresh()  # after the batch on the wire: every release is applied
            assert not mirror._queued
            assert not mirror._in_batch
            assert not mirror._deferred
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
        clock = ManualClock()
        store = make_store(own_redis.url, cluster_name, 100, sync_ms=5, clock=clock)
        assert isinstance(store, FallbackStore)
        assert isinstance(store.backend, RedisMirror)
        await store.start()
        try:
            before = await store.reserve(W, 100.0)
            assert before.store == "redis"
            await until(lambda: before.tick >= 0, clock=clock)
            assert store.status()["syncs"] >= 1

            own_redis.stop()
            clock.advance(0.05)  # the copy is now older than a tick: a read asks to sync
            started = time.monotonic()
            await store.read_many([W])
            assert time.monotonic() - started < 1.0  # never blocks for long
            await until(lambda: store.mode == "embedded-fallback", 2.0)  # that sync failed
            status = store.status()
            assert status["mode"] == "embedded-fallback"
            assert status["outages"] == 1
            during = await store.reserve(W, 40.0)
            assert during.store == "embedded"
            assert (await store.read_many([W]))[W] == 40.0  # no time passed on the clock
            await store.release(before)  # Redis is gone: it decays there on its own
            await store.release(during)
            assert (await store.read_many([W]))[W] == pytest.approx(0.0, abs=1e-9)

            own_redis.start()
            # The reconnect's backoff runs on the clock: 0.1 s, 0.2 s, 0.4 s, ...
            await until(lambda: store.mode == "redis", 10.0, clock=clock, step_s=0.05)
            after = await store.reserve(W, 25.0)
            assert after.store == "redis"
            await until(lambda: after.tick >= 0, clock=clock)
            assert (await store.redis.read_many([W]))[W] == pytest.approx(25.0, rel=0.1)
            assert (await store.read_many([W]))[W] == pytest.approx(25.0, rel=0.1)
            assert store.status()["outages"] == 1
        finally:
            await store.close()

    run(body)
    assert own_redis.exists(f"kvroute:{{{cluster_name}}}:load:{W}") == 1


def test_remove_forgets_the_worker_everywhere(redis_server: RedisServer, cluster_name: str) -> None:
    async def body() -> None:
        mirror = await _mirror(redis_server, cluster_name, interval_ms=5, clock=ManualClock())
        try:
            await mirror.reserve(W, 10.0)
            await mirror.refresh()
            await mirror.reserve(W, 5.0)  # queued
            await mirror.remove(W)
            assert await mirror.redis.client.exists(mirror.redis.key(W)) == 0
            assert (await mirror.read_many([W]))[W] == 0.0
            await mirror.refresh()  # a sync: the queued reservation is not in it
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
    assert isinstance(per_operation.backend, RedisStore)  # sync_ms 0: a script per operation
    run(per_operation.close)
    run(client.aclose)


def test_the_fallback_store_refuses_an_unbounded_redis_store(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    with pytest.raises(ValueError, match="timeout_ms"):
        FallbackStore(RedisStore(client, "c"), sync_ms=5)
    run(client.aclose)


def test_a_worker_new_to_the_copy_reads_0_at_once_and_its_load_arrives_with_the_next_sync(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        writer = await _mirror(redis_server, cluster_name, interval_ms=1, clock=ManualClock())
        reader = await _mirror(redis_server, cluster_name, interval_ms=1, clock=ManualClock())
        try:
            res = await writer.reserve(V, 300.0)  # load another replica put on V
            await writer.refresh()
            await reader.read_many([W])  # the reader's copy covers W only
            syncs = reader.syncs
            assert not reader.must_wait()
            assert reader.read_local([W, V])[V] == 0.0  # not waited for: V is new to it
            await until(lambda: reader.syncs > syncs)  # ...which asked for a sync
            after = await server_tick(writer.redis.client)
            value = reader.read_local([W, V])[V]
            assert 300.0 * F ** (after - res.tick) * (1 - EXACT) <= value <= 300.0
        finally:
            await writer.close()
            await reader.close()

    run(body)


def test_the_fallback_store_copies_the_loads_before_serving(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        writer = await _mirror(redis_server, cluster_name, interval_ms=1, clock=ManualClock())
        store = make_store(redis_server.url, cluster_name, 50, sync_ms=5, clock=ManualClock())
        assert isinstance(store, FallbackStore)
        assert isinstance(store.backend, RedisMirror)
        try:
            res = await writer.reserve(W, 200.0)
            await writer.refresh()
            assert store.status()["copy_age_ms"] is None  # nothing copied yet
            await store.start([W, V])
            assert store.status()["syncs"] == 1
            assert store.status()["copy_age_ms"] == 0.0  # no time passed on its clock
            assert not store.backend.must_wait()  # the first request does not wait on Redis
            loads = await store.read_many([W, V])
            after = await server_tick(writer.redis.client)  # decayed by the ticks gone since
            assert 200.0 * F ** (after - res.tick) * (1 - EXACT) <= loads[W] <= 200.0
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
        clock = ManualClock()
        mirror = RedisMirror(
            RedisStore(aioredis.Redis.from_url(redis_server.url), cluster_name), 5.0, clock=clock
        )
        await mirror.start()
        try:
            assert mirror.must_wait()  # no copy yet
            await mirror.read_many([W])
            assert not mirror.must_wait()  # fresh
            clock.advance(0.02)
            assert not mirror.must_wait()  # a tick old: still fresh enough
            clock.advance(0.03)  # older than a tick, nothing on the wire
            assert mirror._rtt_ms == 0.0  # the sync took no time on this clock
            assert mirror.must_wait()
            mirror._rtt_ms = 60.0  # as if the last sync had taken 60 ms: a busy loop
            assert not mirror.must_wait()  # use the copy, and ask for a sync
            syncs = mirror.syncs
            assert mirror.read_local([W]) == {W: 0.0}
            await until(lambda: mirror.syncs > syncs)
        finally:
            await mirror.close()

    run(body)


def _stick_syncs(mirror: RedisMirror) -> asyncio.Event:
    """From now on the mirror's syncs never get a reply; the event is set once one is sent.

    Cancelled, the stuck command raises a connection error, as redis-py may."""
    in_command = asyncio.Event()

    async def stuck_sync(**_: Any) -> Any:
        in_command.set()
        try:
            await asyncio.Event().wait()  # a reply that never comes
        except asyncio.CancelledError:
            raise ConnectionError("connection closed by cancellation") from None

    mirror._sync = stuck_sync  # type: ignore[method-assign,assignment]
    return in_command


def test_a_waiting_read_uses_the_copy_after_read_wait_ms(
    redis_server: RedisServer, cluster_name: str
) -> None:
    """A read that waits for a fresh copy waits at most ``read_wait_ms`` (the Redis timeout,
    in the fallback store), then answers from the copy: a slow sync is no outage."""

    async def body() -> None:
        clock = ManualClock()
        store = RedisStore(aioredis.Redis.from_url(redis_server.url), cluster_name)
        mirror = RedisMirror(store, 5.0, read_wait_ms=50.0, clock=clock)
        await mirror.start()
        try:
            await mirror.read_many([W])
            in_command = _stick_syncs(mirror)
            clock.advance(0.03)  # older than a tick
            read = asyncio.ensure_future(mirror.read_many([W]))
            await asyncio.wait_for(in_command.wait(), 5.0)
            clock.advance(0.049)
            await asyncio.sleep(0)  # (a timer due now would fire here)
            assert not read.done()
            clock.advance(0.002)
            assert await asyncio.wait_for(read, 5.0) == {W: 0.0}
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
        in_command = _stick_syncs(mirror)
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
