"""Router replicas sharing load through a real redis-server, and surviving its outage."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from fake_worker import FakeWorker
from router_harness import RedisServer, RouterServer, http_client, wait_until


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _queue(router: RouterServer, body: dict[str, Any] | None = None) -> dict[str, float]:
    """Each worker's queue load as this replica reads it now (a dry run)."""
    explained = router.admin.post("/explain", json=body or {"text": "probe"}).json()
    return {c["worker"]: c["queue_ms"] for c in explained["candidates"]}


def _in_background(router: RouterServer, body: dict[str, Any]) -> tuple[threading.Thread, list]:
    out: list[httpx.Response] = []

    def send() -> None:
        with http_client(router.url) as client:
            out.append(client.post("/generate", json=body))

    thread = threading.Thread(target=send)
    thread.start()
    return thread, out


def test_load_reserved_on_one_replica_is_seen_by_another(
    routers: Callable[..., RouterServer],
    workers: Callable[..., FakeWorker],
    redis_server: RedisServer,
    redis_client: redis.Redis,
    cluster_name: str,
) -> None:
    w1, w2 = workers("w1", delay_s=1.0), workers("w2")
    urls = [w1.url, w2.url]
    shared = {"worker_urls": urls, "redis_url": redis_server.url, "cluster": cluster_name}
    shared["policy"] = "lbgr_paper"  # its queue is the shared decayed load
    replica_a = routers(**shared, replica_id="a")
    replica_b = routers(**shared, replica_id="b")
    elsewhere = routers(**{**shared, "cluster": cluster_name + "-other"}, replica_id="c")
    assert replica_b.client.get("/health").json()["store"]["mode"] == "redis"

    thread, out = _in_background(replica_a, {"text": "A" * 400})
    try:
        assert wait_until(lambda: w1.served() == 1)
        # A's reservation reaches Redis with A's next batch (a few ms), then B's copy.
        assert wait_until(lambda: _queue(replica_b)[w1.url] > 50, 1.0, 0.01)
        seen_by_b = _queue(replica_b)
        assert 50 < seen_by_b[w1.url] <= 400  # 400 ms reserved, decaying (half-life 436 ms)
        assert seen_by_b[w2.url] == 0.0
        key = f"kvroute:{{{cluster_name}}}:load:{w1.url}"
        assert float(redis_client.hget(key, "v") or 0) > 50
        # Another cluster shares nothing.
        assert _queue(elsewhere) == {w1.url: 0.0, w2.url: 0.0}
        # And B routes around the load A put on w1.
        resp = replica_b.client.post("/generate", json={"text": "from b"})
        assert resp.headers["X-KVRoute-Worker"] == w2.url
        views = {w["url"]: w for w in replica_b.control.get("/workers").json()["workers"]}
        assert views[w1.url]["queue_ms"] > 50
        assert views[w1.url]["in_flight"] == 0  # in flight on replica A, not B
    finally:
        thread.join(10)
    assert out[0].status_code == 200
    assert out[0].headers["X-KVRoute-Worker"] == w1.url
    # A's release took back the decayed remainder: nothing is left for B to see (once A's
    # next sync sent it and B's copy was refreshed: a few ms, the load mirror's bounded lag).
    assert wait_until(lambda: _queue(replica_b)[w1.url] < 1e-6, 1.0, 0.01)
    after = _queue(replica_b)
    assert after[w1.url] == pytest.approx(0.0, abs=1e-6)
    assert after[w2.url] == pytest.approx(0.0, abs=1e-6)


def test_removed_worker_load_is_dropped_from_redis(
    routers: Callable[..., RouterServer],
    workers: Callable[..., FakeWorker],
    redis_server: RedisServer,
    redis_client: redis.Redis,
    cluster_name: str,
) -> None:
    # Slow enough that the reservation leaves in a batch (an instant request's is cancelled
    # before it is sent, and writes nothing).
    a, b = workers("a", delay_s=0.1), workers("b", delay_s=0.1)
    router = routers(worker_urls=[a.url, b.url], redis_url=redis_server.url, cluster=cluster_name)
    resp = router.client.post("/generate", json={"text": "hello"})
    assert resp.status_code == 200
    chosen = resp.headers["X-KVRoute-Worker"]  # a tie between the idle two: either
    assert chosen in (a.url, b.url)
    key = f"kvroute:{{{cluster_name}}}:load:{chosen}"
    assert redis_client.exists(key) == 1
    assert router.control.delete("/workers", params={"url": chosen}).status_code == 200
    assert redis_client.exists(key) == 0


