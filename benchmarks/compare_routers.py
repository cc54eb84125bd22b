"""Our router against sglang-router on the same emulated SGLang workers.

For one workload and one fleet, in a single run: ``kvroute serve`` with each policy
(round_robin, power_of_two, cache_aware, lbgr, and lbgr_paper, the paper's LBGR) and the real
sglang-router (PyPI ``sglang-router==0.3.2``: cache_aware, power_of_two, round_robin, and
cache_aware with the paper's 0.4.6 thresholds as flags: ``--cache-threshold 0.5
--balance-abs-threshold 32 --balance-rel-threshold 1.0001 --max-tree-size 2**24``), and
kvroute lbgr with its hold queue (``--queue-slots 1 --queue-free-at last_token``: requests
wait in the router for a free worker, go where they are cached, shortest first), each on
freshly flushed emulated workers (``kvroute emulate``), once with ``lru`` and once with
``rlt`` eviction (the workers are restarted between the two). Traffic comes from the
open-loop load generator (``sim.loadgen``, streaming, one connection per request); the hit
rate is read from the workers' ``/metrics``. Default: GSP with the paper's settings (128
groups x 32 prompts, random order, 12 req/s, 4 workers, profile llama3.1-8b-l40 and its KV
capacity).

``--workload trace`` replays a Mooncake JSONL trace instead (default: the synthetic trace in
``../shared/data``): its first ``--requests`` requests (800), timestamps divided by
``--trace-time-scale`` (0.22: ~0.8 req/s, about 75% of the rate at which round_robin + lru
saturates on the trace's first 2,000 requests in ``benchmarks/robustness.py``, 1.10 req/s).
Its rows default to the pairs the verdict compares, each with its own default eviction:
kvroute lbgr and lbgr_paper with rlt (kvroute's), sglang-router cache_aware with lru
(SGLang's); ``--rows`` picks others. A request that needs more KV than a worker holds is
refused by the worker (HTTP 400): the table counts those as ``rejected`` (also in ``failed``)
and the run says beforehand how many to expect. ``--sim`` adds the same rows simulated
(``sim.cluster``, the routing core ``kvroute sim`` runs: sglang-router's rows as kvroute's
cache_aware with the matching preset), so a reader sees whether HTTP and simulation agree.
Every row's p50 latency and TTFT are also given as a ratio to sglang-router cache_aware + lru
of the same kind (HTTP or simulated).

Prompts are sent as ``input_ids``. sglang-router 0.3.2 routes a ``/generate`` body that has
only ``input_ids`` on the ids written as decimal text joined by spaces
(``GenerateRequest::extract_text_for_routing``), so its character radix tree sees the same
prefix structure as our token index (~7 characters a token for Llama-3-sized ids; shares and
match rates carry over); tests/sim/emulator/test_emulator_sglang_router.py checks that it
follows an ``input_ids`` prefix to a busy worker. Sending text instead would only change
how the emulator tokenises, not who wins, so ids are the fair and exact choice.

Time scale: workers run ``--time-scale`` times faster than real time and arrivals are
compressed as much; latencies are reported in emulated seconds. ``kvroute serve`` is told the
scale, so it decays load and learns latencies on the emulated clock, but wall-clock costs
(HTTP, JSON of up to 8k ids (GSP) or 135k (Mooncake), streamed tokens, the routers' own CPU,
CPU contention, kvroute's 1 s ``/metrics`` poll) are multiplied by the scale. Keep the scale
low on a small or busy machine: the table reports the harness's CPU (cores busy) and the
whole machine's busy fraction per row. The default, 2x (a paper-sized GSP row is 341 s of
emulated arrivals, ~3 min of wall time; the whole run ~55 min), is what a shared 2-core
machine sustains: at 2x the kvroute rows match ``kvroute sim`` on the same workload within a
few percent, while at 5x (60 requests/s of wall time) our Python router saturates its share
of the CPU and its rows' p50 grows by ~60% when sglang-router's (Rust) does not move.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from _common import (
    DATA_DIR,
    add_gsp_fleet_args,
    base_parser,
    check_gsp_fleet_args,
    format_ratio,
    ratio,
    write_json,
)
from _fleet import busy_fraction, harness_cpu_s, machine_jiffies

from router_service.routing import HoldSettings
from sim.cluster import ClusterConfig, simulate
from sim.loadgen import BenchConfig, benchmark
from sim.local_cluster import LocalCluster
from sim.plots import plot_rows
from sim.profiles import get_profile
from sim.report import FLEET_METRIC_COLUMNS, markdown_table, summarize
from sim.workloads import GSPConfig, GSPWorkload, Workload, WorkloadFileError, load_mooncake

NAME = "compare_routers"
PROFILE = "llama3.1-8b-l40"
EVICTIONS = ("lru", "rlt")
ROUTERS = (
    ("kvroute", ("round_robin", "power_of_two", "cache_aware", "lbgr", "lbgr_paper")),
    ("sglang-router", ("cache_aware", "power_of_two", "round_robin")),
)
# The paper's baseline ran sgl-router of SGLang 0.4.6 with its defaults; sglang-router 0.3.2
# takes the same thresholds as flags (its low-match rule and tree stay 0.3.2's).
PAPER_THRESHOLDS = (
    "--cache-threshold",
    "0.5",
    "--balance-abs-threshold",
    "32",
    "--balance-rel-threshold",
    "1.0001",
    "--max-tree-size",
    str(2**24),
)
# kvroute's hold queue (router_service.dispatch): one request in prefill per worker, the
# rest wait in the router and go where they are cached, shortest first. GSP's outputs are
# 4 tokens, so a slot is held until one decode step is left (the next request's hand-over
# overlaps that step). Its max wait is wall time: ``row_specs`` scales the router's default
# (20 s) to emulated seconds.
HOLD_QUEUE = ("--queue-slots", "1", "--queue-free-at", "last_token")
HOLD_QUEUE_MAX_WAIT_S = 20.0  # emulated
VARIANTS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("sglang-router", "cache_aware", "paper thresholds", PAPER_THRESHOLDS),
    ("kvroute", "lbgr", "hold queue", HOLD_QUEUE),
)
OURS_QUEUED = ("kvroute", "lbgr", "rlt", "hold queue")
OURS = ("kvroute", "lbgr", "rlt")
BASELINE = ("sglang-router", "cache_aware", "lru")
TARGET_P50_RATIO = 0.5  # ours / baseline
# A trace's default rows: the verdict's pairs, each router with its own default eviction.
TRACE_ROWS = ("kvroute lbgr+rlt", "kvroute lbgr_paper+rlt", "sglang-router cache_aware+lru")
MOONCAKE = DATA_DIR / "mooncake_synthetic_trace.jsonl"
TRACE_REQUESTS = 800  # ~8.5 min of wall time per row at the default scales
TRACE_TIME_SCALE = 0.22  # ~75% of round_robin + lru's saturation (module docstring)

COLUMNS = (
    ("router", "router", "{}"),
    ("policy", "policy_label", "{}"),
    ("run", "mode", "{}"),
    *FLEET_METRIC_COLUMNS,
    ("failed", "failed", "{}"),
    ("rejected", "rejected", "{}"),
    ("p50 lat / sglang", "p50_latency_vs_baseline", "{}"),
    ("p50 TTFT / sglang", "p50_ttft_vs_baseline", "{}"),
    ("CPU (cores)", "harness_cores", "{:.2f}"),
    ("machine busy", "machine_busy", "{:.0%}"),
    ("status", "status", "{}"),
)

PROGRESS_COLUMNS = (*COLUMNS[4:13], COLUMNS[15])  # a row's figures as soon as it has run


@dataclass(frozen=True, slots=True)
class RowSpec:
    router: str
    policy: str
    eviction: str
    variant: str = ""  # a named set of extra router flags
    extra: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        variant = f" ({self.variant})" if self.variant else ""
        return f"{self.router} {self.policy}{variant}+{self.eviction}"


def row_specs(eviction: str, only: Sequence[str] = (), time_scale: float = 1.0) -> list[RowSpec]:
    """Every router x policy, then the named variants; ``only`` keeps labels containing one
    of its strings (``+lru`` / ``+rlt`` in one picks the eviction too)."""
    specs = [RowSpec(r, p, eviction) for r, policies in ROUTERS for p in policies]
    for router, policy, variant, flags in VARIANTS:
        extra: tuple[str, ...] = flags
        if flags is HOLD_QUEUE:
            extra = (*flags, "--queue-max-wait-s", f"{HOLD_QUEUE_MAX_WAIT_S / time_scale:g}")
        specs.append(RowSpec(router, policy, eviction, variant, extra))
    return [s for s in specs if not only or any(o in s.label for o in only)]


# -- one row ---------------------------------------------------------------------------------
def measure(
    cluster: LocalCluster, spec: RowSpec, workload: Workload, time_scale: float
) -> tuple[dict[str, Any], list[float]]:
    """Flush, start the router, warm it up, flush again, run the workload; stop the router."""
    cluster.flush()
    url = cluster.start_router(spec.router, spec.policy, spec.extra)
    try:
        cluster.warm_up()
        config = BenchConfig(url=url, time_scale=time_scale, worker_urls=list(cluster.worker_urls))
        cpu_before, machine_before = harness_cpu_s(), machine_jiffies()
        started = time.perf_counter()
        summary, results = asyncio.run(
            benchmark(list(workload), config, policy=spec.policy, eviction=spec.eviction)
        )
        wall_s = time.perf_counter() - started
        cpu_after, machine_after = harness_cpu_s(), machine_jiffies()
    finally:
        cluster.stop_router()
    summary["harness_cores"] = round((cpu_after - cpu_before) / wall_s, 3)
    summary["machine_busy"] = busy_fraction(machine_before, machine_after)
    # The workers answer a request that can never fit their KV cache with 400.
    summary["rejected"] = sum(1 for r in results if r.status == 400)
    latencies = [r.latency_s for r in results if r.ok and r.latency_s is not None]
    return summary, latencies


def _row(
    spec: RowSpec, status: str, summary: dict[str, Any] | None = None, mode: str = "http"
) -> dict[str, Any]:
    prefix = "" if mode == "http" else f"{mode}: "
    return {
        **(summary or {"policy": spec.policy, "eviction": spec.eviction}),
        "router": spec.router,
        "variant": spec.variant,
        "policy_label": f"{spec.policy} ({spec.variant})" if spec.variant else spec.policy,
        "label": prefix + spec.label,
        "mode": mode,
        "status": status,
    }


def run_eviction(
    eviction: str, workload: Workload, args: Any, latencies: dict[str, list[float]]
) -> list[dict[str, Any]]:
    """Every router row on one set of freshly started workers with ``eviction``."""
    specs = row_specs(eviction, args.rows, args.time_scale)
    if not specs:
        return []
    have_sglang = importlib.util.find_spec("sglang_router") is not None
    rows: list[dict[str, Any]] = []
    with LocalCluster(
        workers=args.workers,
        eviction=eviction,
        capacity_tokens=args.capacity_tokens,
        profile=PROFILE,
        time_scale=args.time_scale,
        log_dir=args.log_dir and os.path.join(args.log_dir, eviction),
    ) as cluster:
        cluster.start_workers(seed=args.seed)
        for spec in specs:
            if spec.router == "sglang-router" and not have_sglang:
                rows.append(_row(spec, "skipped: sglang-router not installed"))
                continue
            print(f"{spec.label}: {len(workload)} requests...", file=sys.stderr, flush=True)
            try:
                summary, latencies[spec.label] = measure(cluster, spec, workload, args.time_scale)
            except (OSError, RuntimeError, TimeoutError, ValueError, aiohttp.ClientError) as exc:
                rows.append(_row(spec, f"failed: {type(exc).__name__}: {exc}"[:160]))
                continue
            rows.append(_row(spec, _status(summary), summary))
            print(
                f"  {markdown_table([rows[-1]], PROGRESS_COLUMNS).splitlines()[-1]}",
                file=sys.stderr,
            )
    return rows


def _status(summary: dict[str, Any]) -> str:
    """ok, or why not: requests the workers refused as too large are expected, not faults."""
    if summary["failed"] == 0:
        return "ok"
    if summary["failed"] == summary.get("rejected", 0):
        return "ok (too large rejected)"
    return "some requests failed"


# -- the same rows in the simulator ------------------------------------------------------------
def sim_config(spec: RowSpec, args: Any) -> ClusterConfig:
    """The simulated fleet and routing of a row: sglang-router's policies are kvroute's of the
    same name (cache_aware with the thresholds the row's router ran), the hold queue its
    settings."""
    params: dict[str, Any] = {}
    if spec.policy == "cache_aware":
        params["preset"] = "paper" if spec.variant == "paper thresholds" else "sglang"
    hold = HoldSettings()
    if spec.variant == "hold queue":
        hold = HoldSettings(
            slots=1,
            max_wait_ms=HOLD_QUEUE_MAX_WAIT_S * 1000.0,
            free_at_first_token=False,
            free_at_last_token=True,
        )
    return ClusterConfig(
        workers=args.workers,
        policy=spec.policy,
        policy_params=params,
        eviction=spec.eviction,
        profile=PROFILE,
        capacity_tokens=args.capacity_tokens,
        seed=args.seed,
        hold=hold,
    )


def simulate_rows(
    workload: Workload, args: Any, latencies: dict[str, list[float]]
) -> list[dict[str, Any]]:
    """The selected rows of every eviction, simulated (seconds of CPU, no processes)."""
    rows = []
    for spec in (s for ev in EVICTIONS for s in row_specs(ev, args.rows, args.time_scale)):
        run = simulate(sim_config(spec, args), workload)
        summary = summarize(run)
        summary["rejected"] = summary["failed"]  # the simulator fails only too-large requests
        row = _row(spec, _status(summary), summary, mode="sim")
        latencies[row["label"]] = [
            r.latency_ms / 1000.0 for r in run.records if r.latency_ms is not None
        ]
        rows.append(row)
    return rows


# -- verdict ---------------------------------------------------------------------------------
def _find(
    rows: Sequence[dict[str, Any]], key: tuple[str, ...], mode: str = "http"
) -> dict[str, Any] | None:
    """The row of (router, policy, eviction[, variant]) that ran."""
    router, policy, eviction, *variant = key
    return next(
        (
            r
            for r in rows
            if (r["router"], r["policy"], r["eviction"]) == (router, policy, eviction)
            and r.get("variant", "") == (variant[0] if variant else "")
            and r.get("mode", "http") == mode
            and r["status"].startswith("ok")
        ),
        None,
    )


def add_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Each row's p50 latency and TTFT over the baseline's of the same mode (HTTP or sim)."""
    for row in rows:
        base = _find(rows, BASELINE, row.get("mode", "http"))
        for key in ("p50_latency_s", "p50_ttft_s"):
            mine = row.get(key) if row["status"].startswith("ok") else None
            theirs = base.get(key) if base is not None else None
            row[key.removesuffix("_s") + "_vs_baseline"] = format_ratio(mine, theirs)


def verdict(rows: Sequence[dict[str, Any]], ours_key: tuple[str, ...] = OURS) -> dict[str, Any]:
    """The target: ours' p50 <= 0.5x the baseline's, with a higher hit rate."""
    ours, base = _find(rows, ours_key), _find(rows, BASELINE)
    if ours is None or base is None:
        return {"ours": " ".join(ours_key), "baseline": " ".join(BASELINE), "met": None}
    p50 = ratio(ours["p50_latency_s"], base["p50_latency_s"])
    higher_hit = ours["hit_rate"] > base["hit_rate"]
    return {
        "ours": " ".join(ours_key),
        "baseline": " ".join(BASELINE),
        "p50_latency_ratio": p50,
        "p50_latency_ratio_text": format_ratio(ours["p50_latency_s"], base["p50_latency_s"]),
        "target_p50_ratio": TARGET_P50_RATIO,
        "ours_hit_rate": ours["hit_rate"],
        "baseline_hit_rate": base["hit_rate"],
        "higher_hit_rate": higher_hit,
        "met": p50 is not None and p50 <= TARGET_P50_RATIO and higher_hit,
    }


def verdict_text(v: dict[str, Any]) -> str:
    if v["met"] is None:
        return f"- target not evaluated: a row of {v['ours']} / {v['baseline']} did not run"
    return (
        f"- p50 latency {v['ours']} / {v['baseline']}: {v['p50_latency_ratio_text']} "
        f"(target <= {TARGET_P50_RATIO:.2f}x)\n"
        f"- hit rate {v['ours_hit_rate']:.3f} vs {v['baseline_hit_rate']:.3f} "
        f"(target: higher): {'yes' if v['higher_hit_rate'] else 'no'}\n"
        f"- target met: {'yes' if v['met'] else 'no'}"
    )


# -- workload ----------------------------------------------------------------------------------
def build_workload(args: Any) -> tuple[Workload, dict[str, Any], str]:
    """The requests, their description for the JSON and a title for the table."""
    if args.workload == "gsp":
        config = GSPConfig(num_groups=args.groups, prompts_per_group=args.prompts, rate=args.rate)
        gsp = GSPWorkload(config, limit=args.requests)
        title = f"GSP {args.groups}x{args.prompts} at {args.rate:g} req/s"
        return gsp, {"name": "gsp", **asdict(config), "requests": len(gsp)}, title
    trace = load_mooncake(
        args.trace, time_scale=args.trace_time_scale, limit=args.requests, seed=args.seed
    )
    span_s = max(r.arrival_ms for r in trace) / 1000.0
    offered = len(trace) / span_s if span_s > 0 else float("inf")
    about = {
        "name": "trace",
        "trace": str(args.trace),
        "time_scale": args.trace_time_scale,
        "requests": len(trace),
        "offered_rps": round(offered, 4),
        "mean_prompt_tokens": round(trace.total_prompt_tokens / len(trace), 1),
        "max_prompt_tokens": max(len(r.prompt) for r in trace),
    }
    title = (
        f"{os.path.basename(args.trace)}, first {len(trace)} requests at time scale "
        f"{args.trace_time_scale:g} ({offered:.2f} req/s)"
    )
    return trace, about, title


def too_large(workload: Workload, capacity_tokens: int) -> int:
    """Requests whose prompt and output cannot fit one worker's KV cache (refused, HTTP 400)."""
    return sum(1 for r in workload if len(r.prompt) + r.max_new_tokens > capacity_tokens)


# -- main ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> Any:
    parser = base_parser(NAME, __doc__)
    add_gsp_fleet_args(parser)
    parser.add_argument("--capacity-tokens", type=int, default=None, help="default: profile")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    parser.add_argument("--log-dir", default=None, help="keep worker and router logs here")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="run only the rows whose label contains one of these, e.g. 'kvroute lbgr' "
        "'sglang-router cache_aware+lru' (default: all; a trace: " + ", ".join(TRACE_ROWS) + ")",
    )
    parser.add_argument("--workload", choices=("gsp", "trace"), default="gsp")
    parser.add_argument("--trace", default=str(MOONCAKE), help="Mooncake JSONL (--workload trace)")
    parser.add_argument(
        "--requests", type=int, default=None, help=f"the first N (trace: {TRACE_REQUESTS})"
    )
    parser.add_argument(
        "--trace-time-scale",
        type=float,
        default=TRACE_TIME_SCALE,
        help="divide the trace's timestamps by this (the load; --time-scale is the emulator's)",
    )
    parser.add_argument("--sim", action="store_true", help="add the rows simulated")
    args = parser.parse_args(argv)
    check_gsp_fleet_args(parser, args)
    _check_workload_args(parser, args)
    if args.rows is None:
        args.rows = TRACE_ROWS if args.workload == "trace" else ()
    if args.rows and not any(row_specs(ev, args.rows) for ev in EVICTIONS):
        known = ", ".join(repr(s.label.rsplit("+", 1)[0]) for s in row_specs(EVICTIONS[0]))
        parser.error(f"--rows {' '.join(args.rows)!r} matches no row; rows: {known}")
    args.plot = args.plot or str(args.out.with_suffix(".png"))
    return args


