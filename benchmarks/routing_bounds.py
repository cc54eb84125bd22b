"""How far can routing go? Policies next to two bounds on the paper's GSP setting.

The target asks our ``lbgr`` + ``rlt`` for a p50 latency of at most half of sglang-router's
``cache_aware`` + ``lru`` with a higher hit rate. This benchmark asks, in the simulator (the
same routing core and service model as the emulated fleet, seeded, seconds per row), what
any router could reach on that workload, by adding two rows no router can run:

- **oracle sticky**: perfect affinity with balanced placement. The oracle knows GSP's groups
  (a group is told by the first 64 tokens of its shared prefix, which is at least 256
  tokens); the first request of a group goes to the worker with the least prompt length
  assigned so far, and every later request of the group follows it. Each shared prefix is
  computed once per run unless evicted: the hit rate is the workload's ceiling at the
  fleet's capacity, and the queues are as even as a placement of whole groups can make them.
- **pooled**: one worker four times as fast holding the whole fleet's cache (4x the KV
  capacity). It has no imbalance between queues and computes every prefix once, so it is an
  optimistic bound for four workers: what perfect load balancing with perfect affinity would
  give if both could be had at once.

Rows (every one on the same seeded workloads; ``cache_aware`` is kvroute's implementation of
the rule sglang-router 0.3.2 runs, with today's defaults or the paper's 0.4.6 flags):
``cache_aware`` + ``lru`` (the target's baseline), ``cache_aware`` (paper flags) + ``lru``,
``lbgr`` + ``rlt`` (our default), ``lbgr`` + ``rlt`` with ``alpha`` 0.5, kvroute's hold
queue (one request per worker in flight, the rest wait in the router and go where they are
cached, shortest first: ``router_service.routing.hold_queue``) with ``rlt`` and ``lru``, the
oracle with ``lru`` and ``rlt``, and the pooled bound. The table gives p50 latency and hit
rate per seed and each row's p50 over the baseline's.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from _common import base_parser, format_ratio, ratio, write_json

from router_service.routing import HoldSettings
from router_service.routing.policies.basic import _plain
from router_service.routing.policy import SGLANG_INDEX, eligible, policy_names, register_policy
from router_service.routing.types import Decision, Learned, Outcome, RouteRequest, WorkerSnapshot
from sim.cluster import ClusterConfig, simulate
from sim.profiles import get_profile
from sim.report import markdown_table, summarize
from sim.workloads.gsp import GSPConfig, GSPWorkload

NAME = "routing_bounds"
PROFILE = "llama3.1-8b-l40"
SEEDS = (0, 1, 2)
TARGET_RATIO = 0.5
GROUP_PROBE = 64  # leading tokens that tell a GSP group (its shared prefix is >= 256 tokens)


class OracleSticky:
    """Every request of a group goes to the group's worker; a new group goes where the
    least prompt length has been placed. Not a product policy: it knows the workload."""

    name = "oracle_sticky"
    index_settings = SGLANG_INDEX
    models = None

    def __init__(self, rng: Any = None) -> None:
        self.home: dict[Any, str] = {}
        self.placed: dict[str, int] = {}
        self._pending: dict[str, tuple[Any, int]] = {}  # request id -> (group, units)

    def decide(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> Decision:
        pool = eligible(workers)
        group = request.key[:GROUP_PROBE]
        home = self.home.get(group)
        if home is None or all(w.url != home for w in pool):
            home = min(pool, key=lambda w: self.placed.get(w.url, 0)).url
            self._pending[request.request_id] = (group, request.units)
        return Decision(
            request.request_id,
            self.name,
            home,
            _plain(workers),
            request.units,
            reserve_ms=float(request.units),
        )

    def commit(self, decision: Decision) -> None:
        placed = self._pending.pop(decision.decision_id, None)
        if placed is not None:
            group, units = placed
            self.home[group] = decision.chosen
            self.placed[decision.chosen] = self.placed.get(decision.chosen, 0) + units

    def complete(self, decision: Decision, outcome: Outcome) -> Learned | None:
        return None

    def forget_worker(self, url: str) -> None:
        self.home = {g: u for g, u in self.home.items() if u != url}


if "oracle_sticky" not in policy_names():
    register_policy("oracle_sticky", OracleSticky)


@dataclass(frozen=True)
class Row:
    label: str
    policy: str
    eviction: str
    params: tuple[tuple[str, Any], ...] = ()
    pooled: bool = False
    queue_slots: int = 0  # kvroute's hold queue (slots freed at the end of a response)


BASELINE = "cache_aware + lru"
OURS = "lbgr + rlt"
ROWS = (
    Row(BASELINE, "cache_aware", "lru"),
    Row("cache_aware (paper flags) + lru", "cache_aware", "lru", (("preset", "paper"),)),
    Row(OURS, "lbgr", "rlt"),
    Row("lbgr + rlt, alpha 0.5", "lbgr", "rlt", (("alpha", 0.5),)),
    Row("lbgr + rlt, hold queue (1 slot)", "lbgr", "rlt", queue_slots=1),
    Row("lbgr + lru, hold queue (1 slot)", "lbgr", "lru", queue_slots=1),
    Row("oracle sticky + lru", "oracle_sticky", "lru"),
    Row("oracle sticky + rlt", "oracle_sticky", "rlt"),
    Row("pooled bound (1 worker, 4x speed, 4x cache) + rlt", "round_robin", "rlt", pooled=True),
)


def gsp_config(seed: int, quick: bool) -> GSPConfig:
    if quick:
        return GSPConfig(num_groups=32, prompts_per_group=8, seed=seed)
    return GSPConfig(seed=seed)


def run_row(job: tuple[Row, int, bool]) -> dict[str, Any]:
    row, seed, quick = job
    workers = 4
    if row.pooled:
        capacity = workers * get_profile(PROFILE).kv_capacity_tokens
        config = ClusterConfig(
            workers=1,
            policy=row.policy,
            eviction=row.eviction,
            profile=PROFILE,
            capacity_tokens=capacity,
            worker_speeds=[float(workers)],
            seed=seed,
        )
    else:
        config = ClusterConfig(
            workers=workers,
            policy=row.policy,
            policy_params=dict(row.params),
            eviction=row.eviction,
            profile=PROFILE,
            seed=seed,
            hold=HoldSettings(slots=row.queue_slots, free_at_first_token=False),
        )
    workload = GSPWorkload(gsp_config(seed, quick))
    started = time.perf_counter()
    run = simulate(config, workload)
    summary = summarize(run)
    if row.policy == OracleSticky.name:
        _check_sticky(run.records, workload)
    return {
        "label": row.label,
        "seed": seed,
        "p50_latency_s": summary["p50_latency_s"],
        "p95_latency_s": summary["p95_latency_s"],
        "hit_rate": summary["hit_rate"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "wall_s": round(time.perf_counter() - started, 2),
    }


def _check_sticky(records: Sequence[Any], workload: GSPWorkload) -> None:
    """The oracle row means what it says: each group's requests all went to one worker."""
    group_of = {item.rid: item.group for item in workload}
    homes: dict[Any, set[str]] = {}
    for record in records:
        homes.setdefault(group_of[record.rid], set()).add(record.worker)
    split = [group for group, workers in homes.items() if len(workers) > 1]
    if split or len(homes) != workload.config.num_groups:
        raise AssertionError(f"oracle sticky split groups {split[:5]} over several workers")


