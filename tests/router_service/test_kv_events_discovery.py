"""What a worker's ``/server_info`` ``kv_events`` descriptor names (SGLang's shape), and what
the router's discovery does with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_harness import service_settings

from router_service.kv_events import (
    EventDiscovery,
    EventSource,
    KVEventFeed,
    disallowed_host,
    source_from_server_info,
)
from router_service.routing.block_sets import BlockSets


def described(**fields: Any) -> dict[str, Any]:
    base = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 16,
        "dp_size": 1,
    }
    return {"version": "0.5.23", "kv_events": {**base, **fields}}


@pytest.mark.parametrize("wildcard", ["*", "0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_means_the_workers_own_host(wildcard: str) -> None:
    info = described(endpoint_host=wildcard, replay_endpoint_port_base=5558)
    assert source_from_server_info("http://10.1.2.3:30000", info) == EventSource(
        "tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"
    )


def test_an_ipv6_worker_keeps_its_brackets() -> None:
    source = source_from_server_info("http://[fd00::7]:30000", described())
    assert source == EventSource("tcp://[fd00::7]:5557", None)
    source = source_from_server_info("http://[fd00::7]", described())
    assert source == EventSource("tcp://[fd00::7]:5557", None)


def test_a_worker_url_without_a_port_gives_its_host() -> None:
    assert source_from_server_info("http://worker-0", described()) == EventSource(
        "tcp://worker-0:5557", None
    )


def test_a_named_host_is_used_as_given() -> None:
    assert source_from_server_info(
        "http://worker-0:30000", described(endpoint_host="10.0.0.9")
    ) == EventSource("tcp://10.0.0.9:5557", None)
    assert source_from_server_info(
        "http://worker-0:30000", described(endpoint_host="fd00::9")
    ) == EventSource("tcp://[fd00::9]:5557", None)


@pytest.mark.parametrize(
    ("info", "says"),
    [
        ({"version": "0.5.23"}, "no KV-event publisher"),
        ({"kv_events": None}, "no KV-event publisher"),
        ([], "not a JSON object"),
        ({"kv_events": "tcp://x:1"}, "not an object"),
        (described(publisher="null"), "not 'zmq'"),
        (described(dp_size=2), "2 data-parallel ranks"),
        (described(endpoint_port_base=0), "endpoint_port_base is not a TCP port"),
        (described(endpoint_port_base="5557"), "endpoint_port_base is not a TCP port"),
        (described(endpoint_port_base=True), "endpoint_port_base is not a TCP port"),
        (described(replay_endpoint_port_base=70000), "replay_endpoint_port_base"),
    ],
)
def test_what_names_no_publisher_says_why(info: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        source_from_server_info("http://10.1.2.3:30000", info)


# -- EventDiscovery against a real HTTP server on loopback ------------------------------------
class InfoServer:
    """Serves ``/server_info`` as a test sets it: a JSON body, a status, a redirect, or an
    answer held until the test lets it go."""

    def __init__(self) -> None:
        self.body: Any = described(endpoint_host="127.0.0.1", replay_endpoint_port_base=5558)
        self.raw: bytes | None = None
        self.status = 200
        self.redirect: str | None = None
        self.hold: asyncio.Event | None = None
        self.asked = asyncio.Event()
        self.url = ""
        self.path = "/server_info"  # SGLang before the rename: /get_server_info

    async def _info(self, request: web.Request) -> web.Response:
        self.asked.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.redirect is not None:
            raise web.HTTPFound(self.redirect)
        if self.raw is not None:
            return web.Response(body=self.raw, content_type="application/json")
        return web.json_response(self.body, status=self.status)

    async def __aenter__(self) -> InfoServer:
        app = web.Application()
        app.router.add_get(self.path, self._info)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def _discovery(
    session: aiohttp.ClientSession,
    registered: Callable[[str], bool] = lambda url: True,
    max_info_bytes: int = 4096,
) -> EventDiscovery:
    feed = KVEventFeed(BlockSets(), lambda: 0.0)
    settings = service_settings()  # the default allow-list: loopback
    return EventDiscovery(
        feed,
        lambda: session,
        lambda source: disallowed_host(settings, source),
        registered=registered,
        max_info_bytes=max_info_bytes,
    )


async def _check(server: InfoServer, **kwargs: Any) -> EventDiscovery:
    async with aiohttp.ClientSession() as session:
        discovery = _discovery(session, **kwargs)
        await discovery.check(server.url)
        return discovery


def _ask(max_info_bytes: int = 4096, **serves: Any) -> tuple[EventDiscovery, str]:
    """Discovery asks once a server set up as ``serves`` says (``InfoServer``'s fields)."""

    async def run() -> tuple[EventDiscovery, str]:
        server = InfoServer()
        for key, value in serves.items():
            setattr(server, key, value)
        async with server:
            return await _check(server, max_info_bytes=max_info_bytes), server.url

    return asyncio.run(run())


def test_a_described_loopback_publisher_is_subscribed() -> None:
    discovery, url = _ask()
    assert discovery.feed.sources == {
        url: EventSource("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    }
    assert discovery.outcomes[url] == "subscribed"


def test_a_long_answer_under_the_cap_is_read_whole() -> None:
    """SGLang's server info lists every server argument: an answer of many reads is joined."""
    body = {**described(endpoint_host="127.0.0.1"), "padding": "x" * 300_000}
    discovery, url = _ask(max_info_bytes=1 << 20, body=body)
    assert discovery.outcomes[url] == "subscribed"


def test_an_older_sglang_is_asked_at_get_server_info() -> None:
    discovery, url = _ask(path="/get_server_info")
    assert discovery.outcomes[url] == "subscribed"
    assert url in discovery.feed.sources


def test_a_worker_that_serves_neither_says_so() -> None:
    discovery, url = _ask(path="/health")
    assert discovery.feed.sources == {}
    assert "neither /server_info nor /get_server_info" in discovery.outcomes[url]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"body": described(endpoint_host="10.66.0.1")}, "10.66.0.1:5557 is not allowed"),
        ({"body": described(endpoint_host="127.0.0.1", endpoint_port_base=6379)}, ":6379"),
        ({"redirect": "http://10.66.0.1:80/server_info"}, "answered 302"),
        ({"status": 500}, "answered 500"),
        ({"raw": b'{"kv_events": "' + b"x" * 5000 + b'"}'}, "larger than 4096 bytes"),
        ({"raw": b"not json"}, "Expecting value"),
    ],
)
def test_what_the_router_must_not_follow_is_refused_and_said(
    change: dict[str, Any], says: str
) -> None:
    """A publisher off the allow-list or on a port the router refuses a worker (Redis's), a
    redirect (never followed), an error, a body past the cap, or no JSON: no subscription,
    and the outcome says why."""
    discovery, url = _ask(**change)
    assert discovery.feed.sources == {}
    assert says in discovery.outcomes[url]


