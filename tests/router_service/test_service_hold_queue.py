"""The hold queue over real HTTP: slots per worker, freeing at the first chunk or the end,
clients that leave while waiting, and what /health, /metrics and /explain say."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fake_worker import FakeWorker
from router_harness import RouterServer, wait_until

from router_service.relay import Flight
from router_service.request_parsing import parse_body
from router_service.routing import HoldSettings, Router, make_policy


def _send_all(router: RouterServer, bodies: list[dict[str, Any]], stagger_s: float) -> list[Any]:
    """POST /generate bodies from threads, ``stagger_s`` apart; returns the responses."""
    out: list[Any] = [None] * len(bodies)

    def send(i: int) -> None:
        with httpx.Client(base_url=router.url, timeout=30.0) as client:
            out[i] = client.post("/generate", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
        time.sleep(stagger_s)
    for thread in threads:
        thread.join()
    return out


def test_one_slot_sends_a_worker_one_request_at_a_time(
    workers: Callable[..., FakeWorker], routers: Callable[..., RouterServer]
) -> None:
    worker = workers("a", delay_s=0.3)
    router = routers(worker_urls=[worker.url], policy="lbgr", queue_slots=1, queue_free_at="end")
    responses = _send_all(router, [{"text": f"prompt {i}"} for i in range(3)], stagger_s=0.02)
    assert [r.status_code for r in responses] == [200, 200, 200]
    arrivals = sorted(r.at_s for r in worker.received)
    # Each request reaches the worker only after the one before it answered (0.3 s).
    assert all(b - a >= 0.29 for a, b in itertools.pairwise(arrivals)), arrivals
    health = router.client.get("/health").json()
    queue = health["queue"]
    assert queue["slots"] == 1
    assert queue["waiting"] == 0
    assert queue["busy"] == {}
    assert queue["dispatched"] == 3
    metrics = router.control.get("/metrics").text
    assert "kvroute_queue_waiting 0.0" in metrics
    assert "kvroute_queue_wait_seconds_count 3.0" in metrics


def test_without_the_queue_requests_overlap_on_the_worker(
    workers: Callable[..., FakeWorker], routers: Callable[..., RouterServer]
) -> None:
    """The control for the test above: the same load reaches the worker at once."""
    worker = workers("a", delay_s=0.3)
    router = routers(worker_urls=[worker.url], policy="lbgr")
    responses = _send_all(router, [{"text": f"prompt {i}"} for i in range(3)], stagger_s=0.02)
    assert [r.status_code for r in responses] == [200, 200, 200]
    arrivals = sorted(r.at_s for r in worker.received)
    assert arrivals[-1] - arrivals[0] < 0.25
    assert router.client.get("/health").json()["queue"] is None


def _stream_arrivals(
    workers: Callable[..., FakeWorker], routers: Callable[..., RouterServer], free_at: str
) -> list[float]:
    worker = workers("a", chunk_pause_s=0.5)  # the first chunk at once, the rest 0.5 s later
    router = routers(worker_urls=[worker.url], queue_slots=1, queue_free_at=free_at)
    bodies = [{"text": f"prompt {i}", "stream": True} for i in range(2)]
    responses = _send_all(router, bodies, stagger_s=0.05)
    assert [r.status_code for r in responses] == [200, 200]
    assert all("[DONE]" in r.text for r in responses)
    return sorted(r.at_s for r in worker.received)


def test_a_stream_frees_its_slot_at_its_first_chunk(
    workers: Callable[..., FakeWorker], routers: Callable[..., RouterServer]
) -> None:
    first, second = _stream_arrivals(workers, routers, "first_token")
    assert second - first < 0.4  # it did not wait for the first stream's remaining 0.5 s


def test_with_free_at_end_a_stream_holds_its_slot_to_the_end(
    workers: Callable[..., FakeWorker], routers: Callable[..., RouterServer]
) -> None:
    first, second = _stream_arrivals(workers, routers, "end")
    assert second - first >= 0.49


def _last_step_arrivals(
    workers: Callable[..., FakeWorker],
    routers: Callable[..., RouterServer],
    path: str,
    body: dict[str, Any],
    free_at: str = "last_token",
) -> float:
    """Two streams of 3 tokens, the last 0.5 s after the others; the gap between their
    arrivals at the worker."""
    worker = workers("a", last_chunk_pause_s=0.5, chunks=3)
    router = routers(worker_urls=[worker.url], queue_slots=1, queue_free_at=free_at)
    out: list[Any] = [None, None]

    def send(i: int) -> None:
        with httpx.Client(base_url=router.url, timeout=30.0) as client:
            out[i] = client.post(path, json={**body, "stream": True})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    assert [r.status_code for r in out] == [200, 200]
    assert all("[DONE]" in r.text for r in out)
    first, second = sorted(r.at_s for r in worker.received)
    return second - first


GENERATE_3 = {"text": "prompt", "sampling_params": {"max_new_tokens": 3}}
CHAT_3 = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize(
    ("path", "body"),
    [("/generate", GENERATE_3), ("/v1/chat/completions", CHAT_3)],
    ids=["generate", "chat-with-role-event"],
)
def test_free_at_last_token_hands_over_while_the_last_token_is_decoded(
    workers: Callable[..., FakeWorker],
    routers: Callable[..., RouterServer],
    path: str,
    body: dict[str, Any],
) -> None:
    assert _last_step_arrivals(workers, routers, path, body) < 0.4


@pytest.mark.parametrize(
    ("body", "free_at"),
    [
        (GENERATE_3, "end"),
        ({"text": "prompt"}, "last_token"),  # no max_new_tokens: the end is unknown
        ({"text": "prompt", "sampling_params": {"max_new_tokens": 3, "n": 2}}, "last_token"),
    ],
    ids=["free-at-end", "no-max-new-tokens", "n-sequences"],
)
def test_a_stream_without_a_known_last_token_holds_its_slot_to_the_end(
    workers: Callable[..., FakeWorker],
    routers: Callable[..., RouterServer],
    body: dict[str, Any],
    free_at: str,
) -> None:
    assert _last_step_arrivals(workers, routers, "/generate", body, free_at) >= 0.49


def test_a_client_that_leaves_while_waiting_is_never_sent(
    workers: Callable[..., FakeWorker], routers: Callable[..., RouterServer]
) -> None:
    worker = workers("a", delay_s=0.6)
    router = routers(worker_urls=[worker.url], queue_slots=1, queue_free_at="end")
    done: list[int] = []

    def first() -> None:
        with httpx.Client(base_url=router.url, timeout=30.0) as client:
            done.append(client.post("/generate", json={"text": "first"}).status_code)

    thread = threading.Thread(target=first)
    thread.start()
    assert wait_until(lambda: worker.served() == 1)
    with (
        httpx.Client(base_url=router.url, timeout=0.2) as client,  # gives up while held
        contextlib.suppress(httpx.TimeoutException),
    ):
        client.post("/generate", json={"text": "impatient"})
    assert wait_until(lambda: router.client.get("/health").json()["queue"]["abandoned"] == 1)
    thread.join()
    assert done == [200]
    # The slot is free again: a new request goes straight through, and the one that left
    # was never sent.
    resp = router.client.post("/generate", json={"text": "later"})
    assert resp.status_code == 200
    assert [r.body["text"] for r in worker.received] == ["first", "later"]
    queue = router.client.get("/health").json()["queue"]
    assert queue["busy"] == {}
    assert queue["waiting"] == 0


def test_explain_of_a_held_request_names_the_queue(
    workers: Callable[..., FakeWorker], routers: Callable[..., RouterServer]
) -> None:
    a, b = workers("a"), workers("b")
    router = routers(worker_urls=[a.url, b.url], policy="lbgr", queue_slots=1)
    resp = router.client.post("/generate", json={"text": "hello there"})
    assert resp.status_code == 200
    decision = router.admin.get(f"/explain/{resp.headers['X-KVRoute-Decision-Id']}").json()
    chosen = resp.headers["X-KVRoute-Worker"]
    other = next(c for c in decision["candidates"] if c["worker"] != chosen)
    assert other["eligible"] is False
    assert other["reason"] == f"hold queue: sent to {chosen}, which had a free slot first"


def test_queue_settings_are_checked(routers: Callable[..., RouterServer]) -> None:
    import pytest

    from router_service.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="queue_free_at"):
        load_settings(None, queue_free_at="later")
    with pytest.raises(SettingsError, match="queue_slots"):
        load_settings(None, queue_slots=-1)


class _Queue:
    def __init__(self) -> None:
        self.settings = HoldSettings(slots=1, free_at_first_token=False, free_at_last_token=True)
        self.released: list[str] = []

    def release(self, worker: str) -> None:
        self.released.append(worker)


def _flight(body: dict[str, Any], kind: str = "generate") -> tuple[Flight, _Queue]:
    queue = _Queue()
    parsed = parse_body(body, kind, "r1")
    flight = Flight(
        state=SimpleNamespace(  # type: ignore[arg-type]
            queue=queue, router=Router(make_policy("round_robin")), now_ms=lambda: 0.0
        ),
        parsed=parsed,
        decision=SimpleNamespace(chosen="http://w", decision_id="r1"),  # type: ignore[arg-type]
        reservation=None,
        queue_slot=True,
    )
    return flight, queue


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"text": text}).encode() + b"\n\n"


def test_last_token_counts_events_not_the_word_data_in_generated_text() -> None:
    """Generated text may contain "data:" (or "metadata:"); only SSE lines count, however
    the bytes are cut into chunks."""
    flight, queue = _flight({"text": "p", "sampling_params": {"max_new_tokens": 4}})
    flight.first_chunk()
    assert flight.events_to_free == 3
    first = _event("data: x")
    stream = first + _event("metadata:\ndata:") + _event("ok")
    cut = len(first) + 2  # inside the second event's own "data:"
    flight.stream_chunk(stream[:cut])
    assert queue.released == []  # one event counted, the cut one not yet
    flight.stream_chunk(stream[cut:])
    assert queue.released == []  # the cut one is lost (later, never earlier), the third counts
    flight.stream_chunk(_event("last but one"))
    assert queue.released == ["http://w"]
    flight.stream_chunk(_event("last"))
    assert queue.released == ["http://w"]  # freed once
