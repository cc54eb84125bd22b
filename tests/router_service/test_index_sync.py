"""``IndexSync``'s stream format against a real redis-server: one entry per batch of events,
decoded in order by the other replicas; entries of pre-batching replicas still apply; the
stream keeps about ``max_len`` events however they are batched."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Mapping
from typing import Any

import pytest
import redis.asyncio as aioredis
from router_harness import RedisServer
from router_harness import run_async as run

from router_service.index_sync import IndexSync, decode_batch, encode_batch
from router_service.routing import RandomPolicy, Router
from router_service.routing.block_keys import BlockKeys, key_to_digests

W, V = "http://127.0.0.1:30001", "http://127.0.0.1:30002"
KEYS = BlockKeys(block_units=4)


def _sync(client: aioredis.Redis, cluster: str, replica: str, **kwargs: object) -> IndexSync:
    router = Router(RandomPolicy(random.Random(0)), keys=KEYS)
    return IndexSync(client, cluster, replica, router, **kwargs)  # type: ignore[arg-type]


def _fields(raw: Mapping[Any, Any]) -> dict[bytes, bytes]:
    """What a reader gets back from Redis for the fields ``raw`` (all bytes)."""
    out = {}
    for k, v in raw.items():
        key = k if isinstance(k, bytes) else str(k).encode()
        out[key] = v if isinstance(v, bytes) else str(v).encode()
    return out


def test_a_batch_decodes_to_its_events_in_order() -> None:
    k1, k2 = KEYS.key("abcdefghijkl"), KEYS.key("abcdefgh")
    events = [
        ("a", V, "", 1.0),
        ("i", W, k1, 1000.5),
        ("i", V, k2, 1001.25),
        ("x", W, "", 1002.0),
        ("i", W, k2 + "x", 1003.0),  # a stray odd character is dropped, as on the wire
        ("i", V, "", 1004.0),
    ]
    fields = encode_batch("me/1", events)
    assert fields["r"] == "me/1"
    assert fields["o"] == "b"
    assert fields["w"] == f"{V}\n{W}"  # each worker once
    decoded = decode_batch(_fields(fields))
    assert decoded == [*events[:4], ("i", W, k2, 1003.0), events[5]]
    assert len(k1) == 6
    assert len(k2) == 4


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        (b"d", b"\x00" * 3, "digests or workers"),
        (b"n", b"\x01\x00\x00\x00" * 2, "different lengths"),
        (b"i", b"\x05\x00", "digests or workers"),
        (b"ops", None, "malformed"),
    ],
)
def test_a_malformed_batch_is_refused_and_skipped(
    field: bytes, value: bytes | None, why: str
) -> None:
    fields = _fields(encode_batch("peer/1", [("i", W, KEYS.key("abcdefgh"), 5.0)]))
    if value is None:
        del fields[field]
    else:
        fields[field] = value
    with pytest.raises(ValueError, match=why):
        decode_batch(fields)
    sync = _sync(None, "c", "me")  # type: ignore[arg-type]  # never touches Redis
    sync._apply(fields)
    assert (sync.malformed, sync.applied) == (1, 0)
    assert sync.router.index.match(KEYS.key("abcdefgh"))[1] == {}


def test_one_entry_per_batch_and_every_other_replica_applies_it(
    redis_server: RedisServer, cluster_name: str
) -> None:
    prompts = [f"{i:02d}: a prompt of its own" for i in range(40)]

    async def body() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        lags: list[float] = []
        a = _sync(client, cluster_name, "a", coalesce_s=0.02)
        b = _sync(client, cluster_name, "b", on_lag=lags.append)
        try:
            a.start()
            b.start()
            now_ms = time.time() * 1000.0
            for i, prompt in enumerate(prompts):  # queued within one coalescing window
                a.publish_insert(W if i % 2 else V, KEYS.key(prompt), now_ms + i)
            a.publish_worker(V, added=False)
            deadline = time.monotonic() + 5.0
            while b.applied < len(prompts) + 1:
                assert time.monotonic() < deadline, b.status()
                await asyncio.sleep(0.01)
            assert a.published == len(prompts) + 1
            assert a.entries_published == 1
            assert await client.xlen(a.stream) == 1
            for i, prompt in enumerate(prompts):
                key = KEYS.key(prompt)
                worker = W if i % 2 else V
                assert b.router.index.match(key) == (len(key), {worker: len(key)})
            assert len(lags) == len(prompts)
            assert all(0 <= lag < 5 for lag in lags)
            assert a.applied == 0  # its own entry: applied when it routed, not again
            assert b.malformed == 0
        finally:
            await a.stop()
            await b.stop()
            await client.aclose()

    run(body)


def test_entries_of_replicas_before_batching_still_apply(
    redis_server: RedisServer, cluster_name: str
) -> None:
    key = KEYS.key("an older replica routed this prompt")

    async def body() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        added: list[str] = []
        b = _sync(client, cluster_name, "b", on_worker_added=added.append)
        try:
            stream = b.stream
            now_ms = repr(time.time() * 1000.0)
            await client.xadd(stream, {"r": "old/1", "o": "a", "w": V, "t": now_ms})
            old: dict[Any, Any] = {"r": "old/1", "o": "i", "w": W, "d": key_to_digests(key)}
            old["t"] = now_ms
            await client.xadd(stream, old)
            b.start()
            deadline = time.monotonic() + 5.0
            while b.applied < 2:
                assert time.monotonic() < deadline, b.status()
                await asyncio.sleep(0.01)
            assert added == [V]
            assert b.router.index.match(key) == (len(key), {W: len(key)})
        finally:
            await b.stop()
            await client.aclose()

    run(body)


def test_the_stream_keeps_about_max_len_events_however_they_are_batched(
    redis_server: RedisServer, cluster_name: str
) -> None:
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        # Trimming is approximate in whole stream nodes: nodes of one entry make it exact.
        old: Any = (await client.config_get("stream-node-max-entries"))["stream-node-max-entries"]
        await client.config_set("stream-node-max-entries", 1)
        a = _sync(client, cluster_name, "a", max_len=100)
        try:
            key = KEYS.key("a prompt of a few blocks")
            for batch in range(30):  # 30 batches of 10 events: 300 events
                await a._send([("i", W, key, float(batch))] * 10)
                a.published += 10
            entries: Any = await client.xrange(a.stream)
            events = sum(len(decode_batch(fields)) for _id, fields in entries)
            assert 100 <= events <= 110  # about max_len events: 10 or 11 entries of 10
            # The newest survive.
            assert decode_batch(entries[-1][1])[0][3] == 29.0
        finally:
            await client.config_set("stream-node-max-entries", old)
            await client.aclose()

    run(body)


def test_a_task_that_fails_is_restarted_and_says_so_until_it_runs_again() -> None:
    """An unexpected error in a background loop restarts it (with backoff) instead of ending
    the sync silently; ``status()`` shows it (and /health turns "degraded")."""

    async def scenario() -> tuple[list[str], dict[str, Any]]:
        sync = _sync(aioredis.Redis(), "c", "r")
        calls: list[str] = []
        during: dict[str, Any] = {}

        async def flaky() -> None:
            calls.append("run")
            if len(calls) == 1:
                raise KeyError("boom")
            during.update(sync.status())
            await asyncio.sleep(3600)

        task = asyncio.ensure_future(sync._supervised(flaky))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(calls) == 2:
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return calls, during

    calls, during = run(scenario)
    assert calls == ["run", "run"]
    assert during["restarts"] == 1
    assert during["state"] == "restarting"  # until a read succeeds again
    assert "KeyError" in during["last_error"]
