"""``kvroute cluster --engine sglang|vllm``: real engine workers and the router, until Ctrl-C.

The workers serve the tiny model that ``scripts/real_engine_setup.sh`` makes, each with one
OpenMP thread (unless ``OMP_NUM_THREADS`` says otherwise); kvroute serves in front of them
with the first ``--policy``. Every process runs in its own process group and is stopped on
Ctrl-C, on SIGTERM, or when the router exits.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from kvroute.engine_launch import (
    SERVED_MODEL_NAME,
    EngineCluster,
    EngineEnvMissing,
    EngineSpec,
    engine_python,
    model_dir,
)

__all__ = ["engine_specs", "serve_engines"]


def engine_specs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[EngineSpec]:
    """One spec per worker from the command line; refuses what the engine cannot do."""
    eviction = args.eviction or ("lru" if args.engine == "vllm" else "rlt")
    if args.engine == "vllm":
        if eviction == "rlt":
            parser.error(
                "--eviction rlt is an SGLang radix-cache backend; vLLM keeps its own prefix "
                "cache (use --engine sglang for RLT, or drop --eviction)"
            )
        if args.capacity_tokens is not None:
            parser.error(
                "--capacity-tokens sets SGLang's KV pool; vLLM's CPU build sizes its own "
                "(VLLM_CPU_KVCACHE_SPACE, in GiB)"
            )
        return [EngineSpec("vllm", radix_cache_backend=None)] * args.workers
    spec = EngineSpec(
        "sglang",
        radix_cache_backend="rlt" if eviction == "rlt" else None,
        **({"max_total_tokens": args.capacity_tokens} if args.capacity_tokens else {}),
    )
    return [spec] * args.workers


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def serve_engines(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    specs = engine_specs(args, parser)
    try:
        engine_python(args.engine)
        model = model_dir()
    except EngineEnvMissing as exc:
        print(f"kvroute cluster: {exc}", file=sys.stderr)
        return 2
    policy = args.policy[0]
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    started = time.monotonic()
    try:
        with EngineCluster(specs=specs, log_dir=args.log_dir) as cluster:
            print(
                f"starting {len(specs)} {specs[0].label} workers serving {model} "
                f"(logs in {cluster.log_dir})...",
                file=sys.stderr,
                flush=True,
            )
            cluster.start_workers()
            print(
                f"workers healthy after {time.monotonic() - started:.0f} s: "
                + " ".join(cluster.worker_urls),
                file=sys.stderr,
                flush=True,
            )
            url = cluster.start_router("kvroute", policy)
            _print_ready(url, policy, len(specs), specs[0].label)
            return _watch(cluster)
    except KeyboardInterrupt:
        print("stopped every worker and the router", file=sys.stderr)
        return 0


def _print_ready(url: str, policy: str, workers: int, label: str) -> None:
    print(f"kvroute ({policy}) serves on {url} in front of {workers} {label} workers", flush=True)
    body = f'{{"model": "{SERVED_MODEL_NAME}", "prompt": "Red river stone", "max_tokens": 8}}'
    print(
        f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
        f"  (the model is random: its answers are gibberish.) Ctrl-C stops everything.",
        flush=True,
    )


def _watch(cluster: EngineCluster) -> int:
    """Serve until Ctrl-C; say when a worker dies (the router fails over); end if the router
    does."""
    reported: set[int] = set()
    while True:
        time.sleep(1.0)
        for i, alive in enumerate(cluster.alive()):
            if not alive and i not in reported:
                reported.add(i)
                print(
                    f"worker {cluster.worker_urls[i]} exited; the end of its log:\n"
                    f"{cluster.log_tail(i)}",
                    file=sys.stderr,
                    flush=True,
                )
        if not cluster.router_alive():
            print("the router exited", file=sys.stderr)
            return 1
