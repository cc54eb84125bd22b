"""Residual latency models under ``lbgr`` + ``rlt`` on fleets where the constant service
estimate is wrong, and what a model costs per routing decision.

Latency. 4 workers, profile ``llama3.1-8b-l40``, GSP (128 groups x 32 prompts, random order):

a. heterogeneous: worker 0 at half speed (``worker_speeds=(0.5, 1, 1, 1)``), 10 req/s;
b. drift: worker 0 slows 2x halfway (``speed_changes=((0, T/2, 0.5),)``, T = the last
   arrival in s), 10 req/s;
c. the paper's homogeneous fleet, 12 req/s.

(a) and (b) run at 10 req/s because at 12 req/s a half-speed worker leaves the fleet with
3.5 workers' worth of capacity for about 3.6 workers' worth of work (~103% utilisation): every
policy then queues without bound and p95 only measures how long the run is. Models: ``none``,
``ewmean`` (the paper's), ``ratio`` (latency as a learned multiple of the router's estimate),
``linear`` and ``tree``, the last two both per worker (one model per worker, the paper's
layout) and shared (one model, the worker as a one-hot feature). Every cell
runs several seeds (the seed changes the workload and the fleet's RNG); the tables give the
mean over seeds and the spread (min-max) of p95. MAE is the champion's rolling MAE of the
residual (ms, the last 256 outcomes per worker) at the end of the run.

Target: on (a) and (b) the best learned model cuts mean p95 by >= 20% vs ``ewmean``; on (c)
it is no worse than ``ewmean``: a mean at or below ``ewmean``'s, or a paired difference (same
seed, i.e. same workload and fleet) within two standard errors of zero, since two models that
route alike differ by seed noise either way. Two tables answer it: the best learned model of
each fleet, and each learned model on all three fleets (a user picks one model without knowing
the fleet).

Cost. Per routing decision on 8 workers: 8 ``ModelBank.predict`` calls on feature dicts built
by ``router_service.routing.features.residual_features`` (built beforehand, not timed), plus one
``ModelBank.learn``; median over many decisions after a warm-up, the lowest of 3 interleaved
rounds (noise on this shared machine only adds time). Target <= 50 us for ``ewmean`` and
``linear``.
"""

from __future__ import annotations

import functools
import gc
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from _common import base_parser, write_json

from models import ModelBank
from router_service.routing import RouteRequest, WorkerSnapshot, residual_features
from sim.cluster import ClusterConfig, simulate
from sim.report import markdown_table, summarize
from sim.workloads import GSPConfig, GSPWorkload

NAME = "residual_models"
PROFILE = "llama3.1-8b-l40"
WORKERS = 4
P95_CUT_TARGET = 0.20  # (a), (b): best learned model's mean p95 <= 0.8 x ewmean's
COST_TARGET_US = 50.0
COST_TARGET_KINDS = ("ewmean", "linear")
COST_WORKERS = 8

# (label, kind, sharing)
MODELS: tuple[tuple[str, str, str], ...] = (
    ("none", "none", "per_worker"),
    ("ewmean", "ewmean", "per_worker"),
    ("ratio", "ratio", "per_worker"),
    ("linear", "linear", "per_worker"),
    ("tree", "tree", "per_worker"),
    ("linear (shared)", "linear", "shared"),
    ("tree (shared)", "tree", "shared"),
)
LEARNED = ("ratio", "linear", "tree", "linear (shared)", "tree (shared)")


@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    title: str
    rate: float
    worker_speeds: tuple[float, ...] | None = None
    slow_at_half: bool = False  # worker 0 drops to half speed at T/2
    target: str = "cut"  # "cut": >= 20% lower p95 than ewmean; "no_worse": <= ewmean's


SCENARIOS = (
    Scenario("a", "heterogeneous: worker 0 at half speed", 10.0, worker_speeds=(0.5, 1, 1, 1)),
    Scenario("b", "drift: worker 0 slows 2x at T/2", 10.0, slow_at_half=True),
    Scenario("c", "homogeneous (the paper's GSP)", 12.0, target="no_worse"),
)


@dataclass(frozen=True, slots=True)
class Cell:
    scenario: Scenario
    label: str
    kind: str
    sharing: str
    seed: int
    quick: bool = field(default=False)