def table(results: Sequence[dict[str, Any]], seeds: Sequence[int]) -> list[dict[str, Any]]:
    by = {(r["label"], r["seed"]): r for r in results}
    lines = []
    for row in ROWS:
        line: dict[str, Any] = {"label": row.label}
        ratios = []
        for seed in seeds:
            r, base = by[(row.label, seed)], by[(BASELINE, seed)]
            rel = ratio(r["p50_latency_s"], base["p50_latency_s"])
            ratios.append(rel)
            line[f"seed{seed}"] = (
                f"{r['p50_latency_s']:.2f} / {r['hit_rate']:.3f} / "
                f"{format_ratio(r['p50_latency_s'], base['p50_latency_s'])}"
            )
        line["p50_mean_s"] = statistics.fmean(by[(row.label, s)]["p50_latency_s"] for s in seeds)
        line["hit_mean"] = statistics.fmean(by[(row.label, s)]["hit_rate"] for s in seeds)
        line["p50_over_baseline"] = ratios
        line["meets_target"] = all(
            rel is not None and rel <= TARGET_RATIO for rel in ratios
        ) and all(by[(row.label, s)]["hit_rate"] > by[(BASELINE, s)]["hit_rate"] for s in seeds)
        lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--jobs", type=int, default=2, help="simulations in parallel (2)")
    args = parser.parse_args(argv)
    seeds = SEEDS[:1] if args.quick else SEEDS
    started = time.perf_counter()
    jobs = [(row, seed, args.quick) for row in ROWS for seed in seeds]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(run_row, jobs))
    wall_s = time.perf_counter() - started
    lines = table(results, seeds)
    columns = [("row", "label", "{}")]
    columns += [(f"seed {s}: p50 (s) / hit / vs baseline", f"seed{s}", "{}") for s in seeds]
    columns += [
        ("mean p50 (s)", "p50_mean_s", "{:.2f}"),
        ("mean hit", "hit_mean", "{:.3f}"),
        (f"p50 <= {TARGET_RATIO:g}x and higher hit", "meets_target", "{}"),
    ]
    groups = "32x8" if args.quick else "128x32"
    print(f"## Routing bounds: GSP {groups}, random order, 12 req/s, 4 workers ({PROFILE})\n")
    print(markdown_table(lines, columns))
    ours = next(line for line in lines if line["label"] == OURS)
    oracle = next(line for line in lines if line["label"] == "oracle sticky + rlt")
    print(
        f"\n{OURS}: p50 {ours['p50_mean_s']:.2f} s mean, target <= {TARGET_RATIO:g}x of "
        f"{BASELINE} with a higher hit rate: {'met' if ours['meets_target'] else 'NOT met'}; "
        f"oracle sticky + rlt p50 {oracle['p50_mean_s']:.2f} s, hit {oracle['hit_mean']:.3f}."
    )
    print(f"{len(jobs)} simulations, {wall_s:.1f} s wall")
    path = write_json(
        args.out,
        NAME,
        {
            "seeds": list(seeds),
            "quick": args.quick,
            "target_ratio": TARGET_RATIO,
            "rows": results,
            "table": lines,
            "wall_s": round(wall_s, 2),
        },
    )
    print(f"figures written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
