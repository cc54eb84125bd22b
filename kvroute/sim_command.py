"""``kvroute sim``: what-if studies on a simulated fleet (no GPU, no network).

Every combination of ``--policy`` and ``--eviction`` is simulated on the same workload; a
markdown table goes to stdout, and with ``--json`` the last line is one JSON object: the
run's summary for a single combination, ``{"rows": [...]}`` for several (its keys:
docs/design.md, *The summary of sim and bench --json*).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from engine_ext.cache import MARKINGS
from kvroute.workload_args import (
    add_workload_arguments,
    build_workload,
    check_workload_arguments,
    describe_workload,
    positive_float,
    positive_int,
)
from models import ModelSpecError, parse_spec
from router_service.routing import HoldSettings, policy_names
from sim.ceiling import OfflineLimits
from sim.cluster import OUTPUT_HINTS, PROMPT_FORMATS, ClusterConfig, simulate
from sim.profiles import PROFILES
from sim.report import TABLE_COLUMNS, markdown_table, summarize
from sim.workloads import Workload, WorkloadFileError

__all__ = ["add_parser", "add_workload_arguments", "build_workload", "load_workload", "run_one"]

# The flag parsers under the names bench and cluster import them by.
_positive_int = positive_int
_positive_float = positive_float


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


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate a fleet behind the router (no GPU, no network)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(p)
    p.add_argument(
        "--time-scale",
        dest="trace_time_scale",
        type=_positive_float,
        default=1.0,
        help="trace/azure replay: divide the trace's timestamps by this (2 = twice the load)",
    )
    f = p.add_argument_group("fleet and router")
    f.add_argument("--workers", type=_positive_int, default=4, help="simulated workers")
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
    f.add_argument(
        "--model",
        default=None,
        help="residual model spec for lbgr (name or JSON; default: the policy's, ratio)",
    )
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
        help="relative speed per worker, e.g. 0.5,1,1,1 for a heterogeneous fleet (default: all 1)",
    )
    f.add_argument(
        "--speed-change",
        type=_speed_change,
        action="append",
        default=[],
        metavar="WORKER:AT_S:SPEED",
        help="drift: worker WORKER runs at SPEED from AT_S on (repeatable; default: none)",
    )
    f.add_argument(
        "--cache-aware-preset",
        choices=["sglang", "paper"],
        default="paper",
        help="cache_aware thresholds: today's sglang-router or the paper's 0.4.6",
    )
    f.add_argument(
        "--cache-threshold",
        type=float,
        default=None,
        metavar="X",
        help="cache_aware: override the preset's cache_threshold (match rate needed, 0..1; "
        "default: the preset's)",
    )
    f.add_argument(
        "--queue-slots",
        type=_positive_int,
        default=None,
        metavar="N",
        help="hold requests in the router, at most N in flight per worker (late binding with "
        "cache affinity, shortest first; router_service.routing.hold_queue); default: off",
    )
    f.add_argument(
        "--queue-free-at",
        choices=["first_token", "last_token", "end"],
        default="first_token",
        help="with --queue-slots: a request frees its slot at its first token (default), "
        "when one decode step is left (last_token) or at its end (short outputs)",
    )
    f.add_argument(
        "--queue-max-wait-s",
        type=_positive_float,
        default=HoldSettings().max_wait_ms / 1000.0,
        metavar="S",
        help="with --queue-slots: a request waiting this long goes to any worker "
        "(default %(default)g)",
    )
    f.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="llama3.1-8b-l40",
        help="service model of each worker: model, GPU, KV capacity (sim/profiles.py)",
    )
    f.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default="ids",
        help="what the client sends: token ids (the router matches tokens) or the prompt's "
        "text (it matches characters, as sgl-router 0.4.6 and the paper's LBGR did with the "
        "paper's text prompts; sim/text.py gives each token its characters)",
    )
    f.add_argument(
        "--output-hint",
        choices=OUTPUT_HINTS,
        default="exact",
        help="what the client sends as max_new_tokens: each answer's length (exact, as "
        "benchmark clients) or nothing (none, as chat clients that let the model stop: the "
        "router only learns the mean answer)",
    )
    f.add_argument(
        "--rlt-marking",
        choices=MARKINGS,
        default="path",
        help="rlt: a cache match marks its whole path, or only the node it splits off "
        "(split: the paper's code); an insert marks its path either way",
    )
    f.add_argument(
        "--waiting-refresh",
        choices=("on", "off"),
        default="on",
        help="workers touch their waiting requests' cached prefixes so they are evicted last, "
        "as SGLang 0.5.23 does (on); SGLang 0.4.6, the paper's, did not (off)",
    )
    f.add_argument(
        "--capacity-tokens",
        type=_positive_int,
        default=None,
        help="KV capacity per worker (default: the profile's)",
    )
    f.add_argument(
        "--page-size", type=_positive_int, default=1, help="KV cache page size in tokens"
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    o.add_argument(
        "--jobs", type=_positive_int, default=1, help="simulate combinations in parallel"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument(
        "--ceiling",
        action="store_true",
        help="add the offline hit-rate ceiling (unlimited capacity) and, with one worker, the "
        "offline upper bound at the capacity (sim.ceiling)",
    )
    p.set_defaults(run=run, command_parser=p)


def cluster_config(args: argparse.Namespace, policy: str, eviction: str) -> ClusterConfig:
    params: dict[str, Any] = {}
    if policy == "lbgr":
        if args.model is not None:
            params["model"] = parse_spec(args.model).to_dict()
        params["sharing"] = args.model_sharing
    elif policy == "cache_aware":
        params["preset"] = args.cache_aware_preset
        if args.cache_threshold is not None:
            params["cache_threshold"] = args.cache_threshold
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
        hold=HoldSettings(
            slots=args.queue_slots or 0,
            max_wait_ms=args.queue_max_wait_s * 1000.0,
            free_at_first_token=args.queue_free_at == "first_token",
            free_at_last_token=args.queue_free_at == "last_token",
        ),
        prompt_format=args.prompt_format,
        output_hint=args.output_hint,
        marking=args.rlt_marking,
        refresh_waiting=args.waiting_refresh == "on",
    )


def run_one(
    args: argparse.Namespace,
    policy: str,
    eviction: str,
    progress: bool = False,
    workload: Workload | None = None,
) -> dict[str, Any]:
    """Simulate one policy x eviction; the workload is built from ``args`` unless given."""
    if workload is None:
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
    return summarize(run, **describe_workload(args))


def load_workload(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Workload:
    """Build the workload; bad flags or a missing or malformed file are usage errors (exit 2)."""
    check_workload_arguments(args, parser)
    try:
        return build_workload(args)
    except WorkloadFileError as exc:
        parser.error(str(exc))


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
    if args.cache_threshold is not None and not 0.0 <= args.cache_threshold <= 1.0:
        parser.error("--cache-threshold must be in [0, 1]")
    try:
        from models import make_model

        if args.model is not None:
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
        args.workload == "gsp"
        and args.capacity_tokens is not None
        and args.capacity_tokens <= max(args.gsp_lens) + args.output_len
    ):
        parser.error("--capacity-tokens must exceed the longest prompt plus --output-len")


def _check_capacity(
    args: argparse.Namespace, parser: argparse.ArgumentParser, workload: Workload
) -> None:
    largest = max((len(r.prompt) + r.max_new_tokens for r in workload), default=0)
    if args.capacity_tokens is not None and args.capacity_tokens < largest:
        parser.error(
            f"--capacity-tokens must be at least the longest prompt plus its output "
            f"({largest} tokens in this workload)"
        )


def _add_limits(rows: list[dict[str, Any]], workload: Workload) -> None:
    """``--ceiling``: the offline limits of sim.ceiling next to each row's hit rate."""
    limits = OfflineLimits(workload)
    ceiling = limits.ceiling().hit_rate
    bounds: dict[int, float] = {}
    for row in rows:
        row["ceiling_hit_rate"] = round(ceiling, 6)
        if row["workers"] == 1:
            capacity = int(row["capacity_tokens"])
            if capacity not in bounds:
                bounds[capacity] = limits.bound(capacity).hit_rate
            row["offline_bound_hit_rate"] = round(bounds[capacity], 6)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _validate(args, parser)
    workload = load_workload(args, parser)
    if args.workload not in ("gsp", "trace", "azure"):  # a trace's giants fail, counted
        _check_capacity(args, parser, workload)
    combos = list(itertools.product(args.policy, args.eviction))
    started = time.perf_counter()
    progress = not args.no_progress and sys.stderr.isatty()
    if args.jobs > 1 and len(combos) > 1:
        # The namespace carries its parser (for usage errors), which cannot be pickled; each
        # process builds its own copy of the workload.
        shipped = argparse.Namespace(**vars(args))
        vars(shipped).pop("command_parser", None)
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run_one, [shipped] * len(combos), *zip(*combos, strict=True)))
    else:
        rows = [run_one(args, policy, eviction, progress, workload) for policy, eviction in combos]
    if args.ceiling:
        _add_limits(rows, workload)
    wall = time.perf_counter() - started
    columns: list[tuple[str, str, str]] = list(TABLE_COLUMNS)
    if args.ceiling:
        columns.append(("ceiling", "ceiling_hit_rate", "{:.3f}"))
        if args.workers == 1:
            columns.append(("offline bound", "offline_bound_hit_rate", "{:.3f}"))
    print(markdown_table(rows, columns))
    what = ", ".join(f"{k} {v}" for k, v in describe_workload(args).items() if k != "workload")
    print(
        f"simulated {sum(r['requests'] for r in rows)} requests in {wall:.1f} s wall "
        f"({args.workload}: {what}; {args.workers} workers)",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"rows": rows}, sort_keys=True))
    return 0
