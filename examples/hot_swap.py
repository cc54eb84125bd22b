"""Hot-swap LBGR's residual model under load, and watch the models' rolling error.

Sends a steady GSP load through the router (``sim.loadgen``, streaming) and, while it runs:

1. the configured champion (``ewmean`` by default) learns the residual latency;
2. in the second quarter of the requests, ``PUT /models`` swaps in fresh models of another
   kind (``--swap-to``): version + 1;
3. in the third, ``POST /models/challenger`` starts a challenger (``--challenger``) that
   learns in shadow on the same outcomes;
4. in the fourth, the challenger is promoted (``POST /models/promote``) if its rolling MAE
   is lower than the champion's, else dropped (``DELETE /models/challenger``).

Every ``--interval-s`` it prints ``GET /models``: version, each model's kind, rolling mean
absolute error (ms) and samples. No request may fail across the swaps: the exit status is 1
if one did.

    python examples/hot_swap.py                      # own emulated cluster, ~35 s
    python examples/hot_swap.py --url http://127.0.0.1:8000 --token "$KVROUTE_ADMIN_TOKEN"

Models are per router replica: in the docker compose stack, point both ``--url`` and
``--control-url`` at one replica's control listener (router-1's is published on
127.0.0.1:8001; it serves the data plane too), not at the balancer, which has no control
plane; repeat a swap on every replica to change the whole fleet (docs/operations.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from typing import Any

from example_cluster import Router, add_cluster_arguments, open_router

from sim.loadgen import BenchConfig, RequestResult, run_bench
from sim.workloads import GSPConfig, GSPWorkload, WorkloadRequest

HEADER = (
    f"{'t s':>6} {'done':>5} {'failed':>6} {'ver':>3}  {'champion':<9} {'MAE ms':>8} "
    f"{'samples':>7}  {'challenger':<10} {'MAE ms':>8} {'samples':>7}  event"
)


def _spec(text: str) -> Any:
    """A model kind name, or a JSON spec ``{"kind": ..., "params": {...}}``."""
    return json.loads(text) if text.lstrip().startswith("{") else text


def _bank(status: dict[str, Any] | None) -> tuple[str, float | None, int | None]:
    if status is None:
        return "-", None, None
    kind = status["spec"]["kind"] + ("+overrides" if status.get("overrides") else "")
    return kind, status.get("mae_ms"), status.get("samples")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


class Watch:
    """Polls ``GET /models`` and prints one row per poll and per event."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.started = time.perf_counter()
        self.done = 0
        self.failed = 0
        self.rows: list[dict[str, Any]] = []

    def on_done(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += 0 if result.ok else 1

    async def row(self, event: str = "") -> dict[str, Any]:
        answer = await asyncio.to_thread(self.router.json, "GET", "/models")
        models = answer.get("models")
        if models is None:
            raise SystemExit(f"the router's policy is {answer.get('policy')!r}: use lbgr")
        champion, challenger = _bank(models["champion"]), _bank(models["challenger"])
        row = {
            "t_s": round(time.perf_counter() - self.started, 2),
            "completed": self.done,
            "failed": self.failed,
            "version": models["version"],
            "champion": dict(zip(("kind", "mae_ms", "samples"), champion, strict=True)),
            "challenger": dict(zip(("kind", "mae_ms", "samples"), challenger, strict=True)),
            "event": event,
        }
        self.rows.append(row)
        print(
            f"{row['t_s']:>6.1f} {self.done:>5} {self.failed:>6} {models['version']:>3}  "
            f"{champion[0]:<9} {_num(champion[1], '8.1f'):>8} {_num(champion[2], 'd'):>7}  "
            f"{challenger[0]:<10} {_num(challenger[1], '8.1f'):>8} "
            f"{_num(challenger[2], 'd'):>7}  {event}",
            flush=True,
        )
        return row

    async def every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.row()


def _phases(workload: list[WorkloadRequest], count: int) -> list[list[WorkloadRequest]]:
    """``count`` consecutive slices, each with arrivals counted from its own start."""
    size = -(-len(workload) // count)
    slices = [workload[i : i + size] for i in range(0, len(workload), size)]
    return [
        [replace(r, arrival_ms=r.arrival_ms - part[0].arrival_ms) for r in part] for part in slices
    ]


async def swap_under_load(router: Router, args: argparse.Namespace) -> dict[str, Any]:
    """Four phases of load, back to back; each swap happens inside a phase, with that
    phase's first requests in flight, so it is made under load. A phase is a fixed share of
    the requests rather than of the time, so each model sees traffic however fast or slow
    the workers answer."""
    workload = list(
        GSPWorkload(
            GSPConfig(
                num_groups=args.groups,
                prompts_per_group=max(1, -(-args.requests // args.groups)),
                total_lens=(512, 1024, 2048, 4096),
                rate=args.rate,
                seed=args.seed,
            ),
            limit=args.requests,
        )
    )
    watch = Watch(router)
    config = BenchConfig(url=router.url, time_scale=args.time_scale)
    print(HEADER)
    await watch.row(f"load: {len(workload)} requests at {args.rate:g}/s, champion as configured")
    ticker = asyncio.create_task(watch.every(args.interval_s))
    promoted = False
    results: list[RequestResult] = []

    async def swap(step: int) -> None:
        nonlocal promoted
        call = router.json
        if step == 1:
            await asyncio.to_thread(call, "PUT", "/models", {"spec": _spec(args.swap_to)})
            await watch.row(f"PUT /models: hot swap to fresh {args.swap_to}")
        elif step == 2:
            body = {"spec": _spec(args.challenger)}
            await asyncio.to_thread(call, "POST", "/models/challenger", body)
            await watch.row(f"POST /models/challenger: {args.challenger} learns in shadow")
        elif step == 3:
            now = await watch.row("compare")
            champion, challenger = now["champion"]["mae_ms"], now["challenger"]["mae_ms"]
            promoted = challenger is not None and (champion is None or challenger < champion)
            if promoted:
                await asyncio.to_thread(call, "POST", "/models/promote")
                await watch.row("POST /models/promote: the challenger's error is lower")
            else:
                await asyncio.to_thread(call, "DELETE", "/models/challenger")
                await watch.row("DELETE /models/challenger: the champion's error is lower")

    for step, phase in enumerate(_phases(workload, 4)):
        load = asyncio.create_task(run_bench(phase, config, watch.on_done))
        if step:
            # Swap once the phase's third request has left: requests are in flight.
            third = phase[min(2, len(phase) - 1)].arrival_ms / 1000.0 / args.time_scale
            await asyncio.sleep(third + 0.01)
            await swap(step)
        results += await load
    ticker.cancel()
    final = await watch.row("load finished")
    return {
        "rows": watch.rows,
        "requests": len(results),
        "completed": sum(1 for r in results if r.ok),
        "failed": sum(1 for r in results if not r.ok),
        "promoted": promoted,
        "final_version": final["version"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=240, help="requests in the load")
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s (emulated time)")
    parser.add_argument("--groups", type=int, default=16, help="GSP shared-prefix groups")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--swap-to", default="linear", help="model spec for PUT /models")
    parser.add_argument("--challenger", default="tree", help="model spec of the challenger")
    parser.add_argument("--interval-s", type=float, default=2.0, help="seconds between rows")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON last")
    # Time scale 1: the emulated workers answer in real time, so the router's latency model
    # and the residuals it learns have the magnitudes they would have on GPUs.
    add_cluster_arguments(parser, time_scale=1.0)
    args = parser.parse_args()
    with open_router(args) as router:
        result = asyncio.run(swap_under_load(router, args))
    print(
        f"\n{result['completed']}/{result['requests']} requests completed, "
        f"{result['failed']} failed; model version {result['final_version']}",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
