"""kvroute's routing policies side by side, on the same workers and the same traffic.

For each ``--policies`` entry: flush every worker's cache, start a fresh ``kvroute serve``
with that policy in front of them, send the same seeded GSP load (``sim.loadgen``: open loop,
streaming, so TTFT is measured) and read the hit rate from the workers' own counters
(``sglang:cached_tokens_total / sglang:prompt_tokens_total``). A fresh router per policy
keeps the comparison fair: no policy inherits another's prefix index or learned residuals.

    python examples/compare_routers.py                    # 4 emulated workers, ~1 min
    python examples/compare_routers.py --worker-urls http://gpu-a:30000 http://gpu-b:30000 \\
        --time-scale 1                                    # real SGLang workers

This is the small version. ``benchmarks/compare_routers.py`` runs the full comparison, against
sglang-router 0.3.2 as well, with LRU and RLT workers and the paper's workload size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from sim.loadgen import BenchConfig, benchmark, eviction_of
from sim.local_cluster import LocalCluster
from sim.report import markdown_table
from sim.workloads import GSP_ORDERS, GSPConfig, GSPWorkload


def compare(cluster: LocalCluster, args: argparse.Namespace) -> list[dict[str, Any]]:
    workload = list(
        GSPWorkload(
            GSPConfig(
                num_groups=args.groups,
                prompts_per_group=args.prompts_per_group,
                order=args.order,
                rate=args.rate,
                seed=args.seed,
            ),
            limit=args.requests,
        )
    )
    # Existing workers say which eviction they run (kvroute's emulator does; SGLang: unknown).
    eviction = asyncio.run(eviction_of(cluster.worker_urls)) if args.worker_urls else args.eviction
    rows = []
    for policy in args.policies:
        cluster.flush()
        url = cluster.start_router("kvroute", policy)
        cluster.warm_up()
        print(f"{policy}: {len(workload)} requests through {url}", file=sys.stderr)
        config = BenchConfig(
            url=url, time_scale=args.time_scale, worker_urls=list(cluster.worker_urls)
        )
        summary, _ = asyncio.run(benchmark(workload, config, policy=policy, eviction=eviction))
        rows.append(summary)
    cluster.stop_router()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--policies", nargs="+", default=["lbgr", "cache_aware", "power_of_two", "round_robin"]
    )
    parser.add_argument(
        "--worker-urls",
        nargs="+",
        default=None,
        metavar="URL",
        help="existing SGLang (or emulated) workers; default: start emulated ones here",
    )
    parser.add_argument("--workers", type=int, default=4, help="emulated workers to start")
    parser.add_argument("--eviction", choices=["lru", "rlt"], default="rlt")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=5.0,
        help="emulated time runs this many times faster than real time (1 for real workers)",
    )
    parser.add_argument("--order", choices=GSP_ORDERS, default="random")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--requests", type=int, default=None, help="cap on requests per policy")
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="keep worker and router logs here")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON last")
    args = parser.parse_args()
    with LocalCluster(
        workers=args.workers,
        eviction=args.eviction,
        time_scale=args.time_scale,
        log_dir=args.log_dir,
    ) as cluster:
        if args.worker_urls:
            cluster.worker_urls = [u.rstrip("/") for u in args.worker_urls]
        else:
            print(f"starting {args.workers} emulated workers ({args.eviction})", file=sys.stderr)
            cluster.start_workers(seed=args.seed)
        rows = compare(cluster, args)
    print(markdown_table(rows))
    if args.json:
        print(json.dumps({"rows": rows}, sort_keys=True))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