# -- latency -----------------------------------------------------------------------------------
@functools.cache
def _workload(rate: float, seed: int, quick: bool) -> GSPWorkload:
    """Generated once per process and shared by every cell on the same workload."""
    if quick:
        return GSPWorkload(
            GSPConfig(num_groups=32, prompts_per_group=8, order="random", rate=rate, seed=seed)
        )
    return GSPWorkload(GSPConfig(order="random", rate=rate, seed=seed))


def cluster_config(cell: Cell, workload: GSPWorkload) -> ClusterConfig:
    scenario = cell.scenario
    last_arrival_s = max(r.arrival_ms for r in workload) / 1000.0
    changes = ((0, last_arrival_s / 2.0, 0.5),) if scenario.slow_at_half else ()
    return ClusterConfig(
        workers=WORKERS,
        policy="lbgr",
        policy_params={"model": cell.kind, "sharing": cell.sharing},
        eviction="rlt",
        profile=PROFILE,
        worker_speeds=scenario.worker_speeds,
        speed_changes=changes,
        seed=cell.seed,
    )


def run_cell(cell: Cell) -> dict[str, Any]:
    """One simulation: the run's summary, the model's MAE and worker 0's share."""
    workload = _workload(cell.scenario.rate, cell.seed, cell.quick)
    config = cluster_config(cell, workload)
    started = time.perf_counter()
    run = simulate(config, workload)
    wall_s = time.perf_counter() - started
    summary = summarize(run)
    slot = run.router.policy.models
    if slot is None:
        raise RuntimeError(f"policy {config.policy!r} has no residual models")
    champion = slot.champion
    per_worker = summary.pop("per_worker")
    return {
        "scenario": cell.scenario.key,
        "label": cell.label,
        "kind": cell.kind,
        "sharing": cell.sharing,
        "seed": cell.seed,
        "rate": cell.scenario.rate,
        "speed_changes": [list(c) for c in config.speed_changes],
        "worker_speeds": list(config.worker_speeds) if config.worker_speeds else None,
        "mae_ms": champion.mae(),
        "model_failures": champion.failures,
        "worker0_share": per_worker[0]["requests"] / max(1, summary["requests"]),
        "per_worker_requests": [w["requests"] for w in per_worker],
        "wall_s": round(wall_s, 3),
        **{k: summary[k] for k in ("requests", "completed", "failed", "hit_rate")},
        **{k: summary[k] for k in ("p50_latency_s", "p95_latency_s", "p99_latency_s")},
        "mean_latency_s": summary["mean_latency_s"],
    }


