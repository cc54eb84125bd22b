"""The router reads workers' own load from their ``/metrics``: real emulated workers (the same
gauges SGLang exports), real HTTP, requests the router did not send."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from router_harness import EmulatedWorker, RouterServer, free_port, wait_until

from router_service.worker_metrics import MetricsPoller, WorkerLoad, parse_load


@pytest.fixture
def emulators() -> Iterator[Callable[[int], list[EmulatedWorker]]]:
    started: list[EmulatedWorker] = []

    def make(n: int) -> list[EmulatedWorker]:
        pool = [EmulatedWorker(free_port()).spawn() for _ in range(n)]
        started.extend(pool)
        for worker in pool:
            worker.wait_healthy()
        return pool

    yield make
    for worker in started:
        worker.kill()


def _long_request(worker: str, tokens: int, done: threading.Event) -> None:
    body = {"input_ids": list(range(1, 2001)), "sampling_params": {"max_new_tokens": tokens}}
    body["sampling_params"]["ignore_eos"] = True
    with httpx.Client(timeout=120) as client:
        client.post(worker + "/generate", json=body)
    done.set()


@pytest.mark.slow
def test_load_sent_around_the_router_shows_in_its_view_and_in_routing(
    routers: Callable[..., RouterServer], emulators: Callable[[int], list[EmulatedWorker]]
) -> None:
    busy, idle = emulators(2)
    text = httpx.get(busy.url + "/metrics").text
    load = parse_load(text)
    assert load is not None
    assert (load.requests, load.kv_tokens) == (0.0, 0.0)
    router = routers(worker_urls=[busy.url, idle.url], worker_metrics_s=0.1)
    # Six long answers sent to one worker directly, past the router.
    events = [threading.Event() for _ in range(6)]
    for done in events:
        threading.Thread(target=_long_request, args=(busy.url, 3000, done), daemon=True).start()

    def seen() -> dict[str, Any]:
        listed = router.control.get("/workers").json()["workers"]
        view: dict[str, Any] = next(w for w in listed if w["url"] == busy.url)
        return view

    assert wait_until(lambda: seen()["other_requests"] >= 6, 20, 0.05), seen()
    view = seen()
    assert view["in_flight"] == 0  # none of them is the router's own
    assert view["other_kv_tokens"] >= 6 * 2000  # their prompts are in the worker's KV
    # A long answer routed now goes to the worker that is not decoding six others.
    body = {
        "input_ids": list(range(5000, 5500)),
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
    }
    explained = router.admin.post("/explain", json=body).json()
    lines = {c["worker"]: c for c in explained["candidates"]}
    assert explained["chosen"] == idle.url
    assert lines[busy.url]["queue_ms"] > lines[idle.url]["queue_ms"]
    for done in events:
        assert done.wait(120)
    # Once they are done the worker reports nothing beyond the router's own again.
    assert wait_until(lambda: seen()["other_requests"] == 0, 20, 0.05), seen()


def test_a_worker_without_load_metrics_counts_as_nothing_beyond_the_router(
    routers: Callable[..., RouterServer], workers: Callable[..., Any]
) -> None:
    """A worker whose /metrics is missing or foreign (the fake worker has none) is routed on
    the router's ledger alone, and /health is not affected."""
    w = workers("w")
    router = routers(worker_urls=[w.url], worker_metrics_s=0.05)
    assert router.client.post("/generate", json={"text": "hello"}).status_code == 200
    listed = router.control.get("/workers").json()["workers"][0]
    assert (listed["other_requests"], listed["other_kv_tokens"]) == (0.0, 0.0)
    assert router.client.get("/health").json()["status"] == "ok"


def test_a_long_metrics_page_is_read_to_its_end() -> None:
    """A real worker's /metrics runs to tens of kilobytes (histograms first): the gauges at
    its end are read, not only the first chunk that arrived."""
    page = "# a histogram's lines\n" * 20_000 + (
        "sglang:num_running_reqs 3\nsglang:num_queue_reqs 2\nsglang:num_used_tokens 900\n"
    )

    async def serve(request: web.Request) -> web.Response:
        return web.Response(text=page)

    async def run() -> WorkerLoad | None:
        app = web.Application()
        app.router.add_get("/metrics", serve)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                return await MetricsPoller(lambda: session, lambda url: (0.0, 0.0)).read(url)
        finally:
            await runner.cleanup()

    assert len(page) > 400_000
    assert asyncio.run(run()) == WorkerLoad(5.0, 900.0)
