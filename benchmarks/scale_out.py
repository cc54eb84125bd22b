"""Router scale-out: 1, 2 and 4 ``kvroute serve`` replicas behind one round-robin balancer.

Every row runs N router replicas (``lbgr``) sharing one real
redis-server (decayed load, the prefix-index stream, model snapshots) behind nginx
(``worker_processes 1``, round robin, keep-alive to the replicas, no response buffering so SSE
streams pass through), all on loopback. Each row starts fresh replicas in a fresh Redis
namespace (``--cluster``, after FLUSHALL).

1. **Workload rows**: the same emulated SGLang workers (``kvroute emulate``, rlt eviction,
   flushed between rows) and the same GSP workload (paper defaults: 128 groups x 32 prompts,
   12 req/s) sent to the balancer by the open-loop load generator (``sim.loadgen``, streaming,
   prompts as ``input_ids``). Cluster hit rate from the workers' ``/metrics``; p50/p95
   latency in emulated seconds; the index sync lag as quantiles of the replicas' merged
   ``kvroute_index_sync_lag_seconds`` histograms (interpolated within buckets, as Prometheus'
   ``histogram_quantile``); likewise how old each decision's copy of the shared loads was
   (``kvroute_load_copy_age_seconds``: another replica's reservation is unseen for at most
   its batch interval plus that age). The last row runs 4 replicas with
   ``KVROUTE_INDEX_SYNC=false``: load still shared, prefix knowledge not (each replica knows
   only what it routed itself, the situation of sglang-router replicas).
   Time scale 2x (24 req/s of wall time): what one router and 4 emulated workers sustain on
   a shared 2-core machine (see ``compare_routers.py``); the table shows the harness's own CPU
   (load generator, balancer, Redis, workers, replicas: cores busy) and the machine's.
2. **Throughput rows**: two instant workers (fixed answers from one nginx process,
   ``_fleet.InstantWorkers``: in production the workers are GPU servers on other machines, so
   they should take as little of this machine's CPU as possible) and ``wrk`` (closed loop,
   2 threads, 64 connections, distinct prompts sharing a prefix) against the balancer: the
   routers' ceiling with 1, 2 and 4 replicas (and 4 without index sync; and 1 and 2 with a
   Redis round trip per load operation, ``KVROUTE_LOAD_SYNC_MS=0``), best of
   ``--repeats`` interleaved runs. CPU per request of each part (replicas, nginx, Redis,
   workers, wrk) is read from ``/proc``, so the cost of sharing shows even when other jobs
   slow the run down; "dedicated cores" projects the 2-vs-1 scaling from it
   (2 x router CPU per request with 1 replica / with 2).
   The 1, 2 and 4 replica rows run again behind the **kernel balancer** (``_fleet.
   KernelBalancer``: an nftables round-robin NAT rule per connection, what a Kubernetes
   Service does in front of router pods; root and ``nft``, else the rows show why they did
   not run, ``--no-kernel-balancer`` skips them): no balancer process takes its share of the
   2 cores, which nginx does (~0.09 ms of CPU per request, as much as a tenth of a replica's).

CPU placement (2 cores): replica i is pinned to CPU ``i % 2`` with ``taskset`` (``--no-pin``:
they float); the balancer, Redis, the workers and the load generator float.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import (
    add_gsp_fleet_args,
    base_parser,
    check_gsp_fleet_args,
    format_ratio,
    ratio,
    write_json,
)
from _fleet import (
    BALANCERS,
    CPUS,
    Balancer,
    InstantWorkers,
    busy_fraction,
    children_cpu_s,
    group_cpu_s,
    harness_cpu_s,
    machine_jiffies,
    post_json,
    start_replicas,
    stop,
    sync_lag,
)

from sim.loadgen import BenchConfig, benchmark
from sim.local_cluster import LocalCluster, exit_on_sigterm
from sim.local_redis import RedisServer
from sim.report import markdown_table
from sim.workloads import GSPConfig, GSPWorkload

NAME = "scale_out"
HERE = Path(__file__).resolve().parent
PROFILE = "llama3.1-8b-l40"
POLICY = "lbgr"


@dataclass(frozen=True, slots=True)
class RowSpec:
    replicas: int
    index_sync: bool = True
    load_round_trips: bool = False  # KVROUTE_LOAD_SYNC_MS=0: a Redis round trip per operation
    balancer: str = "nginx"  # a key of _fleet.BALANCERS

    @property
    def label(self) -> str:
        name = f"{self.replicas} replica{'s' if self.replicas > 1 else ''}"
        if not self.index_sync:
            name += ", index sync off"
        if self.load_round_trips:
            name += ", load round trips"
        if self.balancer != "nginx":
            name += f", {self.balancer} balancer"
        return name


ROWS = (RowSpec(1), RowSpec(2), RowSpec(4), RowSpec(4, index_sync=False))
# The load store's two modes side by side: the default mirror (reads local, writes batched)
# and a round trip per read, reserve and release (load_sync_ms 0).
THROUGHPUT_ROWS = (*ROWS, RowSpec(1, load_round_trips=True), RowSpec(2, load_round_trips=True))
# The same replicas behind the kernel's round robin (nftables, as a Kubernetes Service): no
# balancer process competing with the replicas for the 2 cores.
KERNEL_ROWS = tuple(RowSpec(n, balancer="kernel") for n in (1, 2, 4))


def _replicas(
    spec: RowSpec, worker_urls: Sequence[str], store: RedisServer, cluster: str, args: Any
) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    return start_replicas(
        spec.replicas,
        worker_urls,
        store.url,
        cluster,
        policy=POLICY,
        index_sync=spec.index_sync,
        pin=not args.no_pin,
        load_sync_ms=0.0 if spec.load_round_trips else None,
    )


def workload_row(
    spec: RowSpec, cluster: LocalCluster, store: RedisServer, workload: GSPWorkload, args: Any
) -> dict[str, Any]:
    """Flush, start the replicas and the balancer, warm up, flush, run GSP; stop them."""
    store.flush()
    cluster.flush()
    urls, procs = _replicas(spec, cluster.worker_urls, store, f"gsp-{spec.replicas}", args)
    balancer = None
    try:
        balancer = Balancer(urls)
        tiny = b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}'
        for _ in range(2 * spec.replicas):  # round robin: every replica serves twice
            post_json(balancer.url + "/generate", tiny)
        cluster.flush()
        config = BenchConfig(
            url=balancer.url, time_scale=args.time_scale, worker_urls=list(cluster.worker_urls)
        )
        before, cpu_before, started = machine_jiffies(), harness_cpu_s(), time.perf_counter()
        summary, results = asyncio.run(
            benchmark(list(workload), config, policy=POLICY, eviction="rlt")
        )
        cores = (harness_cpu_s() - cpu_before) / (time.perf_counter() - started)
        busy = busy_fraction(before, machine_jiffies())
        lag = sync_lag(urls) if spec.index_sync and spec.replicas > 1 else {}
        age = {} if spec.load_round_trips else sync_lag(urls, "kvroute_load_copy_age_seconds")
        failures = Counter(r.error or f"HTTP {r.status}" for r in results if not r.ok)
        if failures:
            summary["failures"] = dict(failures.most_common(5))
            summary["balancer_errors"] = balancer.errors()
    finally:
        if balancer is not None:
            balancer.stop()
        stop(procs)
    summary.pop("per_worker", None)
    return {
        "row": spec.label,
        **asdict(spec),
        **summary,
        "lag_events": lag.get("events"),
        "lag_p50_ms": _ms(lag.get("p50_s")),
        "lag_p99_ms": _ms(lag.get("p99_s")),
        "copy_age_p50_ms": _ms(age.get("p50_s")),
        "copy_age_p99_ms": _ms(age.get("p99_s")),
        "harness_cores": round(cores, 3),
        "machine_busy": busy,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


_WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local prefix = string.rep("You are a helpful assistant. Answer briefly. ", 4)
local n = 0
request = function()
  n = n + 1
  local body = '{"text": "' .. prefix .. 'question ' .. n .. ' ' .. string.rep("q", 64)
    .. '", "sampling_params": {"max_new_tokens": 4}}'
  return wrk.format(nil, nil, nil, body)
end
"""


