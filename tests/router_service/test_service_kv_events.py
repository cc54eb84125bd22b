"""The router reads emulated workers' KV events: /explain, /workers, /metrics, fallback.

Real processes' code on loopback: emulated SGLang workers (``sim.emulator``) publishing
their reference cache's events over ZMQ, and the router app on uvicorn subscribing with
``worker_kv_events``. A worker whose events stop is made stale by advancing the block sets'
clock (``refresh``), not by waiting for the timer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from emulator_server import EmulatorServer
from router_harness import ADMIN_TOKEN, RouterServer, free_port, service_settings, wait_until

from sim.emulator import EmulatorConfig
from sim.emulator.server import RUNTIME

PAGE = 4
PROMPT = list(range(200, 264))  # 64 tokens: 16 pages


class Emulator(EmulatorServer):
    """An emulated worker publishing KV events (or not: ``events=False``), served from a
    thread."""

    def __init__(self, *, events: bool = True, bind: str = "127.0.0.1", **config: Any) -> None:
        self.events, self.replay = free_port(), free_port()
        kv = {"endpoint": f"tcp://{bind}:{self.events}"}
        kv["replay_endpoint"] = f"tcp://{bind}:{self.replay}"
        super().__init__(
            EmulatorConfig(
                time_scale=50.0,
                page_size=PAGE,
                kv_events_config=json.dumps(kv) if events else None,
                **config,
            )
        )

    @property
    def source(self) -> str:
        return f"tcp://127.0.0.1:{self.events},tcp://127.0.0.1:{self.replay}"


@pytest.fixture
def emulators() -> Iterator[Callable[..., Emulator]]:
    started: list[Emulator] = []

    def make(**config: Any) -> Emulator:
        emu = Emulator(**config).start()
        started.append(emu)
        return emu

    yield make
    for emu in started:
        emu.stop()


AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def control(router: RouterServer) -> httpx.Client:
    """The control plane's client (its own listener when the router has one)."""
    client: httpx.Client = getattr(router, "control", router.client)
    client.headers.update(AUTH)
    return client


def admin(router: RouterServer) -> httpx.Client:
    """The data port as an operator sees it (per-worker figures in /explain)."""
    client: httpx.Client = getattr(router, "admin", router.client)
    client.headers.update(AUTH)
    return client


def explain(router: RouterServer, body: dict[str, Any]) -> dict[str, Any]:
    resp = admin(router).post("/explain", json=body)
    assert resp.status_code == 200, resp.text
    return {c["worker"]: c for c in resp.json()["candidates"]}


def live(router: RouterServer, url: str) -> bool:
    worker = router.app.state.kvroute.router.blocks.workers.get(url)
    return worker is not None and worker.status == "live"


@pytest.fixture
def routed(
    emulators: Callable[..., Emulator],
) -> Iterator[tuple[RouterServer, Emulator, Emulator]]:
    with_events, without = emulators(), emulators()
    settings = service_settings(
        worker_urls=[with_events.url, without.url],
        worker_kv_events=[f"{with_events.url}={with_events.source}"],
        admin_token=ADMIN_TOKEN,
        policy="cache_aware",
    )
    router = RouterServer(settings).start()
    try:
        assert wait_until(lambda: live(router, with_events.url), 10), "events never went live"
        yield router, with_events, without
    finally:
        router.stop()


