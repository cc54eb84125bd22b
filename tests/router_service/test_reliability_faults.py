"""Fault injection with real processes: the router keeps serving and loses nothing it could save.

- A ``kvroute emulate`` worker killed with SIGKILL mid-run: the non-streaming requests it held
  are retried on other workers (``attempt`` 2 in ``/explain``), its stream ends with the SSE
  error event, it is ejected, and it rejoins once it is back on the same port.
- A worker answering 500: its circuit opens after ``breaker_failures``, traffic moves away, a
  half-open trial after ``breaker_open_s`` (a failed trial opens it again), successes close it.
- A slow worker: the first-byte timeout (504) sends the request to a fast worker; the total
  timeout ends a stalled stream with the error event.
- Redis killed and restarted under load with two replicas: no request fails.
- SIGTERM to ``kvroute serve``: /health turns 503 "draining", the request in flight completes,
  the process exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fake_worker import FakeWorker
from router_harness import (
    EmulatedWorker,
    RedisServer,
    RouterServer,
    free_port,
    http_client,
    port_outside_ephemeral_range,
    wait_until,
)

ERROR_EVENT_TYPE = '"type": "upstream_broken"'


# -- real worker processes ------------------------------------------------------------------
@pytest.fixture
def emulated_workers() -> Iterator[list[EmulatedWorker]]:
    # Workers come back on their port after a kill: one outside the ephemeral range, which no
    # socket bound to port 0 takes meanwhile.
    pool = [EmulatedWorker(port_outside_ephemeral_range()).spawn() for _ in range(4)]
    try:
        for worker in pool:
            worker.wait_healthy()
        yield pool
    finally:
        for worker in pool:
            worker.kill()


# -- helpers --------------------------------------------------------------------------------
def _generate(tokens: int, seed: int, *, stream: bool = False) -> dict[str, Any]:
    ids = [(seed * 7919 + i) % 50_000 for i in range(64)]
    params = {"max_new_tokens": tokens, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": params, "stream": stream}


def _record(router: RouterServer, decision_id: str) -> dict[str, Any]:
    record: dict[str, Any] = router.admin.get(f"/explain/{decision_id}").json()
    return record


def _first_attempt(router: RouterServer, decision_id: str) -> dict[str, Any]:
    """Attempt n is recorded as ``<request id>-n``; attempt 1 under the request id itself."""
    return _record(router, decision_id.rsplit("-", 1)[0])


def _worker(router: RouterServer, url: str) -> dict[str, Any]:
    listed = router.control.get("/workers").json()["workers"]
    found: dict[str, Any] = next(w for w in listed if w["url"] == url)
    return found


@dataclass
class Stream:
    """A streamed request read on its own thread."""

    worker: str = ""
    text: str = ""
    status: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def read(self, base_url: str, body: dict[str, Any]) -> None:
        try:
            with (
                http_client(base_url) as client,
                client.stream("POST", "/generate", json=body) as resp,
            ):
                self.status = resp.status_code
                self.worker = resp.headers.get("X-KVRoute-Worker", "")
                for chunk in resp.iter_text():
                    self.text += chunk
                    self.started.set()
        except httpx.HTTPError as exc:
            self.text += f"\n<client error {type(exc).__name__}>"
        finally:
            self.started.set()
            self.done.set()


class Background:
    """Closed-loop clients sending short non-streaming requests until stopped."""

    def __init__(self, urls: list[str], clients: int = 3) -> None:
        self.urls = urls
        self.statuses: list[int] = []
        self.retried = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(clients)]

    def _loop(self, index: int) -> None:
        url = self.urls[index % len(self.urls)]
        with http_client(url) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    resp = client.post("/generate", json=_generate(4, index * 100_000 + n))
                    status = resp.status_code
                    # Request ids are hex; attempt n > 1 is recorded as "<id>-n".
                    self.retried += "-" in resp.headers.get("X-KVRoute-Decision-Id", "")
                except httpx.HTTPError:
                    status = 0  # accepted (or not) and never answered: lost
                self.statuses.append(status)

    def __enter__(self) -> Background:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


# -- SIGKILL --------------------------------------------------------------------------------
@pytest.mark.slow
def test_worker_killed_mid_run_loses_no_request_and_rejoins(
    routers: Callable[..., RouterServer], emulated_workers: list[EmulatedWorker]
) -> None:
    # round_robin so that the victim provably holds requests when it dies: four streams go
    # to four workers, then eight long requests two to each.
    router = routers(
        worker_urls=[w.url for w in emulated_workers],
        policy="round_robin",
        health_interval_s=0.3,
        unhealthy_after_failures=1,
        breaker_open_s=1.0,
    )
    for i in range(4):  # open a connection to every worker
        assert router.client.post("/generate", json=_generate(1, 900 + i)).status_code == 200
    streams = [Stream() for _ in range(4)]
    for i, stream in enumerate(streams):
        threading.Thread(
            target=stream.read, args=(router.url, _generate(2400, i, stream=True))
        ).start()
        assert stream.started.wait(30)
    assert len({s.worker for s in streams}) == 4
    victim = next(w for w in emulated_workers if w.url == streams[0].worker)
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(_post_generate, router.url, _generate(1200, 10 + i)) for i in range(8)
        ]
        for worker in emulated_workers:
            assert wait_until(lambda w=worker: _worker(router, w.url)["in_flight"] == 3, 10)
        with Background([router.url], clients=3) as background:
            time.sleep(0.3)
            victim.kill()
            answers = [f.result(60) for f in futures]
            for stream in streams:
                assert stream.done.wait(60)
            # Ejected: unhealthy by its failed checks (and its circuit may have opened).
            assert wait_until(lambda: not _worker(router, victim.url)["healthy"], 5)
            victim.spawn().wait_healthy()  # the same port
            assert wait_until(
                lambda: (w := _worker(router, victim.url))["healthy"] and w["circuit"] != "open",
                10,
            )
            time.sleep(0.5)

    assert [a.status_code for a in answers] == [200] * 8
    retried = [a for a in answers if _record(router, _id(a))["attempt"] > 1]
    assert len(retried) == 2  # the two the victim held
    for answer in retried:
        assert answer.headers["X-KVRoute-Worker"] != victim.url
        first = _first_attempt(router, _id(answer))
        assert first["chosen"] == victim.url
        assert first["outcome"]["status"] in ("upstream_unavailable", "upstream_broken")

    assert [s.status for s in streams] == [200] * 4
    broken = streams[0].text
    assert ERROR_EVENT_TYPE in broken.rstrip().rsplit("\n", 1)[-1]
    assert "[DONE]" not in broken
    for stream in streams[1:]:
        assert stream.text.endswith("data: [DONE]\n\n")
        assert ERROR_EVENT_TYPE not in stream.text

    assert background.statuses
    assert set(background.statuses) == {200}, background.statuses
    served = {
        _post_generate(router.url, _generate(2, 600 + i)).headers["X-KVRoute-Worker"]
        for i in range(8)
    }
    assert victim.url in served  # it rejoined


def _post_generate(base_url: str, body: dict[str, Any]) -> httpx.Response:
    with http_client(base_url, timeout_s=60) as client:
        return client.post("/generate", json=body)


def _id(resp: httpx.Response) -> str:
    return resp.headers["X-KVRoute-Decision-Id"]


# -- 500s and the circuit breaker ----------------------------------------------------------
class BreakerClock:
    """The breakers' clock (seconds): the test moves it past their open window instead of
    waiting for it."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.mark.slow
