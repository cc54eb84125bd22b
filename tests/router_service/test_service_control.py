"""The control plane over HTTP: bearer auth, workers, policy, model hot swap, challenger."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fake_worker import FakeWorker
from router_harness import ADMIN_TOKEN, RouterServer, async_http_client, wait_until

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADMIN_ENDPOINTS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/workers", None),
    ("POST", "/workers", {"url": "http://127.0.0.1:9"}),
    ("DELETE", "/workers?url=http://127.0.0.1:9", None),
    ("GET", "/policy", None),
    ("PUT", "/policy", {"name": "lbgr"}),
    ("GET", "/models", None),
    ("PUT", "/models", {"spec": "linear"}),
    ("POST", "/models/challenger", {"spec": "linear"}),
    ("GET", "/models/challenger", None),
    ("POST", "/models/promote", None),
    ("DELETE", "/models/challenger", None),
]


@pytest.fixture
def secured(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, FakeWorker]
) -> RouterServer:
    return routers(worker_urls=[w.url for w in two_workers], admin_token=ADMIN_TOKEN)


def _admin(router: RouterServer, method: str, path: str, body: Any = None) -> httpx.Response:
    return router.control_public.request(method, path, json=body, headers=AUTH)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", f"Basic {ADMIN_TOKEN}", "Bearer", f"Bearer {ADMIN_TOKEN}x", ""],
)
def test_admin_endpoints_refuse_without_the_token(
    secured: RouterServer, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path, body in ADMIN_ENDPOINTS:
        resp = secured.control_public.request(method, path, json=body, headers=headers)
        assert resp.status_code == 401, (method, path, resp.text)
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        error = resp.json()["error"]
        assert error["type"] == "unauthorized"
        assert "Bearer" in error["message"]
    # Nothing refused took effect.
    assert _admin(secured, "GET", "/policy").json()["name"] == "lbgr"
    assert len(_admin(secured, "GET", "/workers").json()["workers"]) == 2
    assert _admin(secured, "GET", "/models").json()["models"]["version"] == 1


def test_admin_endpoints_accept_the_token(secured: RouterServer) -> None:
    for method, path, body in ADMIN_ENDPOINTS:
        resp = _admin(secured, method, path, body)
        assert resp.status_code in (200, 201), (method, path, resp.text)


def test_data_plane_needs_no_token(secured: RouterServer) -> None:
    assert secured.client.post("/generate", json={"text": "hi"}).status_code == 200
    assert secured.admin.post("/explain", json={"text": "hi"}).status_code == 200
    assert secured.client.get("/health").status_code == 200
    assert secured.control.get("/metrics").status_code == 200
    assert secured.client.get("/v1/models").status_code == 200


def test_control_plane_is_open_without_a_configured_token(router: RouterServer) -> None:
    assert router.control.get("/workers").status_code == 200


def test_add_worker_at_run_time(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    a, b = workers("a"), workers("b")
    router = routers(worker_urls=[a.url], policy="round_robin")
    resp = router.control.post("/workers", json={"url": b.url + "/"})
    assert resp.status_code == 201
    view = resp.json()
    assert view["url"] == b.url  # normalized: no trailing slash
    assert view["healthy"] is True
    assert [w["url"] for w in router.control.get("/workers").json()["workers"]] == [a.url, b.url]
    seen = Counter(
        router.client.post("/generate", json={"text": f"p{i}"}).headers["X-KVRoute-Worker"]
        for i in range(6)
    )
    assert seen == {a.url: 3, b.url: 3}


def test_add_unreachable_worker_is_registered_unhealthy(
    router: RouterServer, workers: Callable[..., FakeWorker]
) -> None:
    gone = workers("gone")
    gone.stop()
    resp = router.control.post("/workers", json={"url": gone.url})
    assert resp.status_code == 201
    assert resp.json()["healthy"] is False
    for i in range(4):
        assert (
            router.client.post("/generate", json={"text": f"x{i}"}).headers["X-KVRoute-Worker"]
            != gone.url
        )


@pytest.mark.parametrize("how", ["query", "json"])
def test_removed_worker_gets_no_traffic_and_its_index_is_dropped(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker], how: str
) -> None:
    a, b = workers("a"), workers("b")
    # The paper's tie rule: a tie between the two idle workers goes to the first, a.
    router = routers(worker_urls=[a.url, b.url], policy="lbgr", policy_params={"ties": "first"})
    prompt = "shared system prompt " * 10
    first = router.client.post("/generate", json={"text": prompt})
    assert first.headers["X-KVRoute-Worker"] == a.url
    assert router.control.get("/workers").json()["workers"][0]["index_units"] == len(prompt)

    if how == "query":
        resp = router.control.delete("/workers", params={"url": a.url})
    else:
        resp = router.control.request("DELETE", "/workers", content=json.dumps({"url": a.url}))
    assert resp.status_code == 200
    assert resp.json() == {"removed": a.url, "workers": [b.url]}

    served = a.served()
    for i in range(5):
        resp = router.client.post("/generate", json={"text": prompt + str(i)})
        assert resp.status_code == 200
        assert resp.headers["X-KVRoute-Worker"] == b.url
    assert a.served() == served
    assert router.client.get("/health").json()["workers"].keys() == {b.url}

    # Re-added, it starts from nothing: no index entries, no load, no learned model (it is
    # priced at the fleet's learned factor, b's).
    assert router.control.post("/workers", json={"url": a.url}).status_code == 201
    views = {w["url"]: w for w in router.control.get("/workers").json()["workers"]}
    assert views[a.url]["index_units"] == 0
    assert views[a.url]["in_flight"] == 0
    explained = router.admin.post("/explain", json={"text": prompt}).json()
    cand = next(c for c in explained["candidates"] if c["worker"] == a.url)
    peer = next(c for c in explained["candidates"] if c["worker"] == b.url)
    assert cand["cached"] == 0
    assert cand["queue_ms"] == 0.0
    assert peer["residual_ms"] != 0.0
    assert cand["residual_ms"] / cand["base_ms"] == pytest.approx(
        peer["residual_ms"] / (peer["base_ms"] + peer["queue_ms"])
    )
    per_worker = router.control.get("/models").json()["models"]["champion"]["per_worker_mae_ms"]
    assert a.url not in per_worker


def test_worker_removed_while_in_flight_stays_forgotten(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    """The late outcome of a removed worker's request must not bring its state back."""
    a, b = workers("a", delay_s=0.6), workers("b")
    # The paper's tie rule: a tie between the two idle workers goes to the first, a.
    router = routers(worker_urls=[a.url, b.url], policy="lbgr", policy_params={"ties": "first"})
    result: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: result.append(httpx.post(router.url + "/generate", json={"text": "x" * 50}))
    )
    thread.start()
    try:
        assert wait_until(lambda: a.served() == 1)
        assert router.control.delete("/workers", params={"url": a.url}).status_code == 200
        assert router.control.post("/workers", json={"url": a.url}).status_code == 201
    finally:
        thread.join(10)
    assert result[0].status_code == 200
    assert result[0].headers["X-KVRoute-Worker"] == a.url
    models = router.control.get("/models").json()["models"]["champion"]
    assert a.url not in models["per_worker_mae_ms"]
    assert models["samples"] == 0
    views = {w["url"]: w for w in router.control.get("/workers").json()["workers"]}
    assert views[a.url]["in_flight"] == 0
    assert views[a.url]["pending_units"] == 0
    cand = router.admin.post("/explain", json={"text": "x" * 50}).json()["candidates"]
    fresh = next(c for c in cand if c["worker"] == a.url)
    assert (fresh["cached"], fresh["residual_ms"], fresh["queue_ms"]) == (0, 0.0, 0.0)
    metrics = router.control.get("/metrics").text
    assert f'kvroute_cache_hit_ratio_estimate{{worker="{a.url}"}} 0.0' in metrics


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "field"),
    [
        ("POST", "/workers", {"url": "ftp://example.com"}, 400, "url"),
        ("POST", "/workers", {"url": "http://h:1?x=1"}, 400, "url"),
        ("POST", "/workers", {"uri": "http://h:1"}, 400, "url"),
        ("POST", "/workers", {}, 400, "url"),
        ("DELETE", "/workers?url=http://127.0.0.1:9", None, 404, "url"),
        ("DELETE", "/workers", None, 400, "url"),
        ("PUT", "/policy", {"name": "no-such-policy"}, 400, "name"),
        ("PUT", "/policy", {"name": "lbgr", "params": {"bogus": 1}}, 400, "params"),
        ("PUT", "/policy", {"params": {}}, 400, "name"),
        ("PUT", "/policy", {"name": "lbgr", "params": {"alpha": "x"}}, 400, "params"),
        ("PUT", "/policy", {"name": "lbgr", "params": {"margin_ms": None}}, 400, "params"),
        (
            "PUT",
            "/policy",
            {"name": "cache_aware", "params": {"balance_abs_threshold": "3"}},
            400,
            "params",
        ),
        ("PUT", "/policy", {"name": "cache_aware", "params": {"preset": "nope"}}, 400, "params"),
        ("PUT", "/models", {"spec": "no-such-model"}, 400, "spec"),
        ("PUT", "/models", {"spec": {"kind": "linear", "params": {"bogus": 1}}}, 400, "spec"),
        ("PUT", "/models", {"spec": "ewmean", "worker": "http://127.0.0.1:9"}, 404, "worker"),
        ("POST", "/models/challenger", {"spec": 5}, 400, "spec"),
        ("PUT", "/models", {"spec": ["linear"]}, 400, "spec"),
        ("PUT", "/models", {"spec": "linear", "sharing": "sometimes"}, 400, "spec"),
        ("POST", "/models/promote", None, 409, None),
    ],
)
def test_control_plane_bad_input(
    router: RouterServer,
    method: str,
    path: str,
    body: Any,
    status: int,
    field: str | None,
) -> None:
    resp = router.control.request(method, path, json=body)
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text
    error = resp.json()["error"]
    assert error["param"] == field
    assert error["message"]
    # Refused means unchanged: the router still routes with what it had.
    assert router.control.get("/policy").json()["name"] == "lbgr"
    assert router.client.post("/generate", json={"text": "still fine"}).status_code == 200


