"""Simulator speed on one core: the paper's full GSP run (target <= 60 s).

4 workers, GSP 128 groups x 32 prompts in random order at 12 req/s, every prompt token
simulated, for ``lbgr`` + ``rlt`` and ``cache_aware`` (paper preset) + ``lru``. One process,
pinned to one CPU where the OS allows; ``time.perf_counter`` around ``simulate`` alone, and
separately around the workload's generation. Each is repeated and the median reported.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from _common import base_parser, write_json

from sim.cluster import ClusterConfig, simulate
from sim.report import markdown_table
from sim.workloads import GSPConfig, GSPWorkload

NAME = "sim_speed"
TARGET_S = 60.0
COMBOS: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("lbgr", "lbgr", {"model": "ewmean"}, "rlt"),
    ("cache_aware(paper)", "cache_aware", {"preset": "paper"}, "lru"),
)


def pin_to_one_cpu() -> int | None:
    """Run on a single CPU (the lowest one allowed); None where affinity is unsupported."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def time_generation(config: GSPConfig) -> tuple[GSPWorkload, float]:
    started = time.perf_counter()
    workload = GSPWorkload(config)
    return workload, time.perf_counter() - started


def time_simulation(
    workload: GSPWorkload, policy: str, params: dict[str, Any], eviction: str
) -> tuple[float, int]:
    """Seconds spent in ``simulate`` and the number of requests that completed."""
    config = ClusterConfig(
        workers=4, policy=policy, policy_params=params, eviction=eviction, seed=0
    )
    started = time.perf_counter()
    run = simulate(config, workload)
    wall_s = time.perf_counter() - started
    return wall_s, sum(1 for r in run.records if r.finished_ms is not None)


def measure(config: GSPConfig, repeats: int) -> tuple[list[float], dict[str, list[float]], int]:
    """Generation seconds per repeat, simulate seconds per combo and repeat, requests."""
    gen_s: list[float] = []
    sim_s: dict[str, list[float]] = {f"{label}+{ev}": [] for label, _, _, ev in COMBOS}
    requests = 0
    for _ in range(repeats):
        workload, seconds = time_generation(config)
        gen_s.append(seconds)
        requests = len(workload)
        for label, policy, params, eviction in COMBOS:
            seconds, completed = time_simulation(workload, policy, params, eviction)
            if completed != requests:
                raise RuntimeError(f"{label}+{eviction}: {completed} of {requests} completed")
            sim_s[f"{label}+{eviction}"].append(seconds)
    return gen_s, sim_s, requests


def summary_rows(
    gen_s: Sequence[float], sim_s: dict[str, list[float]], requests: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, times in sim_s.items():
        median = statistics.median(times)
        rows.append(
            {
                "run": f"simulate {name}",
                "median_s": round(median, 3),
                "min_s": round(min(times), 3),
                "max_s": round(max(times), 3),
                "requests_per_s": round(requests / median, 1),
                "target": "yes" if median <= TARGET_S else "no",
                "times_s": [round(t, 4) for t in times],
            }
        )
    gen_median = statistics.median(gen_s)
    rows.append(
        {
            "run": "generate workload",
            "median_s": round(gen_median, 3),
            "min_s": round(min(gen_s), 3),
            "max_s": round(max(gen_s), 3),
            "requests_per_s": round(requests / gen_median, 1),
            "target": "-",
            "times_s": [round(t, 4) for t in gen_s],
        }
    )
    return rows


COLUMNS = (
    ("run", "run", "{}"),
    ("median (s)", "median_s", "{:.2f}"),
    ("min (s)", "min_s", "{:.2f}"),
    ("max (s)", "max_s", "{:.2f}"),
    ("requests/s", "requests_per_s", "{:,.0f}"),
    (f"<= {TARGET_S:g} s", "target", "{}"),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (median reported)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    config = (
        GSPConfig(num_groups=32, prompts_per_group=8, order="random")
        if args.quick
        else GSPConfig(order="random")
    )
    cpu = pin_to_one_cpu()
    gen_s, sim_s, requests = measure(config, args.repeats)
    rows = summary_rows(gen_s, sim_s, requests)

    scale = f"{config.num_groups} groups x {config.prompts_per_group} prompts"
    print(f"## Simulator speed: GSP {scale} ({requests} requests), 4 workers, one core\n")
    print(markdown_table(rows, COLUMNS) + "\n")
    print(f"median of {args.repeats} repeats; pinned to CPU {cpu}")
    sys.stdout.flush()
    path = write_json(
        args.out,
        NAME,
        {
            "quick": args.quick,
            "workload": {
                "name": "gsp",
                "groups": config.num_groups,
                "prompts_per_group": config.prompts_per_group,
                "order": config.order,
                "rate": config.rate,
                "requests": requests,
            },
            "workers": 4,
            "repeats": args.repeats,
            "pinned_cpu": cpu,
            "target_s": TARGET_S,
            "rows": rows,
        },
    )
    print(f"figures written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