def aggregate(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (scenario, model): means over seeds, p95's min and max."""
    cells: list[dict[str, Any]] = []
    for scenario in SCENARIOS:
        for label, kind, sharing in MODELS:
            mine = [r for r in runs if r["scenario"] == scenario.key and r["label"] == label]
            if not mine:
                continue
            p95 = [r["p95_latency_s"] for r in mine]
            maes = [r["mae_ms"] for r in mine if r["mae_ms"] is not None]
            cells.append(
                {
                    "scenario": scenario.key,
                    "label": label,
                    "kind": kind,
                    "sharing": sharing,
                    "seeds": [r["seed"] for r in mine],
                    "p50_latency_s": statistics.fmean(r["p50_latency_s"] for r in mine),
                    "p95_latency_s": statistics.fmean(p95),
                    "p95_min_s": min(p95),
                    "p95_max_s": max(p95),
                    "p95_spread": f"{min(p95):.2f}-{max(p95):.2f}",
                    "hit_rate": statistics.fmean(r["hit_rate"] for r in mine),
                    "mae_ms": statistics.fmean(maes) if maes else None,
                    "worker0_share": statistics.fmean(r["worker0_share"] for r in mine),
                    "failed": sum(r["failed"] for r in mine),
                }
            )
    return cells


def paired_difference(
    runs: Sequence[dict[str, Any]], scenario: str, label: str
) -> tuple[float, float | None]:
    """Mean over seeds of (label's p95 - ewmean's p95) on the same seed, and its standard
    error (None with one seed). The same seed is the same workload and fleet, so the pairing
    removes most of the seed-to-seed spread."""
    p95 = {(r["label"], r["seed"]): r["p95_latency_s"] for r in runs if r["scenario"] == scenario}
    diffs = [p95[(label, seed)] - p95[("ewmean", seed)] for (lab, seed) in p95 if lab == label]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return statistics.fmean(diffs), se


def judge(scenario: Scenario, change: float, diff: float, se: float | None) -> tuple[str, str]:
    """(goal text, met text). "No worse" is met by a mean at or below ewmean's, or by a paired
    difference within two standard errors of zero (indistinguishable from ewmean)."""
    if scenario.target == "cut":
        return f"<= -{P95_CUT_TARGET:.0%}", "yes" if change <= -P95_CUT_TARGET else "no"
    if change <= 0.0:
        return "<= +0%", "yes"
    if se is not None and diff <= 2.0 * se:
        return "<= +0%", "yes (within noise)"
    return "<= +0%", "no"


def paired_text(diff: float, se: float | None) -> str:
    return f"{diff:+.2f}" + (f" +- {se:.2f}" if se is not None else "")


def targets(
    cells: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per scenario: ewmean's mean p95 against the best learned model's."""
    out = []
    for scenario in SCENARIOS:
        mine = {c["label"]: c for c in cells if c["scenario"] == scenario.key}
        ewmean = mine["ewmean"]["p95_latency_s"]
        best = min((mine[label] for label in LEARNED), key=lambda c: c["p95_latency_s"])
        change = best["p95_latency_s"] / ewmean - 1.0
        diff, se = paired_difference(runs, scenario.key, best["label"])
        goal, met = judge(scenario, change, diff, se)
        out.append(
            {
                "scenario": scenario.key,
                "ewmean_p95_s": ewmean,
                "best_learned": best["label"],
                "best_p95_s": best["p95_latency_s"],
                "p95_change": change,
                "p95_change_text": f"{change:+.1%}",
                "paired_diff_s": diff,
                "paired_se_s": se,
                "paired_text": paired_text(diff, se),
                "target": goal,
                "met": met,
            }
        )
    return out


def every_fleet_rows(
    cells: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per learned model: its mean p95 change vs ewmean on every fleet, and whether one model
    meets all three targets."""
    by = {(c["scenario"], c["label"]): c for c in cells}
    out = []
    for label in LEARNED:
        row: dict[str, Any] = {"label": label}
        met = True
        for scenario in SCENARIOS:
            change = (
                by[(scenario.key, label)]["p95_latency_s"]
                / by[(scenario.key, "ewmean")]["p95_latency_s"]
                - 1.0
            )
            diff, se = paired_difference(runs, scenario.key, label)
            verdict = judge(scenario, change, diff, se)[1]
            row[f"{scenario.key}_change"] = change
            row[f"{scenario.key}_paired_diff_s"] = diff
            row[f"{scenario.key}_paired_se_s"] = se
            row[f"{scenario.key}_change_text"] = f"{change:+.1%} ({paired_text(diff, se)} s)"
            met = met and verdict.startswith("yes")
        row["all_met"] = "yes" if met else "no"
        out.append(row)
    return out


def sharing_rows(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario and learner: per-worker against shared, mean p95 and MAE."""
    out = []
    for scenario in SCENARIOS:
        mine = {c["label"]: c for c in cells if c["scenario"] == scenario.key}
        for kind in ("linear", "tree"):
            own, shared = mine[kind], mine[f"{kind} (shared)"]
            out.append(
                {
                    "scenario": scenario.key,
                    "kind": kind,
                    "per_worker_p95_s": own["p95_latency_s"],
                    "shared_p95_s": shared["p95_latency_s"],
                    "per_worker_mae_ms": own["mae_ms"],
                    "shared_mae_ms": shared["mae_ms"],
                    "lower_p95": (
                        "per_worker"
                        if own["p95_latency_s"] <= shared["p95_latency_s"]
                        else "shared"
                    ),
                }
            )
    return out


# -- cost --------------------------------------------------------------------------------------
def decision_inputs(rng: random.Random, n: int) -> list[tuple[list[dict[str, float]], float]]:
    """``n`` decisions: a feature dict per worker (from ``residual_features``), a residual."""
    out = []
    for i in range(n):
        units = rng.choice((512, 1024, 2048, 4096, 8192))
        request = RouteRequest(f"r{i}", "x" * units, prompt_tokens=units, max_new_tokens=4)
        features = []
        for w in range(COST_WORKERS):
            cached = rng.choice((0, units // 2, units - 1))
            snapshot = WorkerSnapshot(
                url=f"w{w}",
                healthy=True,
                reason=None,
                queue_ms=rng.uniform(0.0, 20_000.0),
                in_flight=rng.randint(0, 30),
                cached=cached,
                index_units=rng.randint(0, 2_000_000),
                pending_units=rng.randint(0, 100_000),
            )
            estimate = max(1.0, float(units - cached)) + snapshot.queue_ms  # lbgr's defaults
            features.append(residual_features(request, snapshot, estimate))
        out.append((features, max(1.0, rng.lognormvariate(5.0, 1.2))))
    return out


def time_model(kind: str, sharing: str, warm_up: int, decisions: int) -> dict[str, Any]:
    """Median microseconds of 8 predicts, 1 learn and both, per decision, after a warm-up."""
    rng = random.Random(0)
    bank = ModelBank(kind, sharing=sharing)
    urls = [f"w{w}" for w in range(COST_WORKERS)]
    inputs = decision_inputs(rng, warm_up + decisions)
    predict_ns: list[int] = []
    learn_ns: list[int] = []
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()  # a collection inside one timed decision says nothing about the model
    try:
        for i, (features, y) in enumerate(inputs):
            t0 = clock()
            for url, x in zip(urls, features, strict=True):
                bank.predict(url, x)
            t1 = clock()
            chosen = i % COST_WORKERS
            bank.learn(urls[chosen], features[chosen], y)
            t2 = clock()
            if i >= warm_up:
                predict_ns.append(t1 - t0)
                learn_ns.append(t2 - t1)
    finally:
        gc.enable()
    total = [p + q for p, q in zip(predict_ns, learn_ns, strict=True)]
    median_us = statistics.median(total) / 1000.0
    checked = kind in COST_TARGET_KINDS
    return {
        "kind": kind,
        "sharing": sharing,
        "decisions": decisions,
        "warm_up": warm_up,
        "predict8_us": statistics.median(predict_ns) / 1000.0,
        "learn_us": statistics.median(learn_ns) / 1000.0,
        "total_us": median_us,
        "p95_total_us": statistics.quantiles(total, n=20)[-1] / 1000.0,
        "target": f"<= {COST_TARGET_US:g}" if checked else "-",
        "met": ("yes" if median_us <= COST_TARGET_US else "no") if checked else "-",
    }


def cost_rows(quick: bool) -> list[dict[str, Any]]:
    """Each model timed in ``rounds`` interleaved rounds; the round with the lowest median is
    kept (this machine is shared: its noise only ever adds time), all medians are recorded."""
    warm_up, decisions = (200, 500) if quick else (1000, 5000)
    rounds = 1 if quick else 3
    best: dict[tuple[str, str], dict[str, Any]] = {}
    medians: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for _, kind, sharing in MODELS:
            count = decisions if kind != "tree" else decisions // 2
            row = time_model(kind, sharing, warm_up, count)
            key = (kind, sharing)
            medians.setdefault(key, []).append(row["total_us"])
            if key not in best or row["total_us"] < best[key]["total_us"]:
                best[key] = row
    return [{**row, "round_medians_us": medians[key]} for key, row in best.items()]


# -- tables ------------------------------------------------------------------------------------
CELL_COLUMNS = (
    ("model", "label", "{}"),
    ("p50 lat (s)", "p50_latency_s", "{:.2f}"),
    ("p95 lat (s)", "p95_latency_s", "{:.2f}"),
    ("p95 min-max (s)", "p95_spread", "{}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("MAE (ms)", "mae_ms", "{:.0f}"),
    ("worker 0 share", "worker0_share", "{:.3f}"),
    ("failed", "failed", "{}"),
)
TARGET_COLUMNS = (
    ("fleet", "scenario", "{}"),
    ("ewmean p95 (s)", "ewmean_p95_s", "{:.2f}"),
    ("best learned", "best_learned", "{}"),
    ("its p95 (s)", "best_p95_s", "{:.2f}"),
    ("change", "p95_change_text", "{}"),
    ("paired diff (s)", "paired_text", "{}"),
    ("target", "target", "{}"),
    ("met", "met", "{}"),
)
EVERY_FLEET_COLUMNS = (
    ("model", "label", "{}"),
    *((f"{s.key}: p95 vs ewmean", f"{s.key}_change_text", "{}") for s in SCENARIOS),
    ("all three targets", "all_met", "{}"),
)
SHARING_COLUMNS = (
    ("fleet", "scenario", "{}"),
    ("learner", "kind", "{}"),
    ("per-worker p95 (s)", "per_worker_p95_s", "{:.2f}"),
    ("shared p95 (s)", "shared_p95_s", "{:.2f}"),
    ("per-worker MAE (ms)", "per_worker_mae_ms", "{:.0f}"),
    ("shared MAE (ms)", "shared_mae_ms", "{:.0f}"),
    ("lower p95", "lower_p95", "{}"),
)
COST_COLUMNS = (
    ("kind", "kind", "{}"),
    ("sharing", "sharing", "{}"),
    ("8 predicts (us)", "predict8_us", "{:.1f}"),
    ("1 learn (us)", "learn_us", "{:.1f}"),
    ("per decision (us)", "total_us", "{:.1f}"),
    ("p95 per decision (us)", "p95_total_us", "{:.1f}"),
    ("target (us)", "target", "{}"),
    ("met", "met", "{}"),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__)
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--seeds", type=int, default=10, help="seeds per cell (default 10)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    started = time.perf_counter()
    costs = cost_rows(args.quick)  # first, alone: the simulations would compete for the CPU
    grid = [
        Cell(scenario, label, kind, sharing, seed, args.quick)
        for scenario in SCENARIOS
        for seed in range(args.seeds)
        for label, kind, sharing in MODELS
    ]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(run_cell, grid))
    cells = aggregate(runs)
    goals = targets(cells, runs)
    every_fleet = every_fleet_rows(cells, runs)
    sharing = sharing_rows(cells)
    wall_s = time.perf_counter() - started

    scale = "32 groups x 8 prompts (--quick)" if args.quick else "128 groups x 32 prompts"
    print(f"## Residual models under lbgr+rlt (simulated, {PROFILE}, GSP {scale})\n")
    print(
        f"{WORKERS} workers, GSP random order, seeds 0..{args.seeds - 1} per cell (the seed "
        "changes the workload and the fleet); means over seeds, p95 spread min-max. Rates: "
        "10 req/s for (a) and (b), 12 req/s for (c): with a half-speed worker 12 req/s is "
        "~103% of the fleet's capacity and every policy queues without bound. MAE: rolling "
        "MAE of the residual (ms, last 256 outcomes per worker) at the end of the run.\n"
    )
    for scenario in SCENARIOS:
        rows = [c for c in cells if c["scenario"] == scenario.key]
        print(f"### {scenario.key}. {scenario.title}, {scenario.rate:g} req/s\n")
        print(markdown_table(rows, CELL_COLUMNS) + "\n")
    print("### Target: best learned model of each fleet vs ewmean, mean p95\n")
    print(markdown_table(goals, TARGET_COLUMNS) + "\n")
    print(
        "Paired diff: mean over seeds of (model's p95 - ewmean's p95) on the same seed, "
        "+- its standard error. A no-worse target is met by a mean change <= 0, or by a paired "
        "diff within 2 standard errors of 0 (indistinguishable from ewmean).\n"
    )
    print("### One model on every fleet: mean p95 vs ewmean (targets -20%, -20%, +0%)\n")
    print(markdown_table(every_fleet, EVERY_FLEET_COLUMNS) + "\n")
    print("### Per-worker vs shared models (mean over seeds)\n")
    print(markdown_table(sharing, SHARING_COLUMNS) + "\n")
    print(
        f"### Cost per routing decision, {COST_WORKERS} workers: "
        f"{COST_WORKERS} predicts + 1 learn (median; best of 3 interleaved rounds)\n"
    )
    print(markdown_table(costs, COST_COLUMNS) + "\n")
    print(f"{len(grid)} simulations in {wall_s:.1f} s wall ({args.jobs} processes)")

    path = write_json(
        args.out,
        NAME,
        {
            "quick": args.quick,
            "profile": PROFILE,
            "workers": WORKERS,
            "seeds": args.seeds,
            "scenarios": [
                {
                    "key": s.key,
                    "title": s.title,
                    "rate": s.rate,
                    "worker_speeds": list(s.worker_speeds) if s.worker_speeds else None,
                    "slow_at_half": s.slow_at_half,
                    "target": s.target,
                }
                for s in SCENARIOS
            ],
            "wall_s": round(wall_s, 3),
            "cells": cells,
            "targets": goals,
            "every_fleet": every_fleet,
            "sharing": sharing,
            "cost": {"workers": COST_WORKERS, "rows": costs},
            "runs": runs,
        },
    )
    sys.stdout.flush()
    print(f"figures written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
