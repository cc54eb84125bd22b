"""``/explain``: the schema of docs/explain.md, dry runs that change nothing, recorded outcomes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from contracts import EXPLAIN_CANDIDATE_KEYS
from fake_worker import FakeWorker
from router_harness import RouterServer, http_client

DECISION_KEYS = {"decision_id", "policy", "chosen", "model", "candidates"}
OUTCOME_KEYS = {
    "status",
    "latency_ms",
    "ttft_ms",
    "residual_target_ms",
    "model_error_ms",
    "estimate_ms",
}
LBGR_NUMBERS = ("cached", "uncached", "base_ms", "queue_ms", "residual_ms", "predicted_ms")


def _check_schema(decision: dict[str, Any], workers: list[str]) -> None:
    assert decision.keys() >= DECISION_KEYS
    assert [c["worker"] for c in decision["candidates"]] == workers
    assert decision["chosen"] in workers
    for cand in decision["candidates"]:
        assert cand.keys() >= EXPLAIN_CANDIDATE_KEYS
        assert isinstance(cand["eligible"], bool)


def test_dry_run_schema_for_lbgr(router: RouterServer, two_workers: tuple[FakeWorker, ...]) -> None:
    urls = [w.url for w in two_workers]
    body = router.admin.post("/explain", json={"text": "hello world"}).json()
    _check_schema(body, urls)
    assert body["policy"] == "lbgr"
    assert body["dry_run"] is True
    assert body["outcome"] is None
    assert body["model"] == {"kind": "ewmean", "version": 1}
    for cand in body["candidates"]:
        assert cand["eligible"] is True
        assert cand["reason"] is None
        for name in LBGR_NUMBERS:
            assert isinstance(cand[name], int | float), name
        assert cand["cached"] + cand["uncached"] == len("hello world")
        assert cand["predicted_ms"] == pytest.approx(
            max(1.0, cand["base_ms"] + cand["queue_ms"] + cand["residual_ms"])
        )


@pytest.mark.parametrize(
    "body",
    [
        {"text": "plain generate"},
        {"input_ids": [5, 6, 7]},
        {"prompt": "a completion"},
        {"messages": [{"role": "user", "content": "a chat"}]},
    ],
)
def test_dry_run_takes_every_body_kind(router: RouterServer, body: dict[str, Any]) -> None:
    resp = router.admin.post("/explain", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["candidates"][0]["uncached"] > 0


def test_unused_fields_are_present_and_null(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, ...]
) -> None:
    router = routers(worker_urls=[w.url for w in two_workers], policy="round_robin")
    body = router.admin.post("/explain", json={"text": "hi"}).json()
    _check_schema(body, [w.url for w in two_workers])
    assert body["policy"] == "round_robin"
    assert body["model"] is None
    for cand in body["candidates"]:
        for name in ("base_ms", "residual_ms", "predicted_ms"):
            assert cand[name] is None


def test_ineligible_worker_says_why(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    good, sick = workers("good"), workers("sick")
    sick.health_status = 503
    router = routers(worker_urls=[good.url, sick.url])
    body = router.admin.post("/explain", json={"text": "hi"}).json()
    assert body["chosen"] == good.url
    cand = body["candidates"][1]
    assert cand["worker"] == sick.url
    assert cand["eligible"] is False
    assert "503" in cand["reason"]


def test_dry_run_reserves_and_sends_nothing(
    router: RouterServer, two_workers: tuple[FakeWorker, ...]
) -> None:
    router.client.post("/generate", json={"text": "warm " * 20})
    before = router.control.get("/workers").json()["workers"]
    served = [w.served() for w in two_workers]
    for _ in range(5):
        resp = router.admin.post("/explain", json={"text": "x" * 300})
        assert resp.status_code == 200
        assert router.admin.get(f"/explain/{resp.json()['decision_id']}").status_code == 404
    after = router.control.get("/workers").json()["workers"]
    assert [w.served() for w in two_workers] == served
    for b, a in zip(before, after, strict=True):
        assert a["index_units"] == b["index_units"]
        assert a["in_flight"] == b["in_flight"] == 0
        assert a["queue_ms"] == pytest.approx(0.0, abs=1e-6)
    # Nothing was inserted: the same prompt is still uncached everywhere.
    again = router.admin.post("/explain", json={"text": "x" * 300}).json()
    assert all(c["cached"] == 0 for c in again["candidates"])


def test_recorded_decision_has_outcome(
    router: RouterServer, two_workers: tuple[FakeWorker, ...]
) -> None:
    for worker in two_workers:
        worker.delay_s = 0.1
    resp = router.client.post("/generate", json={"text": "0123456789"})
    decision_id = resp.headers["X-KVRoute-Decision-Id"]
    record = router.admin.get(f"/explain/{decision_id}").json()
    _check_schema(record, [w.url for w in two_workers])
    assert record["decision_id"] == decision_id
    assert record["chosen"] == resp.headers["X-KVRoute-Worker"]
    assert record["dry_run"] is False
    outcome = record["outcome"]
    assert set(outcome) == OUTCOME_KEYS
    assert outcome["status"] == "ok"
    assert outcome["latency_ms"] >= 100.0
    assert 0 < outcome["ttft_ms"] <= outcome["latency_ms"]
    chosen = next(c for c in record["candidates"] if c["worker"] == record["chosen"])
    # The target is measured from the estimate remade for the answer's real output, shorter
    # than the 256 tokens expected of a request without max_new_tokens: below the estimate
    # made at routing time, and above its prefill and wait alone.
    at_route = chosen["base_ms"] + chosen["queue_ms"]
    assert 0 < outcome["estimate_ms"] < at_route
    expected_target = max(1.0, outcome["latency_ms"] - outcome["estimate_ms"])
    assert outcome["residual_target_ms"] == pytest.approx(expected_target, abs=0.01)
    # A fresh model: the error is the distance from the prediction used at routing time.
    assert outcome["model_error_ms"] == pytest.approx(
        abs(outcome["residual_target_ms"] - chosen["residual_ms"]), abs=1e-6
    )


def test_streamed_outcome_separates_ttft_from_latency(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("streamer", chunk_pause_s=0.3)
    router = routers(worker_urls=[worker.url])
    with router.client.stream("POST", "/generate", json={"text": "hi", "stream": True}) as resp:
        resp.read()
    record = router.admin.get(f"/explain/{resp.headers['X-KVRoute-Decision-Id']}").json()
    outcome = record["outcome"]
    assert outcome["status"] == "ok"
    assert outcome["latency_ms"] >= 300.0
    assert outcome["ttft_ms"] < outcome["latency_ms"] - 200.0


def test_outcome_is_null_while_in_flight(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("streamer", chunk_pause_s=0.5)
    router = routers(worker_urls=[worker.url])
    with router.client.stream("POST", "/generate", json={"text": "hi", "stream": True}) as resp:
        chunks = resp.iter_raw()  # kept: a dropped iterator closes the connection
        next(chunks)  # the first chunk; the worker now pauses
        decision_id = resp.headers["X-KVRoute-Decision-Id"]
        with http_client(router.url) as other:
            assert other.get(f"/explain/{decision_id}").json()["outcome"] is None
        assert router.control.get("/workers").json()["workers"][0]["in_flight"] == 1
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    assert router.admin.get(f"/explain/{decision_id}").json()["outcome"]["status"] == "ok"
    assert router.control.get("/workers").json()["workers"][0]["in_flight"] == 0


def test_ring_buffer_is_bounded(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, ...]
) -> None:
    router = routers(worker_urls=[w.url for w in two_workers], explain_buffer=3)
    ids = [
        router.client.post("/generate", json={"text": f"r{i}"}).headers["X-KVRoute-Decision-Id"]
        for i in range(5)
    ]
    assert len(set(ids)) == 5
    codes = [router.admin.get(f"/explain/{i}").status_code for i in ids]
    assert codes == [404, 404, 200, 200, 200]


def test_client_disconnect_mid_stream_closes_the_decision(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("streamer", chunk_pause_s=0.5)
    router = routers(worker_urls=[worker.url])
    with (
        http_client(router.url) as client,
        client.stream("POST", "/generate", json={"text": "x" * 400, "stream": True}) as resp,
    ):
        decision_id = resp.headers["X-KVRoute-Decision-Id"]
        next(resp.iter_raw())
    # The client hung up after the first chunk: the decision closes without training.
    deadline = time.monotonic() + 5
    outcome = None
    while outcome is None and time.monotonic() < deadline:
        outcome = router.admin.get(f"/explain/{decision_id}").json()["outcome"]
        time.sleep(0.02)
    assert outcome is not None
    assert outcome["status"] == "client_disconnected"
    assert outcome["residual_target_ms"] is None
    view = router.control.get("/workers").json()["workers"][0]
    assert view["in_flight"] == 0
    explained = router.admin.post("/explain", json={"text": "fresh"}).json()
    cand = explained["candidates"][0]
    # Nothing of it is in flight: what is left is the prefill it did, which lately took part
    # of the worker's time and so still stalls a decode there (stall_ms).
    assert cand["stall_ms"] > 0.0
    assert cand["queue_ms"] - cand["stall_ms"] == pytest.approx(0.0, abs=1e-6)