def test_a_worker_removed_while_it_was_asked_is_not_subscribed() -> None:
    """The answer comes after the worker left the pool: nothing is subscribed (it would keep a
    stream for a worker that is gone, and refuse the worker's next registration)."""
    pool: set[str] = set()

    async def run() -> EventDiscovery:
        async with InfoServer() as server, aiohttp.ClientSession() as session:
            pool.add(server.url)
            server.hold = asyncio.Event()
            discovery = _discovery(session, registered=lambda url: url in pool)
            asking = asyncio.create_task(discovery.check(server.url))
            await server.asked.wait()
            pool.discard(server.url)  # DELETE /workers, while the answer is on its way
            discovery.forget(server.url)
            server.hold.set()
            await asking
            return discovery

    discovery = asyncio.run(run())
    assert discovery.feed.sources == {}
    assert discovery.outcomes == {}


def test_a_round_that_fails_does_not_end_discovery() -> None:
    rounds: list[int] = []

    def urls() -> list[str]:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("a bug in the pool")
        return []

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(_discovery(session).run(urls, 0.001))
            while len(rounds) < 3:
                await asyncio.sleep(0.001)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())
    assert len(rounds) >= 3


# -- the chunk size the feed reads from each worker it subscribes to -----------------------------
def _learn(**serves: Any) -> tuple[KVEventFeed, str]:
    """A feed with one worker (no socket opened) reads that worker's ``/server_info``."""

    async def run() -> tuple[KVEventFeed, str]:
        server = InfoServer()
        for key, value in serves.items():
            setattr(server, key, value)
        async with server, aiohttp.ClientSession() as session:
            feed = KVEventFeed(BlockSets(), lambda: 0.0, session=lambda: session)
            feed.add(server.url, EventSource("tcp://127.0.0.1:5557", None))
            await feed._learn_chunk(server.url)
            return feed, server.url

    return asyncio.run(run())


@pytest.mark.parametrize(("size", "known"), [(8192, 8192), (-1, None), ("8192", None)])
def test_the_feed_reads_each_workers_chunk_size(size: Any, known: int | None) -> None:
    feed, url = _learn(body={**described(), "chunked_prefill_size": size})
    assert feed.blocks.workers[url].chunk_tokens == known
    assert (url in feed.chunk_reasons) == (known is None)


@pytest.mark.parametrize(
    ("serves", "says"),
    [({"path": "/health"}, "neither /server_info"), ({"status": 503}, "answered 503")],
)
def test_a_worker_that_does_not_say_counts_its_pages_whole_and_says_why(
    serves: dict[str, Any], says: str
) -> None:
    feed, url = _learn(**serves)
    assert feed.blocks.workers[url].chunk_tokens is None
    assert says in feed.chunk_reasons[url]
