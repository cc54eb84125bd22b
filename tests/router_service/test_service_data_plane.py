"""The data plane over real HTTP: all four routes, streaming and not, bodies passed through."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from fake_worker import FakeWorker
from router_harness import RouterServer

HEADERS = ("X-KVRoute-Decision-Id", "X-KVRoute-Worker")

BODIES = {
    "/generate": {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}},
    "/v1/completions": {"model": "fake-model", "prompt": "Once upon a time", "max_tokens": 8},
    "/v1/chat/completions": {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 8,
    },
}


def _worker_for(resp: httpx.Response, pool: tuple[FakeWorker, ...]) -> FakeWorker:
    url = resp.headers["X-KVRoute-Worker"]
    return next(w for w in pool if w.url == url)


def _sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


@pytest.mark.parametrize("path", list(BODIES))
def test_non_streaming_body_passes_through_byte_for_byte(
    router: RouterServer, two_workers: tuple[FakeWorker, FakeWorker], path: str
) -> None:
    # Odd spacing in the request too: the worker must receive exactly these bytes.
    raw = json.dumps(BODIES[path], indent=3).encode()
    resp = router.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    worker = _worker_for(resp, two_workers)
    assert worker.received[-1].raw == raw
    assert resp.content == worker.responses[-1]
    assert resp.headers["content-type"].startswith("application/json")
    for name in HEADERS:
        assert resp.headers[name]
    assert resp.headers["X-KVRoute-Worker"] in {w.url for w in two_workers}


def test_generate_with_input_ids(
    router: RouterServer, two_workers: tuple[FakeWorker, FakeWorker]
) -> None:
    resp = router.client.post("/generate", json={"input_ids": [1, 2, 3, 4, 5]})
    assert resp.status_code == 200
    worker = _worker_for(resp, two_workers)
    assert worker.received[-1].body["input_ids"] == [1, 2, 3, 4, 5]
    assert resp.json()["meta_info"]["prompt_tokens"] == 5
    decision = router.admin.get(f"/explain/{resp.headers['X-KVRoute-Decision-Id']}").json()
    assert decision["units"] == 5  # routed on the token ids, not on characters


@pytest.mark.parametrize("path", list(BODIES))
def test_streaming_relays_every_sse_chunk(
    router: RouterServer, two_workers: tuple[FakeWorker, FakeWorker], path: str
) -> None:
    with router.client.stream("POST", path, json={**BODIES[path], "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for name in HEADERS:
            assert resp.headers[name]
        text = resp.read().decode()
    events = _sse_events(text)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert len(payloads) >= 3
    assert text.endswith("data: [DONE]\n\n")
    worker = _worker_for(resp, two_workers)
    assert worker.received[-1].body["stream"] is True


@pytest.mark.parametrize("path", list(BODIES))
def test_streaming_is_not_buffered(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker], path: str
) -> None:
    """The first chunk reaches the client while the worker is still pausing for 0.5 s."""
    worker = workers("slowstream", chunk_pause_s=0.5)
    router = routers(worker_urls=[worker.url])
    start = time.perf_counter()
    with router.client.stream("POST", path, json={**BODIES[path], "stream": True}) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        first = next(chunks)
        first_at = time.perf_counter() - start
        rest = b"".join(chunks)
        done_at = time.perf_counter() - start
    assert first.startswith(b"data: ")
    assert rest.endswith(b"data: [DONE]\n\n")
    assert done_at >= 0.5
    assert first_at < done_at - 0.3, (first_at, done_at)


def test_models_list_comes_from_a_worker(router: RouterServer) -> None:
    resp = router.client.get("/v1/models")
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "fake-model"


def test_models_list_without_healthy_worker_is_503(routers: Callable[..., RouterServer]) -> None:
    router = routers(worker_urls=[])
    resp = router.client.get("/v1/models")
    assert resp.status_code == 503
    assert "no healthy worker" in resp.json()["error"]["message"]


def test_worker_error_status_passes_through(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    """A worker's own error reaches the client unchanged and is recorded as the outcome."""
    worker = workers("picky")
    worker.fail_status = 422
    router = routers(worker_urls=[worker.url])
    resp = router.client.post("/generate", json={"text": "hi"})
    assert resp.status_code == 422
    assert resp.json()["error"]["message"] == "worker picky refuses"
    assert resp.headers["X-KVRoute-Worker"] == worker.url
    record = router.admin.get(f"/explain/{resp.headers['X-KVRoute-Decision-Id']}").json()
    assert record["outcome"]["status"] == "http_422"
    assert record["outcome"]["residual_target_ms"] is None  # failures do not train


