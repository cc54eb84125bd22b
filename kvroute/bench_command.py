"""``kvroute bench --url ROUTER_URL``: open-loop load against a router (or one worker).

Prints a table; with ``--json`` the last stdout line is the run's summary (its keys:
docs/design.md, *The summary of sim and bench --json*). The hit rate is read from the
workers' ``/metrics`` (``--worker-urls``; found automatically behind a kvroute router with
its admin token). ``--log`` writes one JSON line per request, ``--plot`` a PNG. A target that
cannot be reached is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.workloads import WorkloadRequest

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    from kvroute.workload_args import add_workload_arguments
    from kvroute.workload_args import positive_float as _positive_float

    p = sub.add_parser(
        "bench",
        help="open-loop load generator (streams to time TTFT)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url", required=True, help="router (or worker) base URL, e.g. http://127.0.0.1:8000"
    )
    p.add_argument(
        "--api",
        choices=["generate", "completions"],
        default="generate",
        help="SGLang's /generate or OpenAI's /v1/completions",
    )
    p.add_argument("--model", default="default", help="model name for /v1/completions")
    p.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="send prompts as token ids, or as their text (sim/text.py: a router then matches "
        "characters, as sgl-router did on the paper's text prompts)",
    )
    p.add_argument(
        "--time-scale",
        type=_positive_float,
        default=1.0,
        help="workers run this many times faster: arrivals are compressed and "
        "latencies reported in emulated seconds",
    )
    p.add_argument(
        "--worker-urls",
        nargs="+",
        default=None,
        metavar="URL",
        help="workers whose /metrics give the hit rate (default: the kvroute router's "
        "workers, read with --admin-token; else no hit rate)",
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help="a kvroute router's admin token, to read its policy and workers (default: none; "
        "then name them with the flags below)",
    )
    p.add_argument(
        "--policy-label",
        default=None,
        help="policy name for the summary (default: the router's, else unknown)",
    )
    p.add_argument(
        "--eviction-label",
        default=None,
        help="eviction name for the summary (default: what the workers report, else unknown)",
    )
    p.add_argument(
        "--timeout-s", type=_positive_float, default=600.0, help="per-request timeout, seconds"
    )
    p.add_argument("--json", action="store_true", help="print the JSON summary last")
    p.add_argument("--out", default=None, help="write the JSON summary to this file (default: no)")
    p.add_argument(
        "--control-url",
        default=None,
        help="kvroute's control listener, to find the policy and workers (with --admin-token); "
        "default: the --url port + 1",
    )
    p.add_argument(
        "--log", default=None, help="write one JSON line per request to this file (default: no)"
    )
    p.add_argument("--plot", default=None, help="write a PNG of latencies here (default: no)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_workload_arguments(p, fleet=False)
    p.set_defaults(run=run, command_parser=p)


async def run_async(
    args: argparse.Namespace, workload: Sequence[WorkloadRequest] | None = None
) -> dict[str, Any]:
    from kvroute.sim_command import build_workload
    from sim.loadgen import BenchConfig, benchmark, discover, eviction_of, write_log
    from sim.report import markdown_table

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    about = await discover(url, headers, getattr(args, "control_url", None))
    workers = args.worker_urls or [w["url"] for w in about.get("workers", {}).get("workers", [])]
    policy = args.policy_label or about.get("policy", {}).get("name", "unknown")
    eviction = args.eviction_label or await eviction_of(workers)
    if workload is None:
        workload = list(build_workload(args))
    config = BenchConfig(
        url=url,
        api=args.api,
        model=args.model,
        time_scale=args.time_scale,
        timeout_s=args.timeout_s,
        worker_urls=workers,
        prompt_format=args.prompt_format,
    )
    bar = None
    if not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(workload), unit="req", file=sys.stderr, desc="bench")
    summary, results = await benchmark(
        workload,
        config,
        policy=policy,
        eviction=eviction,
        on_done=(lambda _: bar.update(1)) if bar is not None else None,
        workload_name=args.workload,
        order=args.order,
        rate=args.rate,
        url=url,
    )
    if bar is not None:
        bar.close()
    print(markdown_table([summary]))
    if args.log:
        write_log(args.log, results)
    if args.plot:
        from sim.plots import plot_rows

        lat = {f"{policy}+{eviction}": [r.latency_s for r in results if r.latency_s]}
        plot_rows(
            [{**summary, "label": f"{policy}+{eviction}"}], lat, args.plot, f"kvroute bench {url}"
        )
    return summary


def unreachable(url: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers HTTP at ``url`` (``None``: something does, whatever its status)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError:  # an answer, even 404 or 503: something is there
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(reason) or type(exc).__name__


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"--url must start with http:// or https://, got {args.url!r}")
    from kvroute.sim_command import load_workload

    workload = list(load_workload(args, parser))  # bad flags and files first: no network
    why = unreachable(args.url)
    if why is not None:
        parser.error(
            f"cannot reach {args.url}: {why}; is a router (kvroute serve, kvroute cluster) or "
            "a worker listening there?"
        )
    summary = asyncio.run(run_async(args, workload))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(summary, fh, indent=2, sort_keys=True)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0 if summary["completed"] else 1
