"""``kvroute cluster``: a fleet behind the router, in one command.

Emulated (the default): starts ``--workers`` emulated SGLang workers and a kvroute router (no
GPU, no Redis), sends the workload once per ``--policy`` (each on freshly flushed workers),
prints the results table and one ``/explain`` sample, and stops every process on exit or
Ctrl-C.

``--engine sglang`` (or ``vllm``): starts ``--workers`` real engine workers on this machine's
CPU serving a tiny model made locally (SGLang with ``--radix-cache-backend rlt`` unless
``--eviction lru``, metrics and cache reports on), then ``kvroute serve`` with the first
``--policy`` in front of them, prints where to send requests, and serves until Ctrl-C, which
stops every process. The engines come from ``scripts/real_engine_setup.sh`` (once, a few
minutes; ``--vllm`` for vLLM); a start takes ~30-90 s on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from typing import Any

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    from kvroute.engine_launch import DEFAULT_MAX_TOTAL_TOKENS, ENGINES
    from kvroute.sim_command import _positive_float, _positive_int, add_workload_arguments

    p = sub.add_parser(
        "cluster",
        help="emulated workers + router + traffic, one command",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine",
        choices=["emulated", *ENGINES],
        default="emulated",
        help="emulated workers (default), or real SGLang / vLLM workers on this CPU serving "
        "a tiny model (scripts/real_engine_setup.sh installs them once); real engines serve "
        "until Ctrl-C instead of running the workload",
    )
    p.add_argument("--workers", type=_positive_int, default=4, help="workers to start")
    p.add_argument(
        "--eviction",
        choices=["lru", "rlt"],
        default=None,
        help="the workers' cache eviction (default rlt; real SGLang: --radix-cache-backend "
        "rlt, or SGLang's own LRU with lru; vLLM keeps its own prefix cache: lru only)",
    )
    p.add_argument(
        "--policy",
        nargs="+",
        default=["lbgr", "cache_aware", "round_robin"],
        metavar="NAME",
        help="kvroute policies to run, one after another",
    )
    p.add_argument(
        "--capacity-tokens",
        type=_positive_int,
        default=None,
        help="KV capacity per worker (default: the profile's; real SGLang: "
        f"--max-total-tokens, default {DEFAULT_MAX_TOTAL_TOKENS})",
    )
    p.add_argument(
        "--profile",
        default="llama3.1-8b-l40",
        help="service model of the workers (sim/profiles.py)",
    )
    p.add_argument(
        "--time-scale",
        type=_positive_float,
        default=10.0,
        help="emulated time runs this many times faster than real time",
    )
    p.add_argument(
        "--log-dir", default=None, help="keep worker and router logs here (default: discarded)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the summaries and the /explain sample as JSON last",
    )
    add_workload_arguments(p)
    p.set_defaults(run=run, command_parser=p)


def _explain_sample(router_url: str, prompt_ids: list[int], token: str) -> dict[str, Any]:
    body = json.dumps({"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 4}})
    req = urllib.request.Request(
        router_url + "/explain",
        data=body.encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:  # loopback
        result: dict[str, Any] = json.loads(resp.read())
    return result


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.engine != "emulated":
        from kvroute.cluster_engines import serve_engines

        return serve_engines(args, parser)
    args.eviction = args.eviction or "rlt"
    from engine_ext.cache.keys import key_to_ids
    from kvroute.sim_command import load_workload
    from sim.loadgen import BenchConfig, benchmark
    from sim.local_cluster import LocalCluster
    from sim.report import markdown_table

    workload = list(load_workload(args, parser))
    rows: list[dict[str, Any]] = []
    explain: dict[str, Any] = {}
    with LocalCluster(
        workers=args.workers,
        eviction=args.eviction,
        capacity_tokens=args.capacity_tokens,
        profile=args.profile,
        time_scale=args.time_scale,
        log_dir=args.log_dir,
    ) as cluster:
        print(
            f"starting {args.workers} emulated workers ({args.eviction}, time scale "
            f"{args.time_scale:g}x)...",
            file=sys.stderr,
        )
        started = time.monotonic()
        cluster.start_workers(seed=args.seed)
        print(f"workers ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
        for policy in args.policy:
            cluster.flush()
            url = cluster.start_router("kvroute", policy)
            cluster.warm_up()
            print(
                f"{policy}: {len(workload)} requests at {args.rate:g} req/s "
                f"(emulated) through {url}",
                file=sys.stderr,
            )
            config = BenchConfig(
                url=url, time_scale=args.time_scale, worker_urls=list(cluster.worker_urls)
            )
            summary, _ = asyncio.run(
                benchmark(workload, config, policy=policy, eviction=args.eviction)
            )
            rows.append(summary)
            if policy == args.policy[0]:
                # With the cluster's admin token /explain shows every worker's figures.
                explain = _explain_sample(url, key_to_ids(workload[0].prompt), cluster.admin_token)
    print(markdown_table(rows))
    print(f"\n/explain for the first prompt of the workload, after the run ({args.policy[0]}):")
    from kvroute.explain_table import format_decision

    print(format_decision(explain, seconds=True, clock="emulated" if args.time_scale != 1 else ""))
    if args.json:
        print(json.dumps({"rows": rows, "explain": explain}, sort_keys=True))
    return 0 if all(r["completed"] for r in rows) else 1