def test_duplicate_worker_is_409(router: RouterServer, two_workers: tuple[FakeWorker, ...]) -> None:
    resp = router.control.post("/workers", json={"url": two_workers[0].url})
    assert resp.status_code == 409
    assert resp.json()["error"]["type"] == "conflict"


def test_unknown_policy_lists_the_known_ones(router: RouterServer) -> None:
    message = router.control.put("/policy", json={"name": "nope"}).json()["error"]["message"]
    for name in ("lbgr", "cache_aware", "round_robin", "random", "power_of_two"):
        assert name in message


def test_switch_policy_at_run_time(
    router: RouterServer, two_workers: tuple[FakeWorker, FakeWorker]
) -> None:
    assert router.control.get("/policy").json() == {"name": "lbgr", "params": {}}
    resp = router.control.put("/policy", json={"name": "round_robin"})
    assert resp.status_code == 200
    assert resp.json() == {"name": "round_robin", "params": {}}
    assert router.control.get("/policy").json()["name"] == "round_robin"
    assert router.client.get("/health").json()["policy"] == "round_robin"
    resps = [router.client.post("/generate", json={"text": "same"}) for _ in range(4)]
    assert Counter(r.headers["X-KVRoute-Worker"] for r in resps) == {
        two_workers[0].url: 2,
        two_workers[1].url: 2,
    }
    record = router.admin.get(f"/explain/{resps[0].headers['X-KVRoute-Decision-Id']}").json()
    assert record["policy"] == "round_robin"
    # Models belong to a learning policy only.
    answer = router.control.get("/models").json()
    assert (answer["policy"], answer["models"]) == ("round_robin", None)
    assert router.control.put("/models", json={"spec": "linear"}).status_code == 409

    params = {"preset": "paper"}
    resp = router.control.put("/policy", json={"name": "cache_aware", "params": params})
    assert resp.status_code == 200, resp.text
    assert router.control.get("/policy").json() == {"name": "cache_aware", "params": params}
    assert router.admin.post("/explain", json={"text": "x"}).json()["policy"] == "cache_aware"


