"""``kvroute sim``: what-if studies on the simulated fleet (DESIGN 6 and 7).

Every combination of ``--policy`` and ``--eviction`` is simulated on the same workload; a
markdown table goes to stdout, and with ``--json`` the last line is one JSON object: the
DESIGN 7 summary for a single combination, ``{"rows": [...]}`` for several.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from models import ModelSpecError, parse_spec
from router_service.routing import policy_names
from sim.cluster import ClusterConfig, simulate
from sim.profiles import PROFILES
from sim.report import markdown_table, summarize
from sim.workloads import GSP_ORDERS, GSPConfig, GSPWorkload

__all__ = ["add_parser", "build_workload", "run_one"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _lens(text: str) -> tuple[int, ...]:
    try:
        lens = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not lens or min(lens) < 2:
        raise argparse.ArgumentTypeError("lengths must be integers >= 2")
    return lens


def _speeds(text: str) -> tuple[float, ...]:
    try:
        speeds = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not speeds or min(speeds) <= 0:
        raise argparse.ArgumentTypeError("speeds must be > 0")
    return speeds


def _speed_change(text: str) -> tuple[int, float, float]:
    parts = text.split(":")
    try:
        worker, at_s, speed = int(parts[0]), float(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected WORKER:AT_S:SPEED, got {text!r}") from None
    if len(parts) != 3 or worker < 0 or at_s < 0 or speed <= 0:
        raise argparse.ArgumentTypeError(f"expected WORKER>=0:AT_S>=0:SPEED>0, got {text!r}")
    return worker, at_s, speed


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=["gsp"], default="gsp", help="workload generator")
    g.add_argument("--order", choices=GSP_ORDERS, default="random", help="gsp arrival order")
    g.add_argument(
        "--rate", type=_positive_float, default=12.0, help="requests per second (Poisson)"
    )
    g.add_argument("--requests", type=_positive_int, default=None, help="cap on requests sent")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and the fleet")
    g.add_argument("--gsp-groups", type=_positive_int, default=128)
    g.add_argument("--gsp-prompts-per-group", type=_positive_int, default=32)
    g.add_argument("--gsp-prefix-ratio", type=float, default=0.5)
    g.add_argument(
        "--gsp-lens",
        type=_lens,
        default=(512, 1024, 2048, 4096, 8192),
        help="total prompt lengths cycled over groups, comma-separated",
    )
    g.add_argument("--output-len", type=_positive_int, default=4, help="output tokens per request")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate a fleet behind the router (no GPU, no network)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(p)
    f = p.add_argument_group("fleet and router")
    f.add_argument("--workers", type=_positive_int, default=4)
    f.add_argument(
        "--policy",
        nargs="+",
        default=["lbgr"],
        metavar="NAME",
        help=f"one or more of: {', '.join(policy_names())}",
    )
    f.add_argument(
        "--eviction", nargs="+", default=["rlt"], metavar="NAME", help="one or more of: lru, rlt"
    )
    f.add_argument("--model", default="ewmean", help="residual model spec for lbgr (name or JSON)")
    f.add_argument(
        "--model-sharing",
        choices=["per_worker", "shared"],
        default="per_worker",
        help="lbgr: one residual model per worker, or one shared (worker as a feature)",
    )
    f.add_argument(
        "--worker-speeds",
        type=_speeds,
        default=None,
        metavar="S,S,...",
        help="relative speed per worker, e.g. 0.5,1,1,1 (heterogeneous fleet)",
    )
    f.add_argument(
        "--speed-change",
        type=_speed_change,
        action="append",
        default=[],
        metavar="WORKER:AT_S:SPEED",
        help="drift: worker WORKER runs at SPEED from AT_S on",
    )
    f.add_argument(
        "--cache-aware-preset",
        choices=["sglang", "paper"],
        default="paper",
        help="cache_aware thresholds: today's sglang-router or the paper's 0.4.6",
    )
    f.add_argument("--profile", choices=sorted(PROFILES), default="llama3.1-8b-l40")
    f.add_argument(
        "--capacity-tokens",
        type=_positive_int,
        default=None,
        help="KV capacity per worker (default: the profile's)",
    )
    f.add_argument("--page-size", type=_positive_int, default=1)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    o.add_argument(
        "--jobs", type=_positive_int, default=1, help="simulate combinations in parallel"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run, command_parser=p)


def build_workload(args: argparse.Namespace) -> GSPWorkload:
    config = GSPConfig(
        num_groups=args.gsp_groups,
        prompts_per_group=args.gsp_prompts_per_group,
        prefix_ratio=args.gsp_prefix_ratio,
        total_lens=args.gsp_lens,
        output_len=args.output_len,
        order=args.order,
        rate=args.rate,
        seed=args.seed,
    )
    return GSPWorkload(config, limit=args.requests)


def cluster_config(args: argparse.Namespace, policy: str, eviction: str) -> ClusterConfig:
    params: dict[str, Any] = {}
    if policy == "lbgr":
        params["model"] = parse_spec(args.model).to_dict()
        params["sharing"] = args.model_sharing
    elif policy == "cache_aware":
        params["preset"] = args.cache_aware_preset
    return ClusterConfig(
        workers=args.workers,
        policy=policy,
        policy_params=params,
        eviction=eviction,
        profile=args.profile,
        capacity_tokens=args.capacity_tokens,
        page_size=args.page_size,
        seed=args.seed,
        worker_speeds=args.worker_speeds,
        speed_changes=tuple(args.speed_change),
    )


def run_one(
    args: argparse.Namespace, policy: str, eviction: str, progress: bool = False
) -> dict[str, Any]:
    workload = build_workload(args)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(workload),
            desc=f"{policy}+{eviction}",
            unit="req",
            file=sys.stderr,
            delay=2.0,
            leave=False,
        )
    run = simulate(
        cluster_config(args, policy, eviction),
        workload,
        on_progress=bar.update if bar is not None else None,
    )
    if bar is not None:
        bar.close()
    return summarize(run, workload=workload.name, order=args.order, rate=args.rate)


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    known = set(policy_names())
    for name in args.policy:
        if name not in known:
            parser.error(
                f"--policy: unknown policy {name!r}; choose from {', '.join(sorted(known))}"
            )
    for name in args.eviction:
        if name not in ("lru", "rlt"):
            parser.error(f"--eviction: unknown eviction {name!r}; choose from lru, rlt")
    if not 0.0 < args.gsp_prefix_ratio < 1.0:
        parser.error("--gsp-prefix-ratio must be in (0, 1)")
    try:
        from models import make_model

        make_model(args.model)
    except ModelSpecError as exc:
        parser.error(f"--model: {exc}")
    if args.worker_speeds is not None and len(args.worker_speeds) != args.workers:
        parser.error(
            f"--worker-speeds has {len(args.worker_speeds)} values for {args.workers} workers"
        )
    for worker, _, _ in args.speed_change:
        if worker >= args.workers:
            parser.error(f"--speed-change names worker {worker}; workers are 0..{args.workers - 1}")
    if (
        args.capacity_tokens is not None
        and args.capacity_tokens <= max(args.gsp_lens) + args.output_len
    ):
        parser.error("--capacity-tokens must exceed the longest prompt plus --output-len")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _validate(args, parser)
    combos = list(itertools.product(args.policy, args.eviction))
    started = time.perf_counter()
    progress = not args.no_progress and sys.stderr.isatty()
    if args.jobs > 1 and len(combos) > 1:
        # The namespace carries its parser (for usage errors), which cannot be pickled.
        shipped = argparse.Namespace(**vars(args))
        vars(shipped).pop("command_parser", None)
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run_one, [shipped] * len(combos), *zip(*combos, strict=True)))
    else:
        rows = [run_one(args, policy, eviction, progress) for policy, eviction in combos]
    wall = time.perf_counter() - started
    print(markdown_table(rows))
    print(
        f"simulated {sum(r['requests'] for r in rows)} requests in {wall:.1f} s wall "
        f"({args.workload}, order {args.order}, {args.workers} workers, {args.rate:g} req/s)",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"rows": rows}, sort_keys=True))
    return 0