def test_explain_says_which_source_each_candidate_used(
    routed: tuple[RouterServer, Emulator, Emulator],
) -> None:
    router, with_events, without = routed
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    worker = with_events.url
    # Straight to the worker, past the router: only its events can tell the router.
    assert httpx.post(f"{worker}/generate", json=body, timeout=30).status_code == 200
    blocks = router.app.state.kvroute.router.blocks
    assert wait_until(lambda: blocks.workers[worker].blocks == len(PROMPT) // PAGE, 5)
    shown = explain(router, body)
    assert shown[worker]["cache_source"] == "events"
    assert shown[worker]["cache_fallback"] is None
    assert shown[worker]["cached"] == len(PROMPT)  # every page, as the events say
    assert shown[without.url]["cache_source"] == "approximate"
    assert shown[without.url]["cache_fallback"] is None  # it has no stream: nothing to say
    assert shown[without.url]["cached"] == 0
    text = explain(router, {"text": "no token ids here"})
    assert text[worker]["cache_source"] == "approximate"
    assert "no token ids" in text[worker]["cache_fallback"]
    listed = {w["url"]: w for w in control(router).get("/workers").json()["workers"]}
    assert listed[worker]["kv_events"]["status"] == "live"
    assert listed[without.url]["kv_events"] is None
    # The chunk size it read from the worker's own /server_info (the emulator's profile's).
    chunk = with_events.app[RUNTIME].profile.chunked_prefill_tokens
    assert listed[worker]["kv_events"]["chunk_tokens"] == chunk == 8192


def test_a_worker_whose_events_stop_falls_back_and_says_so(
    routed: tuple[RouterServer, Emulator, Emulator],
) -> None:
    router, with_events, _ = routed
    worker = with_events.url
    with_events.app[RUNTIME].on_events = lambda events: None  # its publisher goes silent
    state = router.app.state.kvroute
    blocks = state.router.blocks
    # Silence alone is an idle worker; silence after the answer to a request that stored
    # pages is not (Router.first_token and complete say so; here the test says it).
    assert blocks.refresh(state.now_ms() + 3_600_000.0) == []
    blocks.expect(worker, uncached_tokens=PAGE, now_ms=state.now_ms())
    later = state.now_ms() + state.settings.kv_events_stale_s * 1000.0 + 1.0
    assert blocks.refresh(later) == [worker]
    shown = explain(router, {"input_ids": PROMPT})
    assert shown[worker]["cache_source"] == "approximate"
    assert shown[worker]["cache_fallback"].startswith("events stale")
    metrics = control(router).get("/metrics").text
    assert f'kvroute_kv_events_live{{status="stale",worker="{worker}"}} 0.0' in metrics


def test_an_answer_that_stored_pages_makes_a_silent_publisher_stale(
    emulators: Callable[..., Emulator],
) -> None:
    """The wiring: the router's answer (here non-streamed) starts the stale clock."""
    emulator = emulators()
    worker = emulator.url
    settings = service_settings(
        worker_urls=[worker],
        worker_kv_events=[f"{worker}={emulator.source}"],
        admin_token=ADMIN_TOKEN,
        policy="cache_aware",
    )
    router = RouterServer(settings).start()
    try:
        assert wait_until(lambda: live(router, worker), 10), "events never went live"
        emulator.app[RUNTIME].on_events = lambda events: None  # its publisher goes silent
        state = router.app.state.kvroute
        blocks, stale_ms = state.router.blocks, state.settings.kv_events_stale_s * 1000.0
        sent = state.now_ms()
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        assert router.client.post("/generate", json=body).status_code == 200
        answered = state.now_ms()
        assert blocks.refresh(sent + stale_ms) == []
        assert blocks.refresh(answered + stale_ms + 1.0) == [worker]
    finally:
        router.stop()


def test_workers_can_be_added_with_their_events(
    routed: tuple[RouterServer, Emulator, Emulator], emulators: Callable[..., Emulator]
) -> None:
    router, _, _ = routed
    third = emulators()
    api = control(router)
    bad = api.post("/workers", json={"url": third.url, "kv_events": "tcp://*:5557"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "kv_events"
    far = api.post("/workers", json={"url": third.url, "kv_events": "tcp://10.9.9.9:5557"})
    assert far.status_code == 403
    redis = api.post("/workers", json={"url": third.url, "kv_events": "tcp://127.0.0.1:6379"})
    assert redis.status_code == 403  # an allowed host, but a port the router refuses a worker
    assert "127.0.0.1:6379 is not allowed" in redis.json()["error"]["message"]
    added = api.post("/workers", json={"url": third.url, "kv_events": third.source})
    assert added.status_code == 201, added.text
    assert wait_until(lambda: live(router, third.url), 10)
    assert api.delete("/workers", params={"url": third.url}).status_code == 200
    assert third.url not in router.app.state.kvroute.router.blocks.workers


def test_the_router_subscribes_to_the_events_a_worker_describes(
    emulators: Callable[..., Emulator],
) -> None:
    """``kv_events_discover``: the router reads each worker's ``/server_info`` and subscribes
    to the publisher it names (a wildcard bind address on the worker's own host); a worker
    that names none stays on the approximate index, and ``GET /workers`` says why."""
    described, plain = emulators(bind="*"), emulators(events=False)
    settings = service_settings(
        worker_urls=[described.url, plain.url],
        admin_token=ADMIN_TOKEN,
        policy="cache_aware",
        kv_events_discover=True,
        kv_events_discover_s=0.1,
    )
    router = RouterServer(settings).start()
    try:
        assert wait_until(lambda: live(router, described.url), 10), "events never went live"
        listed = {w["url"]: w for w in control(router).get("/workers").json()["workers"]}
        stream = listed[described.url]["kv_events"]
        assert listed[described.url]["kv_events_discovery"] == "subscribed"
        assert stream["endpoint"] == f"tcp://127.0.0.1:{described.events}"
        assert stream["replay"] == f"tcp://127.0.0.1:{described.replay}"
        assert listed[plain.url]["kv_events"] is None
        assert "no KV-event publisher" in listed[plain.url]["kv_events_discovery"]
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        assert httpx.post(f"{described.url}/generate", json=body, timeout=30).status_code == 200
        blocks = router.app.state.kvroute.router.blocks
        assert wait_until(lambda: blocks.workers[described.url].blocks == len(PROMPT) // PAGE, 5)
        shown = explain(router, body)
        assert shown[described.url]["cache_source"] == "events"
        assert shown[described.url]["cached"] == len(PROMPT)
        assert shown[plain.url]["cache_source"] == "approximate"
        # Removed, the worker's stream and what discovery knew of it go with it.
        assert control(router).delete("/workers", params={"url": described.url}).is_success
        assert described.url not in blocks.workers
        assert described.url not in router.app.state.kvroute.kv_discovery.outcomes
    finally:
        router.stop()


def test_discovery_is_off_unless_asked(emulators: Callable[..., Emulator]) -> None:
    described = emulators()
    settings = service_settings(worker_urls=[described.url], admin_token=ADMIN_TOKEN)
    router = RouterServer(settings).start()
    try:
        assert router.app.state.kvroute.kv_discovery is None
        listed = control(router).get("/workers").json()["workers"]
        assert listed[0]["kv_events"] is None
        assert listed[0]["kv_events_discovery"] is None
    finally:
        router.stop()
