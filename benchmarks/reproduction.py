"""Regenerate REPRODUCTION.md from scratch: the paper's four benchmarks in the simulator.

Every table row is one ``kvroute sim`` command: this script parses the exact command line
shown on the page with kvroute's own parser and calls the same ``run_one`` the CLI calls, so
pasting a command into a shell reproduces its rows (the simulator is deterministic). Rows run
on ``--jobs`` processes (default 2); each process builds a workload once and reuses it.

Every row runs the paper's set-up (``PAPER``): prompts sent as text, so that the router
matches characters as sgl-router 0.4.6 and the paper's LBGR did (``sim.text``), and RLT's
matches marking only what they split, as the paper's code (``--rlt-marking split``); the
paper's LBGR is ``lbgr_paper``.

Parts:
1. four workers, each workload x {random, round_robin, power_of_two, cache_aware, lbgr_paper}
   x {lru, rlt},
   with the offline hit-rate ceiling (``sim.ceiling``); GSP also in its two other orders;
2. bands: the headline pair (cache_aware+lru, lbgr_paper+rlt) over seeds 0-4 and the service
   model's speed at 0.8x, 1x and 1.2x (``--worker-speeds``); GSP also with token matching;
   the same rows with the whole-path marking rule (seeds 0-4), to see what marking changes;
3. cache_aware's sensitivity on GSP (token matching, threshold 0.51, today's preset);
4. one worker, the eviction study: capacity sweeps (0.25x..2x of the reusable working set and
   the paper-default capacity) for GSP round_robin and the cyclic worst case, lru and rlt
   next to the offline upper bound and the ceiling; GSP round_robin again at 0.95x..1.25x of
   one round_robin pass (where LRU starts to hit), over the bands;
5. 1..10 workers on GSP: the headline pair over the bands (throughput: do gains vanish?);
6. every router on GSP with unlimited capacity (what routing alone keeps together);
7. the Mooncake trace's prefix structure (offline ceiling only).
Writes REPRODUCTION.md (from ``reproduction_template.md``, the page's prose, with the tables
and sentences filled in), PNGs under docs/figures/ and the figures in
results/reproduction.json;
``--from-json results/reproduction.json`` rewrites the page and figures from a finished run
without simulating again (after editing the page's text; the page keeps that run's time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, base_parser, metadata, write_json
from reproduction_plan import MOONCAKE, Scale, Task, available, parsed, plan, workload_of

from kvroute.sim_command import run_one
from sim.ceiling import OfflineLimits
from sim.workloads import load_mooncake

__all__ = ["Scale", "Task", "main", "plan", "run_task"]

NAME = "reproduction"


def run_task(task: Task) -> dict[str, Any]:
    argv = (*task.workload, *task.fleet)
    started = time.perf_counter()
    row = run_one(parsed(argv), task.policy, task.eviction, workload=workload_of(task.workload))
    row.update(table=task.table, wall_s=round(time.perf_counter() - started, 3), **dict(task.extra))
    return row


# -- offline limits ----------------------------------------------------------------------------


def limits(layout: dict[str, Any]) -> None:
    """Ceilings of every fleet table, bounds at every sweep capacity (in this process)."""
    for table in layout["fleet"].values():
        table["ceiling"] = OfflineLimits(workload_of(table["workload"])).ceiling().hit_rate
    for sweep in layout["sweeps"].values():
        offline = OfflineLimits(workload_of(sweep["workload"]))
        sweep["ceiling"] = offline.ceiling().hit_rate
        sweep["bounds"] = {c: offline.bound(c).hit_rate for c in sweep["capacities"]}
    workload_of.cache_clear()


def trace_limits(quick: bool) -> dict[str, Any] | None:
    path = available(MOONCAKE)
    if path is None:
        return None
    trace = load_mooncake(path, limit=500 if quick else None)
    seen: set[int] = set()
    hits = blocks = 0
    for ids in trace.hash_ids:
        for h in ids:
            blocks += 1
            hits += h in seen
            seen.add(h)
    ceiling = OfflineLimits(trace).ceiling()
    return {
        "path": str(path),
        "requests": len(trace),
        "prompt_tokens": ceiling.prompt_tokens,
        "block_hit_ratio": hits / blocks,
        "ceiling": ceiling.hit_rate,
        "reusable_tokens": ceiling.reusable_tokens,
        "command": f"kvroute sim --workload trace --trace {path} --workers 1 --ceiling",
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--page", type=Path, default=REPO_ROOT / "REPRODUCTION.md")
    parser.add_argument("--figures", type=Path, default=REPO_ROOT / "docs" / "figures")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="rewrite the page and figures from a previous run's JSON (no simulation; the "
        "page keeps that run's time)",
    )
    args = parser.parse_args(argv)
    for name in ("page", "figures", "out"):
        setattr(args, name, getattr(args, name).resolve())
    if args.from_json is not None:
        return rerender(args)
    os.chdir(REPO_ROOT)  # the commands name data files relative to the project root
    started = time.perf_counter()
    tasks, layout = plan(Scale(args.quick))
    print(f"{len(tasks)} simulations on {args.jobs} processes...", file=sys.stderr)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_task, tasks))
    sim_s = time.perf_counter() - started
    limits(layout)
    layout["trace"] = trace_limits(args.quick)
    wall_s = time.perf_counter() - started  # simulations and offline limits
    meta = metadata()
    timing = {
        "wall_s": round(wall_s, 1),
        "simulations_s": round(sim_s, 1),
        "jobs": args.jobs,
        "simulations": len(tasks),
        "date": meta["date"],
        "commit": meta["git_commit"],
        "dirty": meta["git_dirty"],
    }
    # The figures first, so a page that fails to render can be redone with --from-json.
    write_json(args.out, NAME, {"quick": args.quick, **timing, "layout": layout, "rows": rows})
    figures = publish(rows, layout, args, timing)
    print(f"{len(tasks)} simulations in {sim_s:.1f} s; everything in {wall_s:.1f} s")
    print(f"wrote {args.page}, {len(figures)} figures under {args.figures}, {args.out}")
    return 0


def publish(
    rows: list[dict[str, Any]],
    layout: dict[str, Any],
    args: argparse.Namespace,
    timing: dict[str, Any] | None,
    figures: dict[str, str] | None = None,
) -> dict[str, str]:
    """Draw the figures (unless given); with ``timing``, write the page too."""
    from reproduction_page import render
    from reproduction_plots import plot_all

    if figures is None:
        figures = plot_all(rows, layout, args.figures, REPO_ROOT)
    if timing is not None:
        args.page.write_text(render(rows, layout, figures, args, timing))
    return figures


def rerender(args: argparse.Namespace) -> int:
    """The page and figures again from a run's JSON (after editing the page's text)."""
    import json

    saved = json.loads(args.from_json.read_text())
    layout = saved["layout"]
    for sweep in layout["sweeps"].values():  # JSON turned the int keys into strings
        sweep["bounds"] = {int(k): v for k, v in sweep["bounds"].items()}
    args.quick = saved["quick"]
    timing = {k: saved[k] for k in ("wall_s", "simulations_s", "jobs")}
    timing["simulations"] = saved.get("simulations", len(saved["rows"]))  # one row a simulation
    meta = saved["metadata"]  # the run's own date and commit, not this rendering's
    timing.update(date=meta["date"], commit=meta["git_commit"], dirty=meta["git_dirty"])
    publish(saved["rows"], layout, args, timing)
    print(f"rewrote {args.page} and the figures from {args.from_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
