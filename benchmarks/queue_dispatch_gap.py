"""The hold queue's dispatch gap: idle worker time between one request's end and the next's start.

With ``--queue-slots 1`` a worker runs one request at a time, and every hand-over (the
response ends, the router frees the slot, picks the next request, sends it; the worker
parses it) is time the worker sits idle. The simulator charges a fixed 5 ms per request for
that; this benchmark measures it on the real path (it is why the emulated fleet
trails the simulator with the queue on).

Method: one emulated worker, a kvroute router with one slot freed at the end of a response,
``--requests`` identical requests sent at once after a warm-up request has cached the prompt
(so each is a cache hit with one output token). They are served one after another, so the
time per request is ``S / scale + g``: the worker's modelled service time ``S``, divided by
the emulator's time scale, plus the hand-over ``g``, which real time does not scale. Two
scales give both. The control row sends the same requests from one client in a closed loop
straight to the worker (no router): its ``g`` is the client's own round trip, the floor
that any dispatcher pays. Median over ``--repeats``; rows alternate.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from _common import base_parser, write_json

from sim.local_cluster import LocalCluster
from sim.report import markdown_table

NAME = "queue_dispatch_gap"
ROWS = ("kvroute hold queue (1 slot, freed at the end)", "client loop, no router")


def _body(prompt_tokens: int) -> dict[str, Any]:
    return {
        "input_ids": list(range(1000, 1000 + prompt_tokens)),
        "sampling_params": {"max_new_tokens": 1},
        "stream": True,
    }


async def _send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with session.post(url + "/generate", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")


async def _per_request_ms(url: str, requests: int, body: dict[str, Any], at_once: bool) -> float:
    """Wall ms per request: all at once (the router queues them) or one after another."""
    async with aiohttp.ClientSession() as session:
        await _send(session, url, body)  # caches the prompt
        started = time.perf_counter()
        if at_once:
            await asyncio.gather(*(_send(session, url, body) for _ in range(requests)))
        else:
            for _ in range(requests):
                await _send(session, url, body)
        return (time.perf_counter() - started) * 1000.0 / requests


def measure(row: str, scale: float, requests: int, prompt_tokens: int) -> float:
    with LocalCluster(workers=1, time_scale=scale) as cluster:
        cluster.start_workers()
        if row == ROWS[0]:
            cluster.start_router(extra=["--queue-slots", "1", "--queue-free-at", "end"])
            cluster.warm_up()
            url, at_once = cluster.router_url, True
        else:
            url, at_once = cluster.worker_urls[0], False
        assert url is not None
        return asyncio.run(_per_request_ms(url, requests, _body(prompt_tokens), at_once))


def fit(scales: Sequence[float], per_request_ms: Sequence[float]) -> tuple[float, float]:
    """(S, g) of ``ms = S / scale + g`` through two points."""
    (s1, s2), (c1, c2) = scales, per_request_ms
    service = (c1 - c2) / (1.0 / s1 - 1.0 / s2)
    return service, c1 - service / s1


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--requests", type=int, default=60, help="requests per measurement")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument(
        "--scales", type=float, nargs=2, default=(1.0, 4.0), help="two emulator time scales"
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    requests = 20 if args.quick else args.requests
    if repeats < 1 or requests < 2 or args.prompt_tokens < 1:
        parser.error("--repeats >= 1, --requests >= 2 and --prompt-tokens >= 1 are needed")
    if args.scales[0] == args.scales[1] or min(args.scales) <= 0:
        parser.error("--scales needs two different positive time scales")
    started = time.perf_counter()
    samples: dict[str, list[tuple[float, float, float, float]]] = {row: [] for row in ROWS}
    for rep in range(repeats):
        for row in ROWS if rep % 2 == 0 else ROWS[::-1]:
            cycle = [measure(row, s, requests, args.prompt_tokens) for s in args.scales]
            samples[row].append((*cycle, *fit(args.scales, cycle)))
            print(f"{row}: {cycle[0]:.2f} / {cycle[1]:.2f} ms per request", file=sys.stderr)
    rows = []
    for row, got in samples.items():
        rows.append(
            {
                "row": row,
                "ms_per_request_scale_1": round(statistics.median(g[0] for g in got), 2),
                "ms_per_request_scale_2": round(statistics.median(g[1] for g in got), 2),
                "service_ms": round(statistics.median(g[2] for g in got), 2),
                "gap_ms": round(statistics.median(g[3] for g in got), 2),
                "gap_ms_samples": [round(g[3], 2) for g in got],
            }
        )
    s1, s2 = args.scales
    columns = (
        ("row", "row", "{}"),
        (f"ms/request at {s1:g}x", "ms_per_request_scale_1", "{:.2f}"),
        (f"ms/request at {s2:g}x", "ms_per_request_scale_2", "{:.2f}"),
        ("service S (emulated ms)", "service_ms", "{:.1f}"),
        ("hand-over g (wall ms)", "gap_ms", "{:.2f}"),
    )
    print(
        f"## Hold-queue dispatch gap: 1 emulated worker, {requests} cached requests of "
        f"{args.prompt_tokens} tokens, 1 output token\n"
    )
    print(markdown_table(rows, columns) + "\n")
    print(f"median of {repeats} repeats; {time.perf_counter() - started:.1f} s wall")
    path = write_json(
        args.out,
        NAME,
        {
            "quick": args.quick,
            "repeats": repeats,
            "requests": requests,
            "prompt_tokens": args.prompt_tokens,
            "scales": list(args.scales),
            "rows": rows,
        },
    )
    print(f"figures written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