def test_health_reports_workers_and_store(router: RouterServer) -> None:
    body = router.client.get("/health").json()
    assert body["status"] == "ok"
    assert body["healthy_workers"] == 2
    assert body["store"]["mode"] == "embedded"
    assert body["policy"] == "lbgr"
    assert all(w["healthy"] for w in body["workers"].values())


def test_unhealthy_worker_gets_no_traffic_and_recovers(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    a, b = workers("a"), workers("b")
    router = routers(worker_urls=[a.url, b.url], policy="round_robin", health_interval_s=0.1)
    a.health_status = 503
    assert _wait_health(router, a.url, healthy=False)
    served = a.served()
    for i in range(6):
        resp = router.client.post("/generate", json={"text": f"p{i}"})
        assert resp.headers["X-KVRoute-Worker"] == b.url
    assert a.served() == served
    a.health_status = 200
    assert _wait_health(router, a.url, healthy=True)
    seen = {
        router.client.post("/generate", json={"text": f"q{i}"}).headers["X-KVRoute-Worker"]
        for i in range(4)
    }
    assert seen == {a.url, b.url}


def _wait_health(router: RouterServer, url: str, *, healthy: bool) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if router.client.get("/health").json()["workers"][url]["healthy"] is healthy:
            return True
        time.sleep(0.05)
    return False


def test_an_answer_cut_short_before_the_client_saw_it_is_retried_elsewhere(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    broken, good = workers("broken"), workers("good")
    broken.break_body = True
    router = routers(worker_urls=[broken.url, good.url], policy="round_robin")
    answers = [router.client.post("/generate", json={"text": f"p{i}"}) for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers["X-KVRoute-Worker"] for a in answers} == {good.url}
    assert all(a.json()["meta_info"]["worker"] == "good" for a in answers)
    assert broken.served("/generate") >= 2  # round_robin sent it its share first
    retried = [a for a in answers if a.headers["X-KVRoute-Decision-Id"].endswith("-2")]
    assert retried
    for answer in retried:
        first_id = answer.headers["X-KVRoute-Decision-Id"].rsplit("-", 1)[0]
        first = router.admin.get(f"/explain/{first_id}").json()
        assert first["chosen"] == broken.url
        assert first["outcome"]["status"] == "upstream_broken"
    # Nothing stays counted in flight on either worker.
    assert all(w["in_flight"] == 0 for w in router.control.get("/workers").json()["workers"])


def test_worker_breaking_off_mid_stream_ends_with_an_sse_error(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("flaky", chunk_pause_s=5.0)
    router = routers(worker_urls=[worker.url], health_interval_s=60)
    with router.client.stream("POST", "/generate", json={"text": "hi", "stream": True}) as resp:
        chunks = resp.iter_raw()
        first = next(chunks)
        stopper = threading.Thread(target=worker.stop)  # the worker dies mid-stream
        stopper.start()
        rest = b"".join(chunks).decode()
        stopper.join(10)
    assert first.startswith(b"data: {")
    events = _sse_events(rest)
    assert json.loads(events[-1])["error"]["type"] == "upstream_broken"
    assert "[DONE]" not in events
    record = router.admin.get(f"/explain/{resp.headers['X-KVRoute-Decision-Id']}").json()
    assert record["outcome"]["status"] == "upstream_broken"
    assert router.control.get("/workers").json()["workers"][0]["in_flight"] == 0