def test_no_prompt_text_reaches_redis(
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    redis_server: RedisServer,
    redis_client: redis.Redis,
    cluster_name: str,
) -> None:
    marker = "ZEBRA-quux-7731"
    router = routers(
        worker_urls=[w.url for w in two_workers], redis_url=redis_server.url, cluster=cluster_name
    )
    prompt = f"Tell me about {marker} please"
    bodies = [
        ("/generate", {"text": prompt}),
        ("/generate", {"text": prompt, "stream": True}),
        ("/v1/completions", {"model": "m", "prompt": prompt}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}]}),
        ("/explain", {"text": prompt}),
    ]
    for path, body in bodies:
        assert router.client.post(path, json=body).status_code == 200
    # It did write (the load mirror's writes leave in batches, after the answers).
    assert wait_until(lambda: bool(redis_client.keys(f"kvroute:{{{cluster_name}}}:*")))
    for key in redis_client.scan_iter(count=1000):
        assert marker.encode() not in key
        kind = redis_client.type(key)
        if kind == b"hash":
            values = [b for kv in redis_client.hgetall(key).items() for b in kv]
        elif kind == b"string":
            values = [redis_client.get(key) or b""]
        elif kind == b"list":
            values = redis_client.lrange(key, 0, -1)
        elif kind == b"set":
            values = list(redis_client.smembers(key))
        elif kind == b"zset":
            values = [m for m, _ in redis_client.zrange(key, 0, -1, withscores=True)]
        else:
            values = [redis_client.dump(key) or b""]
        for value in values:
            assert marker.encode() not in value, key
        if key.startswith(f"kvroute:{{{cluster_name}}}:".encode()):
            # Load per worker, the shared index stream (block digests), model snapshots.
            allowed = (b"load:http://", b"index", b"models:")
            suffix = key[len(f"kvroute:{{{cluster_name}}}:") :]
            assert suffix.startswith(allowed), key


def _health(router: RouterServer) -> dict[str, Any]:
    body: dict[str, Any] = router.client.get("/health").json()
    return body


def test_redis_outage_falls_back_to_embedded_and_reconnects(
    routers: Callable[..., RouterServer],
    workers: Callable[..., FakeWorker],
    own_redis: RedisServer,
    cluster_name: str,
) -> None:
    slow = [workers("a", delay_s=0.05), workers("b", delay_s=0.05)]  # reservations get sent
    router = routers(
        worker_urls=[w.url for w in slow], redis_url=own_redis.url, cluster=cluster_name
    )
    assert router.client.post("/generate", json={"text": "before"}).status_code == 200
    health = _health(router)
    assert health["status"] == "ok"
    assert health["store"]["mode"] == "redis"
    assert health["store"]["redis_connected"] is True

    own_redis.stop()
    for i in range(6):
        resp = router.client.post("/generate", json={"text": f"during {i}"})
        assert resp.status_code == 200
    resp = router.client.post("/generate", json={"text": "stream during", "stream": True})
    assert resp.status_code == 200
    assert resp.text.endswith("data: [DONE]\n\n")
    health = _health(router)
    assert health["status"] == "degraded"
    assert health["store"]["mode"] == "embedded-fallback"
    assert health["store"]["redis_connected"] is False
    assert health["store"]["outages"] == 1
    assert health["store"]["fallback_operations"] > 0
    assert router.client.get("/health").status_code == 200  # degraded still serves
    metrics = router.control.get("/metrics").text
    assert "kvroute_redis_connected 0.0" in metrics
    assert "kvroute_redis_fallbacks_total 0.0" not in metrics

    own_redis.start()  # same port
    assert wait_until(lambda: _health(router)["status"] == "ok", timeout_s=10, every_s=0.1)
    health = _health(router)
    assert health["store"]["mode"] == "redis"
    assert health["store"]["redis_connected"] is True
    assert router.client.post("/generate", json={"text": "after"}).status_code == 200
    client = redis.Redis.from_url(own_redis.url)
    try:
        assert client.keys(f"kvroute:{{{cluster_name}}}:load:*")  # writing to Redis again
    finally:
        client.close()
    assert "kvroute_redis_connected 1.0" in router.control.get("/metrics").text


def test_router_starts_while_redis_is_down_and_connects_later(
    routers: Callable[..., RouterServer],
    workers: Callable[..., FakeWorker],
    own_redis: RedisServer,
    cluster_name: str,
) -> None:
    own_redis.stop()
    slow = [workers("a", delay_s=0.1), workers("b", delay_s=0.1)]  # reservations get sent
    router = routers(
        worker_urls=[w.url for w in slow], redis_url=own_redis.url, cluster=cluster_name
    )
    assert router.client.post("/generate", json={"text": "early"}).status_code == 200
    assert _health(router)["status"] == "degraded"
    own_redis.start()
    assert wait_until(lambda: _health(router)["store"]["mode"] == "redis", 10, 0.1)
    assert router.client.post("/generate", json={"text": "later"}).status_code == 200
    client = redis.Redis.from_url(own_redis.url)
    try:
        assert client.keys(f"kvroute:{{{cluster_name}}}:load:*")
    finally:
        client.close()


def _metric(router: RouterServer, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", router.control.get("/metrics").text, re.M)
    assert found, name
    return float(found.group(1))


@pytest.mark.parametrize("sync_ms", [5.0, 0.0], ids=["mirror", "round-trips"])
def test_the_load_copys_age_is_measured_per_decision(
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    redis_server: RedisServer,
    cluster_name: str,
    sync_ms: float,
) -> None:
    router = routers(
        worker_urls=[w.url for w in two_workers],
        redis_url=redis_server.url,
        cluster=cluster_name,
        load_sync_ms=sync_ms,
    )
    for i in range(5):
        assert router.client.post("/generate", json={"text": f"age {i}"}).status_code == 200
    count = _metric(router, "kvroute_load_copy_age_seconds_count")
    store = router.client.get("/health").json()["store"]
    if sync_ms:
        assert count == 5  # one read per decision
        assert 0 <= _metric(router, "kvroute_load_copy_age_seconds_sum") / count < 1.0
        assert store["syncs"] >= 1
        assert store["sync_interval_ms"] == 5.0
    else:  # a round trip per read: no copy to age
        assert count == 0
        assert "syncs" not in store