def wrk(url: str, seconds: float, connections: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(_WRK_SCRIPT)
    try:
        cmd = ["wrk", "-t2", f"-c{connections}", f"-d{int(seconds)}s", "-s", fh.name]
        out = subprocess.run(
            [*cmd, url + "/generate"], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(fh.name)
    done = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    requests, non_2xx = int(done.group(1)) if done else 0, int(errors.group(1)) if errors else 0
    duration_s = (float(done.group(2)) / (1000.0 if done.group(3) == "ms" else 1.0)) if done else 0
    return {
        # Successful responses only: a failing upstream answers fast and would look faster.
        "max_rps": round((requests - non_2xx) / duration_s, 2) if duration_s else 0.0,
        "requests": requests,
        "non_2xx": non_2xx,
        "socket_errors": socket_errors.group(1) if socket_errors else None,
    }


def throughput_row(
    spec: RowSpec,
    workers: Sequence[tuple[str, subprocess.Popen[bytes]]],
    store: RedisServer,
    args: Any,
) -> dict[str, Any]:
    """wrk through the balancer; CPU per request of each part, from /proc."""
    store.flush()
    urls, procs = _replicas(spec, [u for u, _ in workers], store, f"wrk-{spec.replicas}", args)
    balancer = None
    try:
        balancer = BALANCERS[spec.balancer](urls)
        wrk(balancer.url, 2, args.connections)  # warm-up: connections, first requests
        parts = {
            "routers": procs,
            "balancer": [balancer.proc] if balancer.proc is not None else [],
            "redis": [store.proc],
            "workers": list({p.pid: p for _, p in workers}.values()),  # one nginx serves all
        }
        cpu_before = {name: group_cpu_s(group) for name, group in parts.items()}
        wrk_before, before = children_cpu_s(), machine_jiffies()
        result = wrk(balancer.url, args.seconds, args.connections)
        busy = busy_fraction(before, machine_jiffies())
        cpu = {name: group_cpu_s(group) - cpu_before[name] for name, group in parts.items()}
        cpu["wrk"] = children_cpu_s() - wrk_before
        lag = sync_lag(urls) if spec.index_sync and spec.replicas > 1 else {}
        age = {} if spec.load_round_trips else sync_lag(urls, "kvroute_load_copy_age_seconds")
        if result["non_2xx"] or result["socket_errors"]:
            result["balancer_errors"] = balancer.errors()
            result["replicas_alive"] = sum(1 for p in procs if p.poll() is None)
    finally:
        if balancer is not None:
            balancer.stop()
        stop(procs)
    per_request = {k: round(v * 1000.0 / max(result["requests"], 1), 4) for k, v in cpu.items()}
    return {
        "row": spec.label,
        **asdict(spec),
        **result,
        "cpu_ms_per_request": per_request,
        "router_cpu_ms": per_request["routers"],
        "other_cpu_ms": round(sum(v for k, v in per_request.items() if k != "routers"), 4),
        "lag_p50_ms": _ms(lag.get("p50_s")),
        "lag_p99_ms": _ms(lag.get("p99_s")),
        "copy_age_p50_ms": _ms(age.get("p50_s")),
        "copy_age_p99_ms": _ms(age.get("p99_s")),
        "machine_busy": busy,
    }


# -- report ------------------------------------------------------------------------------------
WORKLOAD_COLUMNS = (
    ("setup", "row", "{}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("vs 1 replica", "hit_vs_one", "{}"),
    ("p50 lat (s)", "p50_latency_s", "{:.2f}"),
    ("p95 lat (s)", "p95_latency_s", "{:.2f}"),
    ("req/s", "throughput_rps", "{:.2f}"),
    ("done", "completed", "{}"),
    ("failed", "failed", "{}"),
    ("sync lag p50 (ms)", "lag_p50_ms", "{:.2f}"),
    ("sync lag p99 (ms)", "lag_p99_ms", "{:.2f}"),
    ("load copy age p50 (ms)", "copy_age_p50_ms", "{:.2f}"),
    ("load copy age p99 (ms)", "copy_age_p99_ms", "{:.2f}"),
    ("harness CPU (cores)", "harness_cores", "{:.2f}"),
    ("machine busy", "machine_busy", "{:.0%}"),
)
THROUGHPUT_COLUMNS = (
    ("setup", "row", "{}"),
    ("max req/s", "max_rps", "{:.0f}"),
    ("vs 1 replica", "rps_vs_one", "{}"),
    ("non-2xx", "non_2xx", "{}"),
    ("router CPU (ms/req)", "router_cpu_ms", "{:.3f}"),
    ("rest CPU (ms/req)", "other_cpu_ms", "{:.3f}"),
    ("sync lag p50 (ms)", "lag_p50_ms", "{:.2f}"),
    ("sync lag p99 (ms)", "lag_p99_ms", "{:.2f}"),
    ("load copy age p50 (ms)", "copy_age_p50_ms", "{:.2f}"),
    ("load copy age p99 (ms)", "copy_age_p99_ms", "{:.2f}"),
    ("machine busy", "machine_busy", "{:.0%}"),
)
HIT_TOLERANCE = 0.05  # 4 replicas within 5% (relative) of one replica's hit rate
SCALING_TARGET = 1.6  # throughput, 2 replicas / 1


def _by_label(rows: Sequence[dict[str, Any]], spec: RowSpec) -> dict[str, Any] | None:
    return next((r for r in rows if r["row"] == spec.label and "error" not in r), None)


def _value(row: dict[str, Any] | None, key: str) -> float | None:
    value = None if row is None else row.get(key)
    return None if value is None else float(value)


def verdict(workload_rows: list[dict[str, Any]], rps_rows: list[dict[str, Any]]) -> dict[str, Any]:
    one, four = _by_label(workload_rows, RowSpec(1)), _by_label(workload_rows, RowSpec(4))
    off = _by_label(workload_rows, RowSpec(4, index_sync=False))
    t1, t2 = _by_label(rps_rows, RowSpec(1)), _by_label(rps_rows, RowSpec(2))
    k1 = _by_label(rps_rows, RowSpec(1, balancer="kernel"))
    k2 = _by_label(rps_rows, RowSpec(2, balancer="kernel"))
    kernel_scaling = ratio(_value(k2, "max_rps"), _value(k1, "max_rps"))
    hit_ratio = ratio(_value(four, "hit_rate"), _value(one, "hit_rate"))
    off_ratio = ratio(_value(off, "hit_rate"), _value(one, "hit_rate"))
    scaling = ratio(_value(t2, "max_rps"), _value(t1, "max_rps"))
    # What the same code would do with a core of its own per replica (router CPU per request
    # measured; the rest of the set-up elsewhere): immune to other jobs on the machine.
    cpu1, cpu2 = _value(t1, "router_cpu_ms"), _value(t2, "router_cpu_ms")
    projected = ratio(2 * cpu1, cpu2) if cpu1 is not None else None
    trips = _by_label(rps_rows, RowSpec(1, load_round_trips=True))
    return {
        "mirror_rps_over_round_trips_1_replica": ratio(
            _value(t1, "max_rps"), _value(trips, "max_rps")
        ),
        "hit_rate_4_over_1": hit_ratio,
        "hit_rate_4_sync_off_over_1": off_ratio,
        "hit_rate_met": None if hit_ratio is None else hit_ratio >= 1.0 - HIT_TOLERANCE,
        "throughput_2_over_1": scaling,
        "throughput_met": None if scaling is None else scaling >= SCALING_TARGET,
        "throughput_2_over_1_dedicated_cores": projected,
        "throughput_2_over_1_kernel_balancer": kernel_scaling,
        "throughput_met_kernel_balancer": (
            None if kernel_scaling is None else kernel_scaling >= SCALING_TARGET
        ),
    }


def _relative(rows: list[dict[str, Any]], key: str, out: str) -> None:
    """``out``: ``key`` relative to 1 replica behind the same balancer."""
    for row in rows:
        base = _by_label(rows, RowSpec(1, balancer=row.get("balancer", "nginx")))
        row[out] = format_ratio(_value(row, key), _value(base, key))


def _yes(flag: bool | None) -> str:
    return "not measured" if flag is None else ("met" if flag else "NOT met")


def verdict_text(v: dict[str, Any]) -> str:
    def fmt(x: float | None, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    return (
        f"- hit rate, 4 replicas / 1 replica: {fmt(v['hit_rate_4_over_1'], '.1%')} "
        f"(target >= {1 - HIT_TOLERANCE:.0%}): {_yes(v['hit_rate_met'])}; "
        f"without index sync: {fmt(v['hit_rate_4_sync_off_over_1'], '.1%')}\n"
        f"- router throughput, 2 replicas / 1, behind nginx: "
        f"{fmt(v['throughput_2_over_1'], '.2f')}x (target >= {SCALING_TARGET}x): "
        f"{_yes(v['throughput_met'])}; with a dedicated core per replica (2 x router CPU per "
        f"request of 1 replica / of 2): {fmt(v['throughput_2_over_1_dedicated_cores'], '.2f')}x\n"
        f"- router throughput, 2 replicas / 1, behind the kernel balancer: "
        f"{fmt(v['throughput_2_over_1_kernel_balancer'], '.2f')}x (target >= "
        f"{SCALING_TARGET}x): {_yes(v['throughput_met_kernel_balancer'])}\n"
        f"- one replica, load mirror / a Redis round trip per operation: "
        f"{fmt(v['mirror_rps_over_round_trips_1_replica'], '.2f')}x req/s"
    )


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> Any:
    parser = base_parser(NAME, __doc__)
    add_gsp_fleet_args(parser)
    parser.add_argument("--seconds", type=float, default=None, help="wrk duration (15)")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections")
    parser.add_argument(
        "--no-kernel-balancer",
        action="store_true",
        help="skip the throughput rows behind the kernel balancer (they need root and nft)",
    )
    parser.add_argument("--no-pin", action="store_true", help="let the replicas float")
    parser.add_argument("--repeats", type=int, default=None, help="wrk runs per row (2)")
    parser.add_argument("--skip-workload", action="store_true", help="throughput rows only")
    parser.add_argument("--skip-throughput", action="store_true", help="workload rows only")
    args = parser.parse_args(argv)
    check_gsp_fleet_args(parser, args)
    args.seconds = args.seconds or (5.0 if args.quick else 15.0)
    args.repeats = args.repeats or (1 if args.quick else 2)
    return args


def run_workload(args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    workload = GSPWorkload(
        GSPConfig(
            num_groups=args.groups, prompts_per_group=args.prompts, rate=args.rate, seed=args.seed
        )
    )
    emulated_s = list(workload)[-1].arrival_ms / 1000.0
    print(
        f"GSP {args.groups}x{args.prompts} at {args.rate:g} req/s: {emulated_s:.0f} s emulated, "
        f"~{emulated_s / args.time_scale:.0f} s wall per row",
        file=sys.stderr,
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    store = RedisServer().start()
    try:
        with LocalCluster(
            workers=args.workers, eviction="rlt", profile=PROFILE, time_scale=args.time_scale
        ) as cluster:
            cluster.start_workers(seed=args.seed)
            for spec in ROWS:
                print(f"workload: {spec.label} ...", file=sys.stderr, flush=True)
                try:
                    rows.append(workload_row(spec, cluster, store, workload, args))
                except (OSError, RuntimeError, TimeoutError) as exc:
                    rows.append({"row": spec.label, "error": f"{type(exc).__name__}: {exc}"})
                print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        store.stop()
    _relative(rows, "hit_rate", "hit_vs_one")
    return rows, {"name": "gsp", **asdict(workload.config), "emulated_s": emulated_s}


def run_throughput(args: Any) -> list[dict[str, Any]]:
    """Every row ``--repeats`` times, interleaved; each row keeps its best run (other jobs on
    a shared machine only ever slow a run down)."""
    specs = THROUGHPUT_ROWS + (() if args.no_kernel_balancer else KERNEL_ROWS)
    workers = InstantWorkers(2)
    runs: dict[str, list[dict[str, Any]]] = {spec.label: [] for spec in specs}
    store = RedisServer().start()
    try:
        pool = [(url, workers.proc) for url in workers.urls]
        for repeat in range(args.repeats):
            for spec in specs:
                print(f"throughput: {spec.label} (run {repeat + 1}) ...", file=sys.stderr)
                try:
                    runs[spec.label].append(throughput_row(spec, pool, store, args))
                except (OSError, RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
                    runs[spec.label].append({"error": f"{type(exc).__name__}: {exc}"})
                print(f"  {runs[spec.label][-1]}", file=sys.stderr, flush=True)
    finally:
        store.stop()
        workers.stop()
    rows = []
    for spec in specs:
        done = [r for r in runs[spec.label] if "error" not in r]
        best = max(done, key=lambda r: r["max_rps"]) if done else runs[spec.label][-1]
        rows.append({"row": spec.label, **best, "runs_rps": [r.get("max_rps") for r in done]})
    _relative(rows, "max_rps", "rps_vs_one")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()  # so the finally blocks stop the processes this started
    args = parse_args(argv)
    started = time.perf_counter()
    workload_rows, workload = ([], {}) if args.skip_workload else run_workload(args)
    rps_rows = [] if args.skip_throughput else run_throughput(args)
    v = verdict(workload_rows, rps_rows)
    wall_s = time.perf_counter() - started
    placement = (
        "replicas float"
        if args.no_pin
        else f"replica i pinned to CPU i % {CPUS} (taskset); nginx, Redis, workers float"
    )
    if workload_rows:
        print(
            f"## Scale-out, GSP {args.groups}x{args.prompts} at {args.rate:g} req/s, "
            f"{args.workers} emulated workers ({PROFILE}, rlt), time scale {args.time_scale:g}x, "
            f"{POLICY} behind nginx round robin, one Redis\n"
        )
        print(markdown_table(workload_rows, WORKLOAD_COLUMNS) + "\n")
    if rps_rows:
        print(
            f"## Router throughput: wrk -t2 -c{args.connections} {args.seconds:g} s through nginx "
            f"(or the kernel balancer where a row says so; 'vs 1 replica' compares rows behind "
            f"the same balancer), 2 instant workers (nginx), best of {args.repeats}\n"
        )
        print(markdown_table(rps_rows, THROUGHPUT_COLUMNS) + "\n")
    print(verdict_text(v) + "\n")
    print(
        f"Latencies in emulated seconds; hit rate from the workers' counters; sync lag from the "
        f"replicas' merged lag histograms. {placement}; {CPUS} CPUs; {wall_s:.0f} s wall."
    )
    path = write_json(
        args.out,
        NAME,
        {
            "quick": args.quick,
            "workload": workload,
            "time_scale": args.time_scale,
            "workers": args.workers,
            "profile": PROFILE,
            "policy": POLICY,
            "balancer": "nginx round robin, worker_processes 1, upstream keepalive; rows "
            "marked 'kernel balancer': nftables DNAT round robin per connection",
            "placement": placement,
            "wrk": {"threads": 2, "connections": args.connections, "seconds": args.seconds},
            "wall_s": round(wall_s, 3),
            "verdict": v,
            "workload_rows": workload_rows,
            "throughput_rows": rps_rows,
        },
    )
    sys.stdout.flush()
    print(f"figures written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
