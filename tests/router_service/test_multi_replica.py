"""Several router replicas sharing one real redis-server: prefix index, workers, load, models.

Replicas are separate apps (each on its own uvicorn server and event loop) with the same
``redis_url`` and ``cluster`` and different replica ids; the one killed with SIGKILL is a real
``python -m kvroute serve`` process. Index events travel asynchronously, so what one replica
routed is polled for on another within a bounded wait (``SYNC_WAIT_S``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from fake_worker import FakeWorker
from router_harness import RedisServer, RouterServer, http_client, wait_until

from router_service.routing import IndexSettings
from sim.local_cluster import free_port, wait_healthy

SYNC_WAIT_S = 2.0  # the bounded lag the index sync must keep on loopback
BLOCK = 16  # Settings.index_block_units' default: matches are whole blocks of 16 units

Replicas = Callable[..., list[RouterServer]]
SNAPSHOT_KEY = "multi-replica-snapshot-key"


def _prompt(tag: str, length: int = 320) -> str:
    """A prompt of ``length`` characters that shares no block with another tag's."""
    return (f"<{tag}> " + f"{tag} is a distinct prefix. " * (length // 10 + 1))[:length]


def _explain(router: RouterServer, prompt: str) -> dict[str, Any]:
    resp = router.admin.post("/explain", json={"text": prompt})
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def _cached(router: RouterServer, prompt: str) -> dict[str, int]:
    return {c["worker"]: c["cached"] for c in _explain(router, prompt)["candidates"]}


def _queue(router: RouterServer) -> dict[str, float]:
    return {c["worker"]: c["queue_ms"] for c in _explain(router, "probe")["candidates"]}


def _route(router: RouterServer, prompt: str) -> str:
    resp = router.client.post("/generate", json={"text": prompt})
    assert resp.status_code == 200, resp.text
    return resp.headers["X-KVRoute-Worker"]


def _workers(router: RouterServer) -> dict[str, dict[str, Any]]:
    return {w["url"]: w for w in router.control.get("/workers").json()["workers"]}


def _health(router: RouterServer) -> dict[str, Any]:
    body: dict[str, Any] = router.client.get("/health").json()
    return body


def _lag_count(router: RouterServer) -> float:
    found = re.search(
        r"^kvroute_index_sync_lag_seconds_count (\S+)$", router.control.get("/metrics").text, re.M
    )
    assert found is not None
    return float(found.group(1))


def _applied(router: RouterServer, events: int) -> bool:
    return bool(_health(router)["index_sync"]["applied"] == events)


def _published(router: RouterServer, events: int) -> bool:
    """Publishing coalesces for a few milliseconds: the count follows the routing shortly."""
    return bool(_health(router)["index_sync"]["published"] == events)


def _sees_cached(router: RouterServer, prompt: str, worker: str, units: int) -> bool:
    return _cached(router, prompt).get(worker, 0) == units


@pytest.fixture
def cluster_name(cluster_name: str) -> str:
    """Unique per test: the shared fixture cuts test names short, so both parametrizations of
    a test would share one stream and the second would replay the first's events."""
    return f"{cluster_name}-{secrets.token_hex(3)}"


@pytest.fixture
def replicas(routers: Callable[..., RouterServer], cluster_name: str) -> Replicas:
    """``replicas(n, redis_url, worker_urls=..., first="a", **settings)``: replicas named
    ``first``, the next letter, ... of one cluster, sharing one Redis."""

    def make(n: int, redis_url: str, first: str = "a", **settings: Any) -> list[RouterServer]:
        # lbgr_paper: its queue is the shared decayed load these tests watch (lbgr's default
        # estimate counts other replicas' load through the workers' /metrics instead).
        policy = {"policy": "lbgr_paper"}
        shared = {"redis_url": redis_url, "cluster": cluster_name, **policy, **settings}
        return [routers(**shared, replica_id=chr(ord(first) + i)) for i in range(n)]

    return make


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


# -- the shared prefix index -----------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_what_one_replica_routes_every_other_replica_sees_cached(
    n: int,
    replicas: Replicas,
    two_workers: tuple[FakeWorker, FakeWorker],
    redis_server: RedisServer,
) -> None:
    urls = [w.url for w in two_workers]
    fleet = replicas(n, redis_server.url, worker_urls=urls)
    chosen: dict[str, str] = {}
    for router in fleet:
        tag = router.settings.replica_id or ""
        chosen[tag] = _route(router, _prompt(tag))
    for source in fleet:
        tag = source.settings.replica_id or ""
        prompt, worker = _prompt(tag), chosen[tag]
        (other,) = (u for u in urls if u != worker)
        for router in fleet:
            if router is source:
                continue
            # Seen as cached on the worker the source chose, whole blocks only, within the wait.
            seen = functools.partial(_sees_cached, router, prompt, worker, 320)
            assert wait_until(seen, SYNC_WAIT_S)
            assert _cached(router, prompt)[other] == 0
            # A longer prompt with the same start matches the shared blocks, not the tail.
            assert _cached(router, prompt + " and a follow-up")[worker] == 320
            assert _cached(router, prompt[:200] + "different")[worker] == 200 // BLOCK * BLOCK
            # And the replica routes the prompt to the worker that holds it.
            assert _route(router, prompt) == worker
    for router in fleet:
        # n * n routings: each replica published its n and applies the others' n * (n - 1).
        assert wait_until(functools.partial(_applied, router, n * (n - 1)), SYNC_WAIT_S)
        assert wait_until(functools.partial(_published, router, n), SYNC_WAIT_S)
        sync = _health(router)["index_sync"]
        assert sync["dropped"] == 0
        assert 0 <= sync["last_lag_s"] < SYNC_WAIT_S
        assert _lag_count(router) >= n - 1


def test_without_index_sync_replicas_share_load_but_not_the_index(
    replicas: Replicas,
    two_workers: tuple[FakeWorker, FakeWorker],
    redis_server: RedisServer,
    redis_client: redis.Redis,
    cluster_name: str,
) -> None:
    """``index_sync=False``: the sglang-router-like situation the stream exists to fix."""
    a, b = replicas(2, redis_server.url, worker_urls=[w.url for w in two_workers], index_sync=False)
    prompt = _prompt("solo")
    worker = _route(a, prompt)
    assert _cached(a, prompt)[worker] == 320  # unit-exact without block keys
    time.sleep(0.5)  # several times the lag the synced replicas keep
    assert set(_cached(b, prompt).values()) == {0}
    assert _health(b)["index_sync"] is None
    assert redis_client.exists(f"kvroute:{{{cluster_name}}}:index") == 0
    # Load is still shared (test_load_reserved_on_one_replica_shows_in_the_others runs with
    # index sync off too).
    assert _health(b)["store"]["mode"] == "redis"


def test_worker_added_and_removed_on_one_replica_propagates(
    replicas: Replicas, workers: Callable[..., FakeWorker], redis_server: RedisServer
) -> None:
    first, second = workers("first"), workers("second")
    a, b = replicas(2, redis_server.url, worker_urls=[first.url])
    prompt = _prompt("fleet")
    assert _route(a, prompt) == first.url
    assert wait_until(lambda: _sees_cached(b, prompt, first.url, 320), SYNC_WAIT_S)

    assert a.control.post("/workers", json={"url": second.url}).status_code == 201
    assert wait_until(lambda: second.url in _workers(b), SYNC_WAIT_S)
    assert wait_until(lambda: _workers(b)[second.url]["healthy"], SYNC_WAIT_S)

    assert a.control.delete("/workers", params={"url": first.url}).status_code == 200
    assert wait_until(lambda: first.url not in _workers(b), SYNC_WAIT_S)
    # B forgot what the removed worker held and routes to the one that is left.
    assert _cached(b, prompt) == {second.url: 0}
    assert _route(b, prompt) == second.url
    # Removal is not undone by re-applying history: a replica that joins now replays
    # add(second) and remove(first) in order and ends with what the others have.
    (late,) = replicas(1, redis_server.url, first="c", worker_urls=[first.url, second.url])
    assert wait_until(lambda: set(_workers(late)) == {second.url}, SYNC_WAIT_S)


@pytest.mark.parametrize("index_sync", [True, False], ids=["index-sync", "no-index-sync"])
def test_load_reserved_on_one_replica_shows_in_the_others(
    replicas: Replicas,
    workers: Callable[..., FakeWorker],
    redis_server: RedisServer,
    index_sync: bool,
) -> None:
    slow, idle = workers("slow", delay_s=1.0), workers("idle")
    fleet = replicas(3, redis_server.url, worker_urls=[slow.url, idle.url], index_sync=index_sync)
    a, others = fleet[0], fleet[1:]
    done: list[httpx.Response] = []

    def send() -> None:
        with http_client(a.url) as client:
            done.append(client.post("/generate", json={"text": _prompt("load", 400)}))

    # Both workers are idle and hold nothing: the first one (slow) wins the tie.
    thread = threading.Thread(target=send)
    thread.start()
    try:
        assert wait_until(lambda: slow.served() == 1)
        for router in others:  # within a's next batch and one sync of router's
            assert wait_until(lambda r=router: _queue(r)[slow.url] > 50, 1.0, 0.01)
            queue = _queue(router)
            assert queue[slow.url] > 50
            assert queue[idle.url] == 0.0
            view = _workers(router)[slow.url]
            assert view["queue_ms"] > 50
            assert view["in_flight"] == 0  # in flight on replica a only
    finally:
        thread.join(10)
    assert done[0].headers["X-KVRoute-Worker"] == slow.url
    for router in others:  # a released the decayed remainder: nothing left anywhere
        # (the release reaches Redis in a's next batch, a few ms after the response)
        assert wait_until(lambda r=router: _queue(r)[slow.url] < 1e-6, 2.0, 0.01)
        assert _queue(router)[slow.url] == pytest.approx(0.0, abs=1e-6)


def test_index_trimming_keeps_the_same_entries_on_every_replica(
    replicas: Replicas, two_workers: tuple[FakeWorker, FakeWorker], redis_server: RedisServer
) -> None:
    """Events carry the original decision times, so every replica's LRU trim drops the same
    prompts, though each trims on its own timer."""
    urls = [w.url for w in two_workers]
    fleet = replicas(2, redis_server.url, worker_urls=urls)
    prompts = [_prompt(f"trim{i}") for i in range(6)]
    for i, prompt in enumerate(prompts):
        _route(fleet[i % 2], prompt)  # both replicas route, both replicas' events count
    for router in fleet:
        assert wait_until(functools.partial(_applied, router, 3), SYNC_WAIT_S)

    def held(router: RouterServer) -> list[tuple[str, str, int]]:
        return sorted(
            (p[:8], worker, cached)
            for p in prompts
            for worker, cached in _cached(router, p).items()
            if cached
        )

    assert held(fleet[0]) == held(fleet[1])
    assert len(held(fleet[0])) == 6
    # At most two prompts per worker (640 units), trimmed within a second or two. The index
    # settings are the policy's own (no setting exposes them), so they are set on the object.
    for router in fleet:
        policy = router.app.state.kvroute.router.policy
        policy.index_settings = IndexSettings(trim_interval_s=0.1, max_units_per_worker=640)
    for router in fleet:
        assert wait_until(lambda r=router: len(held(r)) <= 4, 3.0, 0.1)
    kept = held(fleet[0])
    assert kept == held(fleet[1])
    assert 2 <= len(kept) <= 4
    assert ("<trim5> ", 320) in {(p, c) for p, _, c in kept}  # the newest survives everywhere


# -- replica identity ------------------------------------------------------------------------
def test_replica_id_appears_in_metrics_explain_and_health(
    replicas: Replicas,
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    redis_server: RedisServer,
) -> None:
    urls = [w.url for w in two_workers]
    (a,) = replicas(1, redis_server.url, worker_urls=urls)
    assert 'kvroute_replica_info{replica_id="a"} 1.0' in a.control.get("/metrics").text
    assert _explain(a, "hello")["replica_id"] == "a"
    resp = a.client.post("/generate", json={"text": "hello"})
    recorded = a.admin.get(f"/explain/{resp.headers['X-KVRoute-Decision-Id']}").json()
    assert recorded["replica_id"] == "a"
    assert _health(a)["replica_id"] == "a"
    # Without --replica-id a replica names itself, differently each time.
    unnamed = [routers(worker_urls=urls) for _ in range(2)]
    ids = [_explain(r, "hello")["replica_id"] for r in unnamed]
    assert all(re.fullmatch(r"replica-[0-9a-f]{8}", i) for i in ids)
    assert ids[0] != ids[1]
    assert (
        f'kvroute_replica_info{{replica_id="{ids[0]}"}} 1.0'
        in unnamed[0].control.get("/metrics").text
    )


# -- failures --------------------------------------------------------------------------------
def _serve(
    redis_url: str, cluster: str, worker_urls: list[str], replica_id: str
) -> tuple[str, str, subprocess.Popen[bytes]]:
    """``python -m kvroute serve`` as a real process in its own process group; its control
    listener (``/metrics``) on the next free port."""
    port, control_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["KVROUTE_CONTROL_PORT"] = str(control_port)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvroute",
            "serve",
            "--port",
            str(port),
            "--policy",
            "lbgr_paper",
            "--redis-url",
            redis_url,
            "--cluster",
            cluster,
            "--replica-id",
            replica_id,
            "--log-level",
            "warning",
            "--worker-urls",
            *worker_urls,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 60, proc)
    except BaseException:
        _kill(proc)
        raise
    return url, f"http://127.0.0.1:{control_port}", proc


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.mark.slow
def test_replica_killed_mid_request_leaves_no_permanent_load(
    replicas: Replicas,
    workers: Callable[..., FakeWorker],
    redis_server: RedisServer,
    cluster_name: str,
) -> None:
    slow, idle = workers("slow", delay_s=30.0), workers("idle")
    urls = [slow.url, idle.url]
    doomed_url, doomed_control, doomed = _serve(redis_server.url, cluster_name, urls, "doomed")
    try:
        with http_client(doomed_control) as control:
            assert 'kvroute_replica_info{replica_id="doomed"} 1.0' in control.get("/metrics").text
        with http_client(doomed_url) as client:
            assert client.post("/explain", json={"text": "x"}).json()["replica_id"] == "doomed"
        (survivor,) = replicas(1, redis_server.url, worker_urls=urls)

        def send() -> None:
            with contextlib.suppress(httpx.HTTPError), http_client(doomed_url) as client:
                client.post("/generate", json={"text": _prompt("doomed", 400)})

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        assert wait_until(lambda: slow.served() == 1, 10)
        # The doomed replica's reservation, shared (after its next batch: a few ms).
        assert wait_until(lambda: _queue(survivor)[slow.url] > 50, 1.0, 0.01)
        _kill(doomed)  # SIGKILL mid-request: it never releases
        thread.join(10)
        at_kill = _queue(survivor)[slow.url]
        read_at = time.monotonic()
        time.sleep(0.5)
        ticks = int((time.monotonic() - read_at) / 0.02)  # at least this many between reads
        later = _queue(survivor)[slow.url]
        # Decaying by 31/32 per 20 ms tick, as nothing releases it any more (one tick slack).
        assert 0 < later <= at_kill * (31 / 32) ** (ticks - 1)
        assert wait_until(lambda: _queue(survivor)[slow.url] < at_kill / 100, 4.0, 0.1)
        assert _queue(survivor)[idle.url] == 0.0
        assert _route(survivor, _prompt("after")) in urls
    finally:
        _kill(doomed)


