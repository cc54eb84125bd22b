"""Bad input and bad fleets: JSON errors that name the field, never a bare 500 or traceback."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
from fake_worker import FakeWorker
from router_harness import RouterServer

Shared = tuple[RouterServer, tuple[FakeWorker, FakeWorker]]


def _error(resp: httpx.Response) -> dict[str, object]:
    """The OpenAI-style error body every refusal carries."""
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    assert "Traceback" not in resp.text
    error = resp.json()["error"]
    assert isinstance(error, dict)
    assert error["message"]
    assert error["code"] == resp.status_code
    return error


@pytest.mark.parametrize(
    "path", ["/generate", "/v1/completions", "/v1/chat/completions", "/explain"]
)
@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"'])
def test_invalid_json_is_400_naming_body(shared_router: Shared, path: str, raw: bytes) -> None:
    router, _ = shared_router
    resp = router.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert _error(resp)["param"] == "body"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
        ("/generate", {"text": 5}, "text"),
        ("/generate", {"text": ""}, "text"),
        ("/generate", {}, "text"),
        ("/generate", {"text": "a", "input_ids": [1]}, "text"),
        ("/generate", {"input_ids": [1, "x"]}, "input_ids"),
        ("/generate", {"input_ids": [-1]}, "input_ids"),
        ("/generate", {"text": "hi", "sampling_params": []}, "sampling_params"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"prompt": ["a", 1]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stream": 1}, "stream"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages[0]"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": "true"},
            "stream",
        ),
        ("/explain", {"unrelated": 1}, "body"),
    ],
)
def test_wrong_field_is_400_naming_it(
    shared_router: Shared, path: str, body: dict[str, object], field: str
) -> None:
    router, pool = shared_router
    served = sum(w.served() for w in pool)
    resp = router.client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = _error(resp)
    assert error["param"] == field
    assert str(error["message"]).startswith(field)
    assert sum(w.served() for w in pool) == served  # nothing was forwarded


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/nope"), ("POST", "/v2/completions"), ("DELETE", "/generate/x")]
)
def test_unknown_route_is_404_json(shared_router: Shared, method: str, path: str) -> None:
    router, _ = shared_router
    resp = router.client.request(method, path)
    assert resp.status_code == 404
    assert _error(resp)["type"] == "not_found"


def test_wrong_method_is_405_json(shared_router: Shared) -> None:
    router, _ = shared_router
    resp = router.client.get("/generate")
    assert resp.status_code == 405
    assert "GET" in str(_error(resp)["message"])


def test_unknown_decision_id_is_404_json(shared_router: Shared) -> None:
    router, _ = shared_router
    resp = router.admin.get("/explain/0123456789abcdef")
    assert resp.status_code == 404
    assert _error(resp)["param"] == "decision_id"


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_no_worker_registered_is_503(routers: Callable[..., RouterServer], path: str) -> None:
    router = routers(worker_urls=[])
    body = {"text": "hi", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    resp = router.client.post(path, json=body)
    assert resp.status_code == 503
    error = _error(resp)
    assert "no workers are registered" in str(error["message"])
    assert resp.headers["Retry-After"] == "1"


def test_no_healthy_worker_is_503_with_reasons(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    dead = workers("dead")
    dead.stop()
    sick = workers("sick")
    sick.health_status = 500
    router = routers(worker_urls=[dead.url, sick.url])
    resp = router.client.post("/generate", json={"text": "hi"})
    assert resp.status_code == 503
    message = str(_error(resp)["message"])
    assert "no healthy worker" in message
    assert dead.url in message
    assert sick.url in message
    assert router.client.get("/health").status_code == 503
    assert router.admin.post("/explain", json={"text": "hi"}).status_code == 503


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/explain"])
def test_body_over_limit_is_413(shared_router: Shared, path: str) -> None:
    router, _ = shared_router  # max_body_bytes=1024
    resp = router.client.post(path, json={"text": "x" * 2000, "prompt": "x"})
    assert resp.status_code == 413
    assert _error(resp)["param"] == "body"


def test_chunked_body_over_limit_is_413(shared_router: Shared) -> None:
    """No Content-Length to trust: the limit is enforced while reading."""
    router, pool = shared_router
    served = sum(w.served() for w in pool)

    def chunks() -> Iterator[bytes]:
        yield b'{"text": "'
        for _ in range(10):
            yield b"y" * 200
        yield b'"}'

    resp = router.client.post("/generate", content=chunks())
    assert resp.status_code == 413
    assert _error(resp)["type"] == "request_too_large"
    assert sum(w.served() for w in pool) == served
    ok = router.client.post("/generate", json={"text": "small"})
    assert ok.status_code == 200


def test_worker_gone_after_routing_is_502_json(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    """A worker that vanished between health checks: a clear 502, and it turns unhealthy."""
    worker = workers("gone")
    router = routers(worker_urls=[worker.url], health_interval_s=60)
    worker.stop()
    resp = router.client.post("/generate", json={"text": "hi"})
    assert resp.status_code == 502
    error = _error(resp)
    assert error["type"] == "upstream_unavailable"
    assert worker.url in str(error["message"])
    assert resp.headers["X-KVRoute-Worker"] == worker.url
    record = router.admin.get(f"/explain/{resp.headers['X-KVRoute-Decision-Id']}").json()
    assert record["outcome"]["status"] == "upstream_unavailable"
    # One passive failure is enough with unhealthy_after_failures=1.
    assert router.client.get("/health").json()["workers"][worker.url]["healthy"] is False


def test_worker_timeout_is_504_json(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("sleepy", delay_s=2.0)
    router = routers(worker_urls=[worker.url], request_timeout_s=0.3)
    resp = router.client.post("/generate", json={"text": "hi"})
    assert resp.status_code == 504
    assert _error(resp)["type"] == "upstream_timeout"


def test_a_bug_on_the_data_plane_is_a_logged_json_500_not_a_traceback(
    two_workers: tuple[FakeWorker, FakeWorker],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The proxied routes skip FastAPI's middleware stack (``KVRouteApp``), so they must turn
    an unexpected exception into the same JSON 500 the stack would, and log it."""
    from starlette.testclient import TestClient

    import router_service.app as app_module
    from router_service.settings import load_settings

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the proxy")

    monkeypatch.setattr(app_module, "forward", broken)
    app = app_module.create_app(load_settings(worker_urls=[w.url for w in two_workers]))
    with TestClient(app, raise_server_exceptions=False) as client:
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            resp = client.post(path, json={"text": "hi", "prompt": "hi", "messages": []})
            assert resp.status_code == 500, (path, resp.text)
            assert resp.json()["error"]["type"] == "internal_error"
            assert "a bug in the proxy" not in resp.text
            assert "Traceback" not in resp.text
        # Everything else still goes through FastAPI.
        assert client.get("/health").status_code == 200
    assert "a bug in the proxy" in caplog.text
