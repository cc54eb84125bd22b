"""Bad input and too much of it: the right 4xx with a message, never a 500 or a reset.

Malformed and hostile JSON (deep nesting, 5000-digit numbers, invalid UTF-8), wrong types,
negative or absurd token counts, oversized bodies, unknown fields on control-plane bodies,
and admission control: the in-flight cap (503) and the token bucket (429), both with
Retry-After, and admission slots released on every path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fake_worker import FakeWorker
from router_harness import RouterServer, http_client

Shared = tuple[RouterServer, tuple[FakeWorker, FakeWorker]]
JSON = {"content-type": "application/json"}
MAX_NEW_TOKENS = 2**31 - 1
SP_MAX = "sampling_params.max_new_tokens"


def _new_tokens(value: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": value}}


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert "Traceback" not in resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["message"]
    assert error["code"] == status
    return error


@pytest.fixture(scope="module")
def learning_router() -> Iterator[RouterServer]:
    """lbgr with the linear model: it builds features from max_new_tokens (float math)."""
    from router_harness import service_settings

    pool = (FakeWorker("a").start(), FakeWorker("b").start())
    router = RouterServer(
        service_settings(worker_urls=[w.url for w in pool], policy="lbgr", model="linear")
    ).start()
    yield router
    router.stop()
    for worker in pool:
        worker.stop()


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/explain"])
@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"text": "hi"', "not valid JSON"),
        (b'{"text": "hi"} trailing', "not valid JSON"),
        (b"{'text': 'single quotes'}", "not valid JSON"),
        (b'{"text": "a\xc3\x28b"}', "UTF-8"),  # invalid continuation byte
        (b'{"text": "\xc0\xaf"}', "UTF-8"),  # overlong encoding
        (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b"[" * 200_000, "nested too deeply"),
        (b'{"text": "a", "n": 1' + b"0" * 5000 + b"}", "number too long"),
        (b"null", "JSON object"),
    ],
    ids=[
        "truncated",
        "trailing",
        "quotes",
        "bad-utf8",
        "overlong-utf8",
        "deep",
        "deep-array",
        "long-int",
        "null",
    ],
)
def test_hostile_json_is_400_naming_the_body(
    learning_router: RouterServer, path: str, raw: bytes, says: str
) -> None:
    resp = learning_router.client.post(path, content=raw, headers=JSON)
    error = _error(resp, 400)
    assert error["param"] == "body"
    assert says in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", _new_tokens(-1), SP_MAX),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 2**31}},
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 10**400}},
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 5.0}},
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": True}},
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": "9"}},
            "sampling_params.max_new_tokens",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": -1}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "max_completion_tokens": 10**12},
            "max_completion_tokens",
        ),
        ("/generate", {"input_ids": [1, 2**40]}, "input_ids"),
        ("/generate", {"input_ids": [[], [1]]}, "input_ids[0]"),
        ("/generate", {"text": ["a", 2]}, "text"),
        ("/generate", {"text": "hi", "stream": "true"}, "stream"),
        ("/v1/chat/completions", {"messages": [{"role": 1}]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [["user", "hi"]]}, "messages[0]"),
        ("/v1/completions", {"prompt": None}, "prompt"),
    ],
)
def test_wrong_types_and_token_counts_are_400_naming_the_field(
    learning_router: RouterServer, path: str, body: dict[str, Any], field: str
) -> None:
    resp = learning_router.client.post(path, json=body)
    error = _error(resp, 400)
    assert error["param"] == field, error
    explained = learning_router.admin.post("/explain", json=body)
    assert explained.status_code == 400


@pytest.mark.parametrize("tokens", [0, 1, MAX_NEW_TOKENS])
def test_token_counts_at_the_bounds_are_routed(learning_router: RouterServer, tokens: int) -> None:
    body = {"text": "bounds", "sampling_params": {"max_new_tokens": tokens}}
    assert learning_router.client.post("/generate", json=body).status_code == 200
    assert learning_router.admin.post("/explain", json=body).status_code == 200


def test_huge_bodies_are_413_and_never_reach_a_worker(shared_router: Shared) -> None:
    router, pool = shared_router  # max_body_bytes=1024
    served = sum(w.served() for w in pool)
    huge = b'{"text": "' + b"x" * (8 * 1024 * 1024) + b'"}'
    declared = router.client.post("/generate", content=huge, headers=JSON)
    assert _error(declared, 413)["type"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(huge), 64 * 1024):
            yield huge[i : i + 64 * 1024]

    chunked = router.client.post("/v1/completions", content=chunks(), headers=JSON)
    assert _error(chunked, 413)["type"] == "request_too_large"
    assert sum(w.served() for w in pool) == served
    assert router.client.post("/generate", json={"text": "small"}).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("POST", "/workers", {"url": "http://127.0.0.1:9", "weight": 3}, "weight"),
        ("PUT", "/policy", {"name": "lbgr", "temperature": 0.5}, "temperature"),
        ("PUT", "/models", {"spec": "linear", "everywhere": True}, "everywhere"),
        ("POST", "/models/challenger", {"spec": "linear", "shadow": 1}, "shadow"),
        ("POST", "/workers", {"url": 5}, "url"),
        ("PUT", "/policy", {"name": ["lbgr"]}, "name"),
        ("PUT", "/policy", {"name": "lbgr", "params": []}, "params"),
        ("PUT", "/models", {"spec": 7}, "spec"),
    ],
)
def test_control_plane_unknown_fields_and_wrong_types_are_400_naming_the_field(
    routers: Callable[..., RouterServer],
    two_workers: tuple[FakeWorker, FakeWorker],
    method: str,
    path: str,
    body: dict[str, Any],
    field: str,
) -> None:
    router = routers(worker_urls=[w.url for w in two_workers])
    resp = router.control.request(method, path, json=body)
    error = _error(resp, 400)
    assert error["param"] == field
    assert field in error["message"]
    assert len(router.control.get("/workers").json()["workers"]) == 2  # nothing registered


# -- admission control ----------------------------------------------------------------------
def _post(base_url: str, body: dict[str, Any]) -> httpx.Response:
    with http_client(base_url) as client:
        return client.post("/generate", json=body)


@pytest.mark.slow
def test_in_flight_cap_answers_503_with_retry_after_and_frees_slots(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    slow = workers("slow", delay_s=1.0)
    router = routers(worker_urls=[slow.url], max_in_flight=2, max_body_bytes=4096)
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(_post, router.url, {"text": f"held {i}"}) for i in range(2)]
        deadline = time.monotonic() + 5
        while slow.served() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = router.client.post("/generate", json={"text": "one too many"})
        error = _error(refused, 503)
        assert error["type"] == "overloaded"
        assert int(refused.headers["Retry-After"]) >= 1
        assert "limit 2" in error["message"]
        assert [f.result(10).status_code for f in held] == [200, 200]
    assert slow.served() == 2  # the refused one never reached the worker

    # Slots come back on every path: bad input, too large, streams, worker failures.
    slow.delay_s = 0.0
    for _ in range(3):
        _error(router.client.post("/generate", content=b"{", headers=JSON), 400)
        _error(router.client.post("/generate", content=b"x" * 16_384, headers=JSON), 413)
        stream = router.client.post("/generate", json={"text": "s", "stream": True})
        assert stream.text.endswith("data: [DONE]\n\n")
    slow.fail_status = 503
    for _ in range(3):
        _error(router.client.post("/generate", json={"text": "refused"}), 503)
    slow.fail_status = None
    both = [_post(router.url, {"text": f"after {i}"}) for i in range(2)]
    assert [r.status_code for r in both] == [200, 200]


def test_rate_limit_answers_429_with_retry_after(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, FakeWorker]
) -> None:
    router = routers(worker_urls=[w.url for w in two_workers], rate_limit_rps=2, rate_limit_burst=3)
    answers = [router.client.post("/generate", json={"text": f"r{i}"}) for i in range(8)]
    statuses = [a.status_code for a in answers]
    assert statuses[:3] == [200, 200, 200]  # the burst
    assert statuses.count(429) >= 4
    limited = next(a for a in answers if a.status_code == 429)
    assert _error(limited, 429)["type"] == "rate_limited"
    assert int(limited.headers["Retry-After"]) >= 1
    # (Tokens coming back with time: TokenBuckets' doctest, on an injected clock.)


def test_concurrent_bad_input_never_breaks_good_traffic(shared_router: Shared) -> None:
    router, _ = shared_router
    bad = [b"{", b"[]", b'{"text": 5}', b'{"text": "\xff"}', b"[" * 5000]
    results: list[int] = []

    def hammer(i: int) -> None:
        with http_client(router.url) as client:
            for j in range(10):
                raw = bad[(i + j) % len(bad)]
                results.append(client.post("/generate", content=raw, headers=JSON).status_code)
                results.append(client.post("/generate", json={"text": f"ok {i}.{j}"}).status_code)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(set(results)) in ([200, 400], [200, 400, 413])
    assert results.count(200) == 40