def test_redis_restart_keeps_routing_and_index_sync_resumes(
    replicas: Replicas,
    two_workers: tuple[FakeWorker, FakeWorker],
    own_redis: RedisServer,
) -> None:
    urls = [w.url for w in two_workers]
    a, b = replicas(2, own_redis.url, worker_urls=urls)
    before = _prompt("before")
    before_worker = _route(a, before)
    assert wait_until(lambda: _sees_cached(b, before, before_worker, 320), SYNC_WAIT_S)

    own_redis.stop()
    for i in range(4):  # routing goes on, on the embedded load store
        # A replica's load mirror meets Redis only when it syncs: when a read finds its copy
        # older than a decay tick (20 ms), or a reservation outlives the batching interval
        # (a request that ends first is cancelled locally, and never sent). So the rounds
        # are a tick apart: a fast machine would otherwise serve them all from the copy.
        time.sleep(0.03)
        for router in (a, b):
            assert router.client.post("/generate", json={"text": f"during {i}"}).status_code == 200
    for router in (a, b):
        # The sync runs after the request (a request never waits on Redis), so a replica
        # finds Redis gone a moment after its request, not at once.
        assert wait_until(lambda r=router: _health(r)["status"] == "degraded", 5, 0.05)
        assert _health(router)["store"]["mode"] == "embedded-fallback"
    during = _prompt("during")
    during_worker = _route(a, during)  # its event is dropped: Redis is not there to carry it
    assert wait_until(lambda: _health(a)["index_sync"]["dropped"] >= 1, 5, 0.05)

    own_redis.start()  # same port, empty
    for router in (a, b):
        assert wait_until(lambda r=router: _health(r)["status"] == "ok", 10, 0.1)
    syncs = {router.url: _health(router)["store"]["syncs"] for router in (a, b)}
    # Index events flow again: a prompt routed on a after the restart is cached on b.
    after = _prompt("after")
    worker = _route(a, after)
    assert wait_until(lambda: _sees_cached(b, after, worker, 320), 10, 0.05)
    # What b knew before the outage is kept; what a routed during it never reached b.
    assert _cached(b, before)[before_worker] == 320
    assert _cached(b, during)[during_worker] == 0
    # No load leaked through the outage: every reservation was released where it was made.
    for router in (a, b):
        assert _queue(router) == pytest.approx(dict.fromkeys(urls, 0.0), abs=1e-6)
    client = redis.Redis.from_url(own_redis.url)
    try:
        assert client.exists(f"kvroute:{{{a.settings.cluster}}}:index") == 1
    finally:
        client.close()
    # Load is shared through the restarted Redis again: both replicas sync their loads with it.
    for router in (a, b):
        store = _health(router)["store"]
        assert store["mode"] == "redis"
        assert store["syncs"] > syncs[router.url]