def test_model_swap_per_worker_and_for_all(
    router: RouterServer, two_workers: tuple[FakeWorker, FakeWorker]
) -> None:
    _a, b = two_workers
    models = router.control.get("/models").json()
    assert models["policy"] == "lbgr"
    assert models["models"]["version"] == 1
    assert models["models"]["champion"]["spec"]["kind"] == "ewmean"
    resp = router.control.put("/models", json={"spec": "none", "worker": b.url})
    assert resp.status_code == 200
    status = resp.json()
    assert status["version"] == 2
    assert status["champion"]["overrides"] == {b.url: {"kind": "none", "params": {}}}
    explained = router.admin.post("/explain", json={"text": "q"}).json()
    assert explained["model"]["version"] == 2
    spec = {"kind": "linear", "params": {}}
    status = router.control.put("/models", json={"spec": spec}).json()
    assert status["version"] == 3
    assert status["champion"]["spec"]["kind"] == "linear"
    assert status["champion"]["overrides"] == {}
    assert router.admin.post("/explain", json={"text": "q"}).json()["model"] == {
        "kind": "linear",
        "version": 3,
    }


def test_hot_swap_under_concurrent_load_loses_no_request(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    pool = [workers("a", delay_s=0.05), workers("b", delay_s=0.05), workers("c", delay_s=0.05)]
    router = routers(worker_urls=[w.url for w in pool], policy="lbgr")
    specs = ["linear", "tree", "ratio", "none", {"kind": "linear", "params": {}}, "ewmean"]

    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with (
            async_http_client(router.url) as client,
            async_http_client(router.control_url) as control,
        ):

            async def swaps() -> list[httpx.Response]:
                out = []
                for spec in specs:
                    await asyncio.sleep(0.03)
                    out.append(await control.put("/models", json={"spec": spec}, headers=AUTH))
                return out

            async def one(i: int, stream: bool) -> httpx.Response:
                body = {"text": f"req {i} " + "y" * (i % 17), "stream": stream}
                resp = await client.post("/generate", json=body)
                await resp.aread()
                return resp

            requests = [one(i, stream=i % 4 == 0) for i in range(100)]
            *resps, swapped = await asyncio.gather(*requests, swaps())
            return resps, swapped

    resps, swapped = asyncio.run(run())
    assert [r.status_code for r in swapped] == [200] * len(specs)
    assert [r.status_code for r in resps] == [200] * 100
    for resp in resps:
        if resp.headers["content-type"].startswith("text/event-stream"):
            assert resp.text.endswith("data: [DONE]\n\n")
    status = router.control.get("/models").json()["models"]
    assert status["version"] == 1 + len(specs)
    assert status["champion"]["failures"] == 0
    workers_view = router.control.get("/workers").json()["workers"]
    assert all(w["in_flight"] == 0 for w in workers_view)
    # Every request's decision closed with an outcome.
    for resp in resps[:10]:
        record = router.admin.get(f"/explain/{resp.headers['X-KVRoute-Decision-Id']}").json()
        assert record["outcome"]["status"] == "ok"


def test_challenger_start_status_promote(
    router: RouterServer, two_workers: tuple[FakeWorker, FakeWorker]
) -> None:
    challenger = router.control.get("/models/challenger").json()
    assert challenger["challenger"] is None
    assert challenger["champion"]["spec"]["kind"] == "ewmean"

    resp = router.control.post("/models/challenger", json={"spec": "linear"})
    assert resp.status_code == 201
    assert resp.json()["challenger"]["spec"]["kind"] == "linear"
    for i in range(6):
        assert router.client.post("/generate", json={"text": f"learn {i}"}).status_code == 200
    status = router.control.get("/models/challenger").json()
    assert status["challenger"]["samples"] == 6  # it learned in shadow
    assert status["champion"]["samples"] == 6
    assert status["version"] == 1  # shadow learning does not change the champion

    promoted = router.control.post("/models/promote").json()
    assert promoted["version"] == 2
    assert promoted["champion"]["spec"]["kind"] == "linear"
    assert promoted["champion"]["samples"] == 6  # what it learned in shadow came along
    assert promoted["challenger"] is None
    again = router.control.post("/models/promote")
    assert again.status_code == 409
    assert "no challenger" in again.json()["error"]["message"]

    router.control.post("/models/challenger", json={"spec": "tree"})
    dropped = router.control.delete("/models/challenger").json()
    assert dropped["challenger"] is None
    assert dropped["champion"]["spec"]["kind"] == "linear"