def test_worker_answering_500_trips_its_breaker_then_recovers(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    bad, good = workers("bad"), workers("good")
    bad.fail_status = 500
    router = routers(
        worker_urls=[bad.url, good.url],
        policy="round_robin",
        breaker_failures=4,
        breaker_successes=2,
        breaker_open_s=1.0,
        health_interval_s=60,
    )
    clock = BreakerClock()
    for worker in router.app.state.kvroute.pool.workers.values():
        worker.breaker.clock = clock
    statuses = [
        router.client.post("/generate", json={"text": f"t{i}"}).status_code for i in range(16)
    ]
    # 500 is the worker's own answer (not retried); after 4 in a row its circuit opens.
    assert statuses.count(500) == 4
    assert bad.served() == 4
    last_500 = max(i for i, status in enumerate(statuses) if status == 500)
    assert last_500 <= 8
    assert set(statuses[last_500 + 1 :]) == {200}
    view = _worker(router, bad.url)
    assert view["circuit"] == "open"
    assert view["circuit_opens"] == 1
    assert view["healthy"] is True  # /health still answers: only the breaker ejects it
    dry = router.admin.post("/explain", json={"text": "where"}).json()
    bad_line = next(c for c in dry["candidates"] if c["worker"] == bad.url)
    assert bad_line["eligible"] is False
    assert "circuit open" in bad_line["reason"]

    clock.now_s += 1.0  # half-open: one trial; it fails, so the circuit opens again
    for i in range(4):
        router.client.post("/generate", json={"text": f"trial {i}"})
    assert bad.served() == 5
    assert _worker(router, bad.url)["circuit_opens"] == 2

    bad.fail_status = None
    clock.now_s += 1.0
    states = []
    for i in range(10):
        assert router.client.post("/generate", json={"text": f"back {i}"}).status_code == 200
        states.append(_worker(router, bad.url)["circuit"])
        if states[-1] == "closed":
            break
    assert "half_open" in states
    assert states[-1] == "closed"
    assert bad.served() >= 7


# -- timeouts -------------------------------------------------------------------------------
def test_slow_worker_times_out_and_the_request_moves_to_a_fast_one(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    slow, fast = workers("slow", delay_s=5.0), workers("fast")
    router = routers(
        worker_urls=[slow.url, fast.url], policy="round_robin", first_byte_timeout_s=0.4
    )
    answers = [router.client.post("/generate", json={"text": f"q{i}"}) for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers["X-KVRoute-Worker"] for a in answers} == {fast.url}
    retried = [a for a in answers if _record(router, _id(a))["attempt"] == 2]
    assert len(retried) >= 2  # round robin sends at least every other one to the slow worker
    for answer in retried:
        first = _first_attempt(router, _id(answer))
        assert first["chosen"] == slow.url
        assert first["outcome"]["status"] == "upstream_timeout"
        assert answer.elapsed.total_seconds() < 2.0


def test_slow_worker_alone_gives_504(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    slow = workers("slow", delay_s=5.0)
    router = routers(worker_urls=[slow.url], first_byte_timeout_s=0.3)
    resp = router.client.post("/generate", json={"text": "nobody else"})
    assert resp.status_code == 504
    assert resp.json()["error"]["type"] == "upstream_timeout"
    assert resp.elapsed.total_seconds() < 2.0


def test_stalled_stream_hits_the_total_timeout_and_ends_with_an_error_event(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    stall = workers("stall", chunk_pause_s=5.0)
    router = routers(worker_urls=[stall.url], request_timeout_s=0.6)
    resp = router.client.post("/generate", json={"text": "go", "stream": True})
    assert resp.status_code == 200  # the first event was already on its way
    events = [line for line in resp.text.split("\n") if line.startswith("data: ")]
    assert "tok0-stall" in events[0]
    last = json.loads(events[-1][len("data: ") :])
    assert last["error"]["type"] == "upstream_broken"
    assert "[DONE]" not in resp.text
    record = _record(router, _id(resp))
    assert record["outcome"]["status"] == "upstream_broken"
    assert _worker(router, stall.url)["in_flight"] == 0  # released


# -- Redis outage ---------------------------------------------------------------------------
@pytest.mark.slow
def test_redis_killed_and_restarted_under_load_fails_no_request(
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    own_redis: RedisServer,
    cluster_name: str,
) -> None:
    shared = {
        "worker_urls": [w.url for w in two_workers],
        "redis_url": own_redis.url,
        "cluster": cluster_name,
        # The outage counted is the kill; a busy machine's 50 ms stall (the default timeout)
        # would count as a second one.
        "redis_timeout_ms": 500.0,
    }
    replicas = [routers(**shared, replica_id="r1"), routers(**shared, replica_id="r2")]
    modes: set[str] = set()

    def store_modes() -> set[str]:
        return {r.client.get("/health").json()["store"]["mode"] for r in replicas}

    with Background([r.url for r in replicas], clients=4) as background:
        time.sleep(0.5)
        own_redis.stop()
        assert wait_until(lambda: store_modes() == {"embedded-fallback"}, 5)
        time.sleep(1.0)
        during = len(background.statuses)
        own_redis.start()  # the same port
        assert wait_until(lambda: store_modes() == {"redis"}, 10, 0.1)
        modes = store_modes()
        time.sleep(0.5)
    assert modes == {"redis"}
    assert len(background.statuses) > during > 0
    assert set(background.statuses) == {200}
    for replica in replicas:
        store = replica.client.get("/health").json()["store"]
        assert store["outages"] == 1
        assert store["fallback_operations"] > 0


# -- graceful shutdown ----------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_drains_the_request_in_flight_then_exits(
    workers: Callable[..., FakeWorker],
) -> None:
    worker = workers("long", delay_s=3.0)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env.update(KVROUTE_DRAIN_GRACE_S="1.5", KVROUTE_DRAIN_TIMEOUT_S="20")
    env["KVROUTE_CONTROL_PORT"] = str(free_port())
    args = [sys.executable, "-m", "kvroute", "serve", "--port", str(port)]
    args += ["--worker-urls", worker.url, "--policy", "round_robin", "--log-level", "warning"]
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with http_client(base, timeout_s=2) as probe:

            def health() -> httpx.Response | None:
                try:
                    return probe.get("/health")
                except httpx.HTTPError:
                    return None

            assert wait_until(lambda: (h := health()) is not None and h.status_code == 200, 60)
            with ThreadPoolExecutor(1) as pool:
                long = pool.submit(_post_generate, base, {"text": "a long one"})
                assert wait_until(lambda: worker.served() == 1, 10)
                proc.send_signal(signal.SIGTERM)
                draining = None
                deadline = time.monotonic() + 1.0
                while draining is None and time.monotonic() < deadline:
                    h = health()
                    if h is not None and h.status_code == 503:
                        draining = h
                assert draining is not None, "no 503 from /health after SIGTERM"
                assert draining.json()["status"] == "draining"
                assert draining.json()["draining"] is True
                answer = long.result(30)
            assert answer.status_code == 200
            assert "tok0-long" in answer.text
        proc.wait(20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert proc.returncode in (0, -signal.SIGTERM), stderr
    assert "Traceback" not in stderr
