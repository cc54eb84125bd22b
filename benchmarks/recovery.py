"""A worker that was slow for a while: how soon ``lbgr`` gives it its share back.

A worker stalls (a noisy neighbour, thermal throttling, a long garbage collection) and then
recovers. ``lbgr``'s residual model (``ratio``) learned the stall as a high factor, and a worker
the router no longer picks sends no outcomes to correct it: the factor fades only as the rest
of the fleet's outcomes go by (``models.bank``: toward the fleet's factor, one half per memory
of the worker's fair share of outcomes). Two references: load-only baselines, blind to the
stall, give the worker its share at once; ``lbgr, no stall`` is the same fleet and traffic with
nothing stalled (cache affinity alone keeps a worker's share of GSP off 1/n).

Scenario: GSP (128 groups x 24 prompts, random order), simulator, profile
``llama3.1-8b-l40``; worker 0 runs at a fifth of its speed from 10 s to 30 s, then as fast as
the others. Fleets of 2, 4 and 8 workers; every worker at the profile's speed (1x) or twice
it (2x: a fleet faster than the router's prior, whose factors are near 0.5); two loads per
fleet (the arrival rate per worker: 0.25 and 0.75 req/s, light, where a stale factor is what
decides; heavier loads bring the worker back through the others' queues). Figures per cell,
over seeds: seconds from the recovery (30 s) until worker 0 has had 10 requests (fair share:
``10 / rate * workers``), its share of the requests that arrive 30-90 s (fair: 1/n), and the
p50 and p95 latency of the whole run.

``--quick``: one seed, the 4-worker fleets only.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

from _common import base_parser, parallel_map, write_json

from sim.cluster import ClusterConfig, simulate
from sim.workloads import GSPConfig, GSPWorkload

NAME = "recovery"
SLOW_FROM_S, SLOW_UNTIL_S, SLOW_SPEED = 10.0, 30.0, 0.2
WINDOW_S = 60.0  # the share is counted over the minute after the recovery
REQUESTS_BACK = 10
NO_STALL = "lbgr, no stall"
POLICIES = ("lbgr", NO_STALL, "power_of_two", "round_robin")


def run_cell(job: tuple[str, int, float, float, int]) -> dict[str, Any]:
    """One simulation: ``(policy, workers, speed, rate per worker, seed)``; the policy
    ``NO_STALL`` is ``lbgr`` on the same fleet with no stall (what worker 0 gets anyway)."""
    label, workers, speed, per_worker, seed = job
    policy = "lbgr" if label == NO_STALL else label
    stall = () if label == NO_STALL else ((0, SLOW_FROM_S, speed * SLOW_SPEED),)
    rate = per_worker * workers
    workload = GSPWorkload(
        GSPConfig(num_groups=128, prompts_per_group=24, rate=rate, seed=seed, order="random")
    )
    config = ClusterConfig(
        workers=workers,
        policy=policy,
        eviction="lru",
        worker_speeds=[speed] * workers,
        speed_changes=(*stall, (0, SLOW_UNTIL_S, speed)),
        seed=seed,
    )
    records = sorted(simulate(config, workload).records, key=lambda r: r.arrival_ms)
    start_ms = SLOW_UNTIL_S * 1000.0
    back = [r for r in records if r.arrival_ms >= start_ms and r.worker.endswith("-0")]
    back_s = (
        (back[REQUESTS_BACK - 1].arrival_ms - start_ms) / 1000.0
        if len(back) >= REQUESTS_BACK
        else None
    )
    window = [r for r in records if start_ms <= r.arrival_ms < start_ms + WINDOW_S * 1000.0]
    share = sum(r.worker.endswith("-0") for r in window) / len(window) if window else None
    latencies = sorted(r.latency_ms for r in records if r.latency_ms is not None)
    return {
        "policy": label,
        "workers": workers,
        "speed": speed,
        "rate": rate,
        "seed": seed,
        "back_s": back_s,
        "share": share,
        "p50_s": latencies[len(latencies) // 2] / 1000.0 if latencies else None,
        "p95_s": latencies[int(len(latencies) * 0.95)] / 1000.0 if latencies else None,
    }


def _band(values: Sequence[float | None], digits: int) -> str:
    """Mean (min-max) over seeds; a seed where the worker never came back shows ``never``."""
    if any(v is None for v in values):
        known = [v for v in values if v is not None]
        never = len(values) - len(known)
        head = f"{statistics.fmean(known):.{digits}f}, " if known else ""
        return f"{head}never in {never} of {len(values)}"
    nums = [float(v) for v in values if v is not None]
    if len(nums) == 1:
        return f"{nums[0]:.{digits}f}"
    return f"{statistics.fmean(nums):.{digits}f} ({min(nums):.{digits}f}-{max(nums):.{digits}f})"


def summarize_cells(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["workers"], c["speed"], c["rate"], c["policy"]), []).append(c)
    rows = []
    for (workers, speed, rate, policy), runs in groups.items():
        rows.append(
            {
                "workers": workers,
                "speed": speed,
                "rate": rate,
                "policy": policy,
                "seeds": len(runs),
                "back_s": [r["back_s"] for r in runs],
                "share": [r["share"] for r in runs],
                "p50_s": [r["p50_s"] for r in runs],
                "p95_s": [r["p95_s"] for r in runs],
                "fair_back_s": REQUESTS_BACK / rate * workers,
                "fair_share": 1.0 / workers,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "workers",
        "speed",
        "req/s",
        "policy",
        f"s to {REQUESTS_BACK} requests (fair)",
        f"share {SLOW_UNTIL_S:.0f}-{SLOW_UNTIL_S + WINDOW_S:.0f} s (fair)",
        "p50 (s)",
        "p95 (s)",
    ]
    body = [
        [
            str(r["workers"]),
            f"{r['speed']:g}x",
            f"{r['rate']:g}",
            r["policy"],
            f"{_band(r['back_s'], 1)} ({r['fair_back_s']:.0f})",
            f"{_band(r['share'], 2)} ({r['fair_share']:.2f})",
            _band(r["p50_s"], 3),
            _band(r["p95_s"], 3),
        ]
        for r in rows
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (default 3)")
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    seeds = 1 if args.quick else args.seeds
    fleets = (4,) if args.quick else (2, 4, 8)
    jobs = [
        (policy, workers, speed, per_worker, seed)
        for workers in fleets
        for speed in (1.0, 2.0)
        for per_worker in (0.25, 0.75)
        for policy in POLICIES
        for seed in range(seeds)
    ]
    cells = parallel_map(run_cell, jobs, args.jobs, NAME, progress=not args.no_progress)
    rows = summarize_cells(cells)
    print(
        f"## Worker 0 at {SLOW_SPEED:g}x speed from {SLOW_FROM_S:g} s to {SLOW_UNTIL_S:g} s, "
        f"then recovered (GSP, lru, seeds 0-{seeds - 1})\n"
    )
    print(table(rows))
    never = [r for r in cells if r["back_s"] is None and r["policy"] == "lbgr"]
    print(f"\nlbgr runs where worker 0 never got {REQUESTS_BACK} requests back: {len(never)}")
    path = write_json(args.out, NAME, {"cells": cells, "rows": rows})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
