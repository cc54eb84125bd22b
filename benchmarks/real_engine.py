"""kvroute against the real sglang-router on real SGLang workers, on this machine's CPU.

Two SGLang 0.5.23 workers serve the tiny model that ``scripts/real_engine_setup.sh`` makes
(run it first). One run: the workers start with kvroute's RLT radix cache and serve two rows,
``kvroute serve`` with ``lbgr`` and the PyPI ``sglang-router`` (0.3.2, Rust) with
``cache_aware``; then they restart with SGLang's own LRU and serve the same two rows. Every row
sends the same GSP workload (generated shared prefix, the paper's synthetic workload) scaled
to what two CPU workers serve: 16 groups x 12 prompts of 256-1,024 tokens, half of each a
shared system prompt, random order, Poisson arrivals at 8 req/s, 4 output tokens, ids folded
into the tiny model's vocabulary (``kvroute.engine_launch.fit_to_vocab``). Each worker's KV
pool (``--max-total-tokens 4000``) holds less than the ~4,900 prefix tokens in play and more
than half: a router that keeps groups together fits them, one that spreads them evicts.
Traffic comes from ``sim.loadgen`` (streaming ``/generate``, one connection per request),
so TTFT is measured; the hit rate is the workers' own (``sglang:cached_tokens_total /
sglang:prompt_tokens_total`` over the row); the workers are flushed between rows.

What this says, and what it does not. It is real serving: SGLang's scheduler, radix cache,
eviction (RLT through the plugin's entry point), HTTP, streaming and both routers' real
code, with the routing decisions they would make on a GPU fleet for the same prompts. The hit
rates are therefore meaningful: they depend on prompts, routing and pool sizes, not on the
hardware. Latencies are not a GPU's: the tiny model (2 layers, hidden 256) costs
microseconds a token, so a request's time is mostly HTTP, tokenizer-free scheduling and
Python overhead of the router and the engine, and a cache hit saves little time. On a GPU
serving an 8B model a miss costs tens of milliseconds of prefill per thousand tokens, which
is what makes hit rate turn into latency there (``benchmarks/compare_routers.py`` models it
with emulated workers calibrated on an L40). Two CPU workers also share two cores with the
routers and the load generator, so a busy router slows the workers it routes to.

    python benchmarks/real_engine.py [--out results/real_engine.json] [--requests N]

~6-8 minutes on 2 cores (two worker starts and four rows).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from engine_ext.cache.keys import ids_to_key, key_to_ids
from kvroute.engine_launch import (
    EngineCluster,
    EngineSpec,
    fit_to_vocab,
    model_dir,
    vocab_size,
)
from sim.loadgen import BenchConfig, benchmark
from sim.report import markdown_table
from sim.workloads.base import WorkloadRequest
from sim.workloads.gsp import GSPConfig, GSPWorkload

POOL_TOKENS = 4000
GSP = GSPConfig(
    num_groups=16,
    prompts_per_group=12,
    prefix_ratio=0.5,
    total_lens=(256, 512, 1024),
    output_len=4,
    order="random",
    rate=8.0,
    seed=0,
)
ROWS = (("kvroute", "lbgr"), ("sglang-router", "cache_aware"))
COLUMNS = (
    ("router", "router", "{}"),
    ("policy", "policy", "{}"),
    ("eviction", "eviction", "{}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("p50 lat (s)", "p50_latency_s", "{:.3f}"),
    ("p95 lat (s)", "p95_latency_s", "{:.3f}"),
    ("p50 TTFT (s)", "p50_ttft_s", "{:.3f}"),
    ("p95 TTFT (s)", "p95_ttft_s", "{:.3f}"),
    ("done", "completed", "{}"),
    ("failed", "failed", "{}"),
    ("evicted tokens", "evicted_tokens", "{:.0f}"),
    ("req/s", "throughput_rps", "{:.2f}"),
)


def workload(limit: int | None, vocab: int) -> list[WorkloadRequest]:
    """GSP's requests with their ids folded into the model's vocabulary."""
    return [
        dataclasses.replace(item, prompt=ids_to_key(fit_to_vocab(key_to_ids(item.prompt), vocab)))
        for item in GSPWorkload(GSP, limit=limit)
    ]


def _evicted(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("sglang:evicted_tokens_total"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def run_rows(eviction: str, requests: list[WorkloadRequest], log_dir: str) -> list[dict[str, Any]]:
    backend = "rlt" if eviction == "rlt" else None
    spec = EngineSpec(radix_cache_backend=backend, max_total_tokens=POOL_TOKENS)
    rows = []
    with EngineCluster(specs=(spec, spec), log_dir=os.path.join(log_dir, eviction)) as cluster:
        cluster.start_workers()
        print(f"{eviction} workers healthy after {cluster.startup_s[-1]:.0f} s", file=sys.stderr)
        for router, policy in ROWS:
            cluster.flush()
            url = cluster.start_router(router, policy)
            cluster.warm_up()
            evicted = _evicted(cluster.worker_urls)
            config = BenchConfig(url=url, worker_urls=list(cluster.worker_urls))
            summary, _ = asyncio.run(benchmark(requests, config, policy=policy, eviction=eviction))
            summary.update(
                router=router,
                evicted_tokens=_evicted(cluster.worker_urls) - evicted,
                startup_s=round(cluster.startup_s[-1], 1),
            )
            print(
                f"  {router} {policy} + {eviction}: hit rate {summary['hit_rate']:.3f}, "
                f"p50 {summary['p50_latency_s']}, failed {summary['failed']}",
                file=sys.stderr,
            )
            rows.append(summary)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring for what the figures do and do not say.",
    )
    parser.add_argument("--out", default="results/real_engine.json")
    parser.add_argument("--requests", type=int, default=None, help="the first N requests only")
    parser.add_argument("--log-dir", default="results/real_engine_logs")
    args = parser.parse_args()
    requests = workload(args.requests, vocab_size(model_dir()))
    started = time.monotonic()
    rows = run_rows("rlt", requests, args.log_dir) + run_rows("lru", requests, args.log_dir)
    table = markdown_table(rows, COLUMNS)
    print(table)
    result = {
        "benchmark": "real_engine",
        "workload": {**dataclasses.asdict(GSP), "requests": len(requests)},
        "pool_tokens": POOL_TOKENS,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "wall_s": round(time.monotonic() - started, 1),
        "rows": rows,
        "table": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"\n{args.out} written ({result['wall_s']:.0f} s)", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
