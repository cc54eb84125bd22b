"""Index sync's CPU per event, against a real redis-server.

Every replica pays per routing event twice: once to publish its own (encode, XADD) and once
per other replica to apply it (XREAD, decode, insert into the prefix index). This measures
both, in this process's CPU time on uvloop (as ``kvroute serve`` runs), for batches of 1, 8,
64 and 256 events in one stream entry (``IndexSync``'s format: at ~1,000 req/s a 5 ms
coalescing window makes batches of ~5, and a saturated replica's loop lag makes them
larger), and for the format kvroute wrote before batching (one entry per event: a pipeline
of one XADD per event, the same commands the old publisher sent; its entries are still
applied by the current subscriber). Prompts are wrk-like (``scale_out.py``): a shared
180-character prefix and a unique tail, 16-unit blocks.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis.asyncio as aioredis
import uvloop
from _common import base_parser, write_json

from router_service.index_sync import Event, IndexSync
from router_service.routing import RandomPolicy, Router
from router_service.routing.block_keys import BlockKeys, key_to_digests
from sim.local_redis import RedisServer

NAME = "index_sync_cost"
WORKER = "http://10.0.0.1:30000"
PREFIX = "You are a helpful assistant. Answer briefly. " * 4


def _sync(client: aioredis.Redis, replica: str, keys: BlockKeys) -> IndexSync:
    return IndexSync(client, "bench", replica, Router(RandomPolicy(random.Random(0)), keys=keys))


async def _send_per_event(sync: IndexSync, events: list[Event]) -> None:
    """What kvroute sent before batching: one XADD per event, pipelined."""
    async with sync.client.pipeline(transaction=False) as pipe:
        for op, worker, key, ts_ms in events:
            fields: Any = {"r": sync.origin, "o": op, "w": worker, "d": key_to_digests(key)}
            fields["t"] = repr(ts_ms)
            pipe.xadd(sync.stream, fields, maxlen=sync.max_len, approximate=True)
        await pipe.execute()


async def measure(url: str, batch: int, events: int, per_event_format: bool) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url)
    keys = BlockKeys(16)
    prompts = [keys.key(f"{PREFIX}question {i} " + "q" * 64) for i in range(events)]
    publisher, subscriber = _sync(client, "pub", keys), _sync(client, "sub", keys)
    try:
        await client.delete(publisher.stream)
        now_ms = time.time() * 1000.0
        started = time.process_time()
        for i, key in enumerate(prompts):
            publisher.publish_insert(WORKER, key, now_ms + i)  # the request path's part
        queued = [publisher._queue.get_nowait() for _ in range(events)]
        for i in range(0, events, batch):
            chunk = queued[i : i + batch]
            if per_event_format:
                await _send_per_event(publisher, chunk)
            else:
                await publisher._send(chunk)
        publish_s = time.process_time() - started
        started = time.process_time()
        last = "0-0"
        while True:
            replies: Any = await client.xread({subscriber.stream: last}, count=64)
            if not replies:
                break
            for entry_id, fields in replies[0][1]:
                subscriber._apply(fields)
                last = entry_id
        apply_s = time.process_time() - started
        assert subscriber.applied == events, subscriber.status()
        return {
            "format": "entry per event" if per_event_format else "entry per batch",
            "batch": batch,
            "events": events,
            "publish_us_per_event": round(publish_s * 1e6 / events, 2),
            "apply_us_per_event": round(apply_s * 1e6 / events, 2),
        }
    finally:
        await client.delete(publisher.stream)
        await client.aclose()


def run(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """On uvloop, as ``kvroute serve`` runs (a round trip costs less CPU there)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(argv: list[str] | None = None) -> int:
    args = base_parser(NAME, __doc__).parse_args(argv)
    events = 512 if args.quick else 8192
    server = RedisServer().start()
    try:
        rows = []
        for per_event in (False, True):
            for batch in (1, 8, 64, 256):
                # Best of 3: other jobs on a shared machine only ever add time.
                runs = [run(measure(server.url, batch, events, per_event)) for _ in range(3)]
                best = min(runs, key=lambda r: r["publish_us_per_event"] + r["apply_us_per_event"])
                rows.append(best)
                print(f"  {best}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    print(f"## Index sync CPU per event ({events} events, best of 3, real redis-server)\n")
    print("| format | events per entry | publish (us/event) | apply (us/event) |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['format']} | {r['batch']} | {r['publish_us_per_event']:.1f} | "
            f"{r['apply_us_per_event']:.1f} |"
        )
    path = write_json(args.out, NAME, {"quick": args.quick, "rows": rows})
    print(f"figures written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
