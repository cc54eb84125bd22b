"""What if I add a worker, or switch the workers to RLT eviction? Ask the simulator first.

Runs the same seeded workload through simulated fleets (``sim.cluster.simulate``: the very
routing policies and radix caches the service and the workers run, on a discrete-event clock
with a calibrated service model) and prints one row per scenario with its change against the
baseline. No workers, no GPU; a few seconds.

    python examples/what_if.py                                  # 4 workers, lbgr + lru base
    python examples/what_if.py --workers 6 --order random --rate 20
    python examples/what_if.py --capacity-tokens 196000         # the L40 profile's full KV

The default workload is the paper's GSP in round-robin order (every group's shared prefix
comes back only after all the other groups: the reuse distance that LRU handles worst), cut
down to run in seconds; raise ``--groups`` / ``--prompts-per-group`` for the full size. The
KV capacity per worker defaults to 0.3x the workload's reusable working set (the shared
prefixes), where eviction matters; hit rates depend sharply on that ratio, so before deciding
on an eviction policy sweep it (``--capacity-ratio``, or ``kvroute sim`` over a range).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from sim.cluster import ClusterConfig, simulate
from sim.profiles import PROFILES
from sim.report import markdown_table, summarize
from sim.workloads import GSP_ORDERS, GSPConfig, GSPWorkload

COLUMNS = (
    ("scenario", "scenario", "{}"),
    ("workers", "workers", "{}"),
    ("policy", "policy", "{}"),
    ("eviction", "eviction", "{}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("p50 lat (s)", "p50_latency_s", "{:.2f}"),
    ("p95 lat (s)", "p95_latency_s", "{:.2f}"),
    ("p95 TTFT (s)", "p95_ttft_s", "{:.2f}"),
    ("p95 vs base", "p95_vs_base", "x{:.2f}"),
    ("req/s", "throughput_rps", "{:.2f}"),
)


def scenarios(base: ClusterConfig, add_workers: int) -> list[tuple[str, ClusterConfig]]:
    """The baseline and each change alone, then both together, then SGLang's own policy."""
    other = "rlt" if base.eviction == "lru" else "lru"
    more = base.workers + add_workers
    return [
        ("baseline", base),
        (f"+{add_workers} worker", replace(base, workers=more)),
        (f"{other} eviction", replace(base, eviction=other)),
        (f"+{add_workers} worker, {other}", replace(base, workers=more, eviction=other)),
        ("cache_aware router", replace(base, policy="cache_aware")),
    ]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    workload = GSPWorkload(
        GSPConfig(
            num_groups=args.groups,
            prompts_per_group=args.prompts_per_group,
            order=args.order,
            rate=args.rate,
            seed=args.seed,
        )
    )
    capacity = args.capacity_tokens or round(args.capacity_ratio * workload.reusable_working_set)
    # A worker must hold its longest request, or that request fails outright.
    longest = max(len(r.prompt) + r.max_new_tokens for r in workload)
    if capacity < longest:
        print(f"raising the KV capacity to {longest} tokens: the longest request needs it")
        capacity = longest
    print(
        f"{len(workload)} GSP requests ({args.order}) at {args.rate:g}/s; KV capacity "
        f"{capacity} tokens per worker = {capacity / workload.reusable_working_set:.2f}x the "
        f"reusable working set ({workload.reusable_working_set} tokens)\n"
    )
    base = ClusterConfig(
        workers=args.workers,
        policy=args.policy,
        eviction=args.eviction,
        profile=args.profile,
        capacity_tokens=capacity,
        seed=args.seed,
    )
    rows = []
    for name, config in scenarios(base, args.add_workers):
        row = summarize(simulate(config, workload), scenario=name, workload="gsp")
        rows.append(row)
    base_p95 = rows[0]["p95_latency_s"]
    for row in rows:
        p95 = row["p95_latency_s"]
        row["p95_vs_base"] = p95 / base_p95 if p95 is not None and base_p95 else None
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--add-workers", type=int, default=1, help="workers the 'what if' adds")
    parser.add_argument("--policy", default="lbgr")
    parser.add_argument("--eviction", choices=["lru", "rlt"], default="lru")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="llama3.1-8b-l40")
    parser.add_argument(
        "--capacity-ratio",
        type=float,
        default=0.3,
        help="KV capacity per worker as a multiple of the workload's reusable working set",
    )
    parser.add_argument(
        "--capacity-tokens", type=int, default=None, help="KV capacity per worker (overrides)"
    )
    parser.add_argument("--order", choices=GSP_ORDERS, default="round_robin")
    parser.add_argument("--groups", type=int, default=64, help="GSP groups (paper: 128)")
    parser.add_argument("--prompts-per-group", type=int, default=8, help="paper: 32")
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON last")
    args = parser.parse_args()
    rows = run(args)
    print(markdown_table(rows, COLUMNS))
    if args.json:
        print(json.dumps({"rows": rows}, sort_keys=True))
    return 0 if all(r["completed"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