# -- a replica that joins late ---------------------------------------------------------------
def test_new_replica_warm_starts_index_from_the_stream_and_models_from_redis(
    replicas: Replicas,
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    redis_server: RedisServer,
    redis_client: redis.Redis,
    cluster_name: str,
) -> None:
    urls = [w.url for w in two_workers]
    (a,) = replicas(
        1,
        redis_server.url,
        worker_urls=urls,
        model_snapshot_interval_s=0.2,
        model_snapshot_key=SNAPSHOT_KEY,
    )
    routed = {}
    for i in range(12):
        prompt = _prompt(f"warm{i}")
        routed[prompt] = _route(a, prompt)
    samples_a = a.control.get("/models").json()["models"]["champion"]["samples"]
    assert samples_a == 12
    key = f"kvroute:{{{cluster_name}}}:models:latest"
    # The periodic snapshot (every 0.2 s) reached Redis with everything a learned.
    assert wait_until(lambda: _snapshot_samples(redis_client, key) == 12, 3.0, 0.05)
    assert redis_client.exists(f"kvroute:{{{cluster_name}}}:models:a") == 1

    late = routers(
        worker_urls=urls,
        redis_url=redis_server.url,
        cluster=cluster_name,
        replica_id="late",
        model_snapshot_key=SNAPSHOT_KEY,
    )
    answer = late.control.get("/models").json()
    assert answer["snapshots"]["loaded_from"] == key
    models = answer["models"]
    assert models["champion"]["samples"] == 12  # learned elsewhere, loaded at start
    assert models["version"] == a.control.get("/models").json()["models"]["version"]
    # The index replays the stream's history: everything a routed is known from the start.
    for prompt, worker in routed.items():
        assert wait_until(lambda p=prompt, w=worker: _sees_cached(late, p, w, 320), SYNC_WAIT_S)
    for prompt, worker in list(routed.items())[:3]:
        assert _route(late, prompt) == worker
    sync = _health(late)["index_sync"]
    assert sync["applied"] >= 12
    # History is not sync lag: replayed events stay out of the lag histogram.
    assert sync["replayed"] >= 12
    assert sync["last_lag_s"] is None
    assert _lag_count(late) == 0


def _snapshot_samples(client: redis.Redis, key: str) -> int | None:
    """Samples of the champion in the snapshot stored at ``key``."""
    from models.persistence import loads

    data = client.get(key)
    if not data:
        return None
    samples: int = loads(data, SNAPSHOT_KEY.encode()).status()["champion"]["samples"]
    return samples


def test_replica_restarted_under_the_same_id_replays_its_own_history(
    replicas: Replicas, two_workers: tuple[FakeWorker, FakeWorker], redis_server: RedisServer
) -> None:
    """A fixed --replica-id (a StatefulSet pod) must not skip what its previous life routed."""
    urls = [w.url for w in two_workers]
    (a,) = replicas(1, redis_server.url, worker_urls=urls)
    prompt = _prompt("mine")
    worker = _route(a, prompt)
    assert wait_until(lambda: _health(a)["index_sync"]["published"] == 1, SYNC_WAIT_S)
    a.stop()
    (again,) = replicas(1, redis_server.url, worker_urls=urls)  # the same id, "a"
    assert _health(again)["replica_id"] == "a"
    assert wait_until(lambda: _sees_cached(again, prompt, worker, 320), SYNC_WAIT_S)
