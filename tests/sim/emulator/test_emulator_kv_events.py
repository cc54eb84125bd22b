"""The emulated worker's KV events over real ZMQ sockets, read by the router's feed.

The emulator publishes from its reference cache (``--kv-events-config``, SGLang's format,
with a replay endpoint); ``router_service.kv_events.KVEventFeed`` subscribes on loopback.
The router's block set must then hold exactly what the worker caches: what it reports as
``cached_tokens`` for the next request is what the set predicted. Waiting here is for real
sockets, polled with a deadline; no timer is slept on.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import zmq
from conftest import EmulatorServer

from router_service.kv_events import EventSource, KVEventFeed
from router_service.kv_wire import BlockStored, EventBatch, encode_batch, encode_seq
from router_service.routing.block_hash import page_hashes
from router_service.routing.block_sets import BlockSets
from sim.emulator.app import PUBLISHER
from sim.emulator.kv_publisher import KVEventPublisher, KVEventsSettings
from sim.local_cluster import free_port

PAGE = 4
SHARED = list(range(100, 140))  # 40 tokens: 10 pages


def config(events: int, replay: int) -> str:
    return json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{events}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
    )


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def generate(server: EmulatorServer, ids: list[int]) -> dict[str, Any]:
    status, body = await asyncio.to_thread(
        server.post, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    )
    assert status == 200, body
    meta: dict[str, Any] = body["meta_info"]
    return meta


def predicted(sets: BlockSets, ids: list[int], rid: str) -> int | None:
    return sets.match(rid, ids, ["w"])[0].get("w")


async def with_feed(
    sets: BlockSets, source: EventSource, body: Callable[[KVEventFeed], Awaitable[None]]
) -> None:
    feed = KVEventFeed(sets, lambda: time.monotonic() * 1000.0, replay_timeout_s=2.0)
    feed.add("w", source)
    feed.start()
    try:
        await body(feed)
    finally:
        await feed.stop()


@pytest.mark.parametrize("eviction", ["lru", "rlt"])
def test_the_feed_holds_what_the_worker_caches(
    emulator: Callable[..., EmulatorServer], eviction: str
) -> None:
    events, replay = free_port(), free_port()
    server = emulator(
        time_scale=50.0,
        eviction=eviction,
        page_size=PAGE,
        capacity_tokens=400,
        kv_events_config=config(events, replay),
    )
    sets = BlockSets()
    source = EventSource(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")

    async def body(feed: KVEventFeed) -> None:
        # Cached before the router subscribed: the replay brings it in.
        await generate(server, [*SHARED, 1, 2, 3])
        await until(lambda: predicted(sets, SHARED, "a") == 40, "the replayed history")
        assert feed.streams["w"].history == "full"
        # Many prompts through a small cache: evictions (whole leaves, or RLT's tails).
        for i in range(30):
            ids = SHARED[: 8 + i % 30] + list(range(1000 * i, 1000 * i + 20 + i))
            await generate(server, ids)
        probe = [*SHARED, 7, 7, 7, 7, 7]
        publisher = server.app[PUBLISHER]
        counters = feed.streams["w"].counters
        await until(lambda: counters.applied == publisher.published, "every batch published")
        expect = predicted(sets, probe, "probe")
        meta = await generate(server, probe)
        # The worker recomputes the last prompt token; otherwise exactly what it holds.
        assert meta["cached_tokens"] == min(expect or 0, len(probe) - 1)
        assert feed.status()["w"]["status"] == "live"

    asyncio.run(with_feed(sets, source, body))


def test_a_restarted_worker_is_rebuilt(emulator: Callable[..., EmulatorServer]) -> None:
    events, replay = free_port(), free_port()
    cfg = config(events, replay)
    first = emulator(time_scale=50.0, page_size=PAGE, kv_events_config=cfg)
    sets = BlockSets()
    source = EventSource(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")

    async def body(feed: KVEventFeed) -> None:
        await generate(first, SHARED)
        await until(lambda: predicted(sets, SHARED, "a") == 40, "the first worker's pages")
        await asyncio.to_thread(first.stop)
        await until(lambda: sets.workers["w"].status == "disconnected", "the disconnect")
        assert predicted(sets, SHARED, "b") is None  # not read while disconnected
        second = await asyncio.to_thread(lambda: EmulatorServer(first.config).start())
        try:
            await until(lambda: sets.workers["w"].status == "live", "the reconnect")
            assert predicted(sets, SHARED, "c") == 0  # a fresh cache: nothing of the old one
            await generate(second, SHARED[:20])
            await until(lambda: predicted(sets, SHARED, "d") == 20, "the new worker's pages")
        finally:
            await asyncio.to_thread(second.stop)

    asyncio.run(with_feed(sets, source, body))
    first.stop = lambda: None  # type: ignore[method-assign]  # stopped above


def test_malformed_messages_on_the_socket_are_dropped_and_counted() -> None:
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sets = BlockSets()
    good = encode_batch(
        EventBatch(0.0, [BlockStored(page_hashes([1, 2], 1), None, [1, 2], 1, None)])
    )

    async def body(feed: KVEventFeed) -> None:
        stream = feed.streams["w"]
        sent = 0
        # PUB drops what it sends before the subscription arrives: send until one is seen.
        while not stream.counters.received:
            pub.send_multipart([b"", encode_seq(sent), good])
            sent += 1
            await asyncio.sleep(0.02)
        pub.send_multipart([b"just one frame"])
        pub.send_multipart([b"", encode_seq(sent), b"\xc1\xc1 garbage"])
        pub.send_multipart([b"", encode_seq(sent + 1), b"\x00" * 4096])
        pub.send_multipart([b"", encode_seq(sent + 2), good])
        await until(lambda: stream.counters.received >= sent + 3 - 1, "the bad messages")
        await until(lambda: stream.counters.applied >= 2, "the good one after them")
        assert stream.counters.dropped == {"frames": 1, "malformed": 1, "oversized": 1}
        assert sets.workers["w"].status == "live"
        assert sets.match("r", [1, 2], ["w"])[0] == {"w": 2}

    async def run() -> None:
        feed = KVEventFeed(sets, lambda: 0.0, max_message_bytes=1024)
        feed.add("w", EventSource(f"tcp://127.0.0.1:{port}"))
        feed.start()
        try:
            await body(feed)
        finally:
            await feed.stop()

    try:
        asyncio.run(run())
    finally:
        pub.close(linger=0)
        ctx.term()


def test_a_replay_port_in_use_fails_the_start_and_closes_what_it_opened() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    events = free_port()
    settings = KVEventsSettings(
        endpoint=f"tcp://127.0.0.1:{events}",
        replay_endpoint=f"tcp://127.0.0.1:{taken.getsockname()[1]}",
    )
    try:
        with pytest.raises(zmq.ZMQError, match="Address already in use") as caught:
            KVEventPublisher(settings)
        # The PUB socket bound before the replay's failed: its port is free again at once,
        # while the traceback (which holds the publisher, as a test report does) lives on.
        with socket.socket() as again:
            again.bind(("127.0.0.1", events))
        assert caught.traceback
    finally:
        taken.close()