def _check_workload_args(parser: Any, args: Any) -> None:
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be >= 1")
    if not args.trace_time_scale > 0:
        parser.error("--trace-time-scale must be positive")
    if args.workload == "trace":
        if not os.path.isfile(args.trace):
            parser.error(f"--trace {args.trace}: no such file")
        args.requests = args.requests or (60 if args.quick else TRACE_REQUESTS)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        workload, about, what = build_workload(args)
    except WorkloadFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    capacity = args.capacity_tokens or get_profile(PROFILE).kv_capacity_tokens
    oversized = too_large(workload, capacity)
    emulated_s = max(r.arrival_ms for r in workload) / 1000.0
    print(
        f"{what}, {args.workers} workers, time scale {args.time_scale:g}x: {emulated_s:.0f} s "
        f"emulated (~{emulated_s / args.time_scale:.0f} s wall) of arrivals per row; "
        f"{oversized} requests need more than the {capacity} KV tokens of a worker",
        file=sys.stderr,
    )
    started = time.perf_counter()
    latencies: dict[str, list[float]] = {}
    rows = [row for ev in EVICTIONS for row in run_eviction(ev, workload, args, latencies)]
    wall_s = time.perf_counter() - started
    if args.sim:
        rows += simulate_rows(workload, args, latencies)
    add_ratios(rows)
    v, v_queued = verdict(rows), verdict(rows, OURS_QUEUED)
    title = (
        f"kvroute vs sglang-router, {what}, {args.workers} emulated workers ({PROFILE}), "
        f"time scale {args.time_scale:g}x"
    )
    print(f"## {title}\n")
    print(markdown_table(rows, COLUMNS) + "\n")
    print(verdict_text(v) + "\n")
    if any(r["variant"] == "hold queue" for r in rows):
        print(verdict_text(v_queued) + "\n")
    print(
        f"Latencies in emulated seconds; {len(rows)} rows, the HTTP ones in {wall_s:.0f} s wall. "
        "Prompts sent as input_ids (sglang-router routes them on their decimal text). "
        "CPU: harness cores busy during the row / whole machine busy fraction. "
        f"{oversized} requests too large for a worker's {capacity} KV tokens (rejected)."
    )
    plot_rows(rows, latencies, args.plot, title)
    path = write_json(
        args.out,
        NAME,
        {
            "quick": args.quick,
            "workload": about,
            "time_scale": args.time_scale,
            "workers": args.workers,
            "profile": PROFILE,
            "capacity_tokens": capacity,
            "too_large_requests": oversized,
            "prompt_format": "input_ids",
            "wall_s": round(wall_s, 3),
            "verdict": v,
            "verdict_hold_queue": v_queued,
            "rows": rows,
            "plot": args.plot,
        },
    )
    sys.stdout.flush()
    print(f"figures written to {path} and {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
