"""``kvroute bench`` keeps closed-loop order: a turn is sent only after its previous answer."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sim.loadgen import BenchConfig, run_bench
from sim.workloads import MultiTurnConfig, MultiTurnWorkload, WorkloadRequest


async def _serve_and_bench(workload: list[WorkloadRequest]) -> dict[int, tuple[float, float]]:
    """A streaming /generate that answers in 50 ms; (start, end) per prompt length."""
    seen: dict[int, tuple[float, float]] = {}

    async def generate(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        body = await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        await asyncio.sleep(0.05)
        await resp.write(b'data: {"text": "x"}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        seen[len(body["input_ids"])] = (started, time.perf_counter())
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("")).rstrip("/")
        results = await run_bench(workload, BenchConfig(url=url))
    assert all(r.ok for r in results), [r.error for r in results]
    return seen


def test_bench_sends_a_turn_after_the_previous_answer() -> None:
    # Every slot at t = 0 (infinite rate): without the dependency all turns would race.
    cfg = MultiTurnConfig(num_clients=2, turns=(3,), user_len=5, output_len=2, rate=float("inf"))
    workload = list(MultiTurnWorkload(cfg))
    seen = asyncio.run(_serve_and_bench(workload))
    by_id = {r.rid: len(r.prompt) for r in workload}
    assert len(set(by_id.values())) == 3  # prompt lengths tell the turns apart
    for client in range(2):
        for k in (1, 2):
            _, previous_end = seen[by_id[f"mt-{client}-{k - 1}"]]
            start, _ = seen[by_id[f"mt-{client}-{k}"]]
            assert start >= previous_end - 0.005  # the server ends its reply just before


def test_bench_refuses_a_dependency_that_does_not_come_earlier() -> None:
    workload = [WorkloadRequest("b", 0.0, "xy", 1, after="a")]
    with pytest.raises(ValueError, match="waits for 'a'"):
        asyncio.run(run_bench(workload, BenchConfig(url="http://127.0.0.1:9")))
