"""The plan of ``reproduction.py``: which ``kvroute sim`` rows to run, and their commands.

Every row is one command line (workload flags + fleet flags + one policy and eviction), parsed
with kvroute's own parser, so the page's commands reproduce its rows. The paper's set-up is on
every row (``fleet``): prompts sent as text, RLT's paper marking rule, workers that do not
refresh their waiting requests' prefixes (SGLang 0.4.6, the paper's engine), ``lbgr_paper``.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import REPO_ROOT
from reproduction_rows import BASELINE, EVICTIONS, MAIN_TABLES, OURS, POLICIES

from kvroute.cli import build_parser
from kvroute.sim_command import build_workload
from sim.ceiling import OfflineLimits
from sim.profiles import get_profile

PROFILE = "llama3.1-8b-l40"
DATA = REPO_ROOT.parent / "shared" / "data"
SHAREGPT = DATA / "mlenergy_ShareGPT_V3_filtered_1000.json"
LOOGLE = DATA / "loogle_longdep_qa.jsonl"
MOONCAKE = DATA / "mooncake_synthetic_trace.jsonl"
SWEEP_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)
# Capacities around one round_robin pass, where LRU goes from no hit to every hit.
PASS_FACTORS = (0.95, 0.98, 0.99, 0.995, 1.0, 1.0025, 1.005, 1.01, 1.05, 1.1, 1.25)
WORKER_COUNTS = tuple(range(1, 11))
SEEDS = (0, 1, 2, 3, 4)
SPEEDS = (0.8, 1.0, 1.2)  # the service model's speed: how close to saturation the fleet runs
# The one-pass study's tables, by the scheduler they run: SGLang 0.4.6's (the paper's, no
# waiting-queue refresh) and 0.5.23's, which refreshes its waiting requests' prefixes.
PASS_SCHEDULERS = (("pass", "off"), ("pass_refresh", "on"))


@dataclass(frozen=True, slots=True)
class Task:
    """One simulated row: ``kvroute sim WORKLOAD FLEET --policy P --eviction E``."""

    table: str
    workload: tuple[str, ...]
    fleet: tuple[str, ...]
    policy: str
    eviction: str
    extra: tuple[tuple[str, Any], ...] = ()


def command(workload: Sequence[str], fleet: Sequence[str], policies: str, evictions: str) -> str:
    return " ".join(
        ["kvroute sim", *workload, *fleet, "--policy", policies, "--eviction", evictions]
    )


@functools.cache
def parsed(argv: tuple[str, ...]) -> argparse.Namespace:
    args = build_parser().parse_args(["sim", *argv])
    vars(args).pop("command_parser", None)
    return args


@functools.cache
def workload_of(argv: tuple[str, ...]) -> Any:
    """Built once per process from the workload flags alone (fleet flags do not change it)."""
    return build_workload(parsed(argv))


@dataclass(frozen=True, slots=True)
class Scale:
    """Workload sizes and bands: the paper's (full) or a smoke-test cut (--quick)."""

    quick: bool

    @property
    def seeds(self) -> tuple[int, ...]:
        return (0, 1) if self.quick else SEEDS

    @property
    def speeds(self) -> tuple[float, ...]:
        return (1.0,) if self.quick else SPEEDS

    @property
    def pass_factors(self) -> tuple[float, ...]:
        return (0.99, 1.0, 1.01) if self.quick else PASS_FACTORS

    @property
    def worker_counts(self) -> tuple[int, ...]:
        return (1, 4, 6) if self.quick else WORKER_COUNTS

    def gsp(self, order: str) -> tuple[str, ...]:
        size = ("--gsp-groups", "32", "--gsp-prompts-per-group", "8") if self.quick else ()
        return ("--workload", "gsp", "--order", order, *size)

    def multiturn(self, dataset: Path | None) -> tuple[str, ...]:
        size = ("--clients", "16") if self.quick else ()
        data = ("--dataset", str(dataset)) if dataset is not None else ()
        return ("--workload", "multiturn", *size, *data)

    def longdoc(self, dataset: Path | None) -> tuple[str, ...]:
        size = ("--docs", "16") if self.quick and dataset is None else ()
        data = ("--dataset", str(dataset)) if dataset is not None else ()
        return ("--workload", "longdoc", "--order", "random", *size, *data)

    def cyclic(self) -> tuple[str, ...]:
        cycles = "2" if self.quick else "5"
        capacity = str(get_profile(PROFILE).kv_capacity_tokens)
        return (
            "--workload",
            "cyclic",
            "--cyclic-capacity",
            capacity,
            "--cyclic-cycles",
            cycles,
            "--rate",
            "2",
        )


def fleet(
    workers: int | str,
    speed: float | str = 1.0,
    prompt: str = "text",
    marking: str = "split",
    refresh: str = "off",
    capacity: int | str | None = None,
) -> tuple[str, ...]:
    """Fleet flags: workers, their KV capacity (``--capacity-tokens``, the profile's when
    None), the service model's speed (``--worker-speeds``, none at 1), what the client sends,
    RLT's marking rule and whether the workers refresh their waiting requests' prefixes (off:
    SGLang 0.4.6's scheduler, the paper's); a str is a placeholder in the commands shown."""
    flags = ["--workers", str(workers)]
    if capacity is not None:
        flags += ["--capacity-tokens", str(capacity)]
    if isinstance(speed, str):
        flags += ["--worker-speeds", f"{speed},...,{speed}"]
    elif speed != 1.0:
        flags += ["--worker-speeds", ",".join([f"{speed:g}"] * int(workers))]
    return (
        *flags,
        "--prompt-format",
        prompt,
        "--rlt-marking",
        marking,
        "--waiting-refresh",
        refresh,
    )


def seeded(argv: tuple[str, ...], seed: int | str) -> tuple[str, ...]:
    return argv if seed == 0 else (*argv, "--seed", str(seed))


def available(path: Path) -> Path | None:
    """The data file as the commands name it (relative to the project root), if present."""
    return Path(os.path.relpath(path, REPO_ROOT)) if path.is_file() else None


def fleet_tables(scale: Scale) -> dict[str, dict[str, Any]]:
    """Part 1: key -> {title, workload argv, note}."""
    sharegpt, loogle = available(SHAREGPT), available(LOOGLE)
    tables = {
        "gsp": ("GSP (random order)", scale.gsp("random")),
        "sharegpt": ("ShareGPT-like multi-turn", scale.multiturn(sharegpt)),
        "ultrachat": ("UltraChat-like multi-turn (synthetic)", scale.multiturn(None)),
        "loogle": ("LooGLE-like long documents (synthetic)", scale.longdoc(None)),
        "gsp_round_robin": ("GSP (round_robin order)", scale.gsp("round_robin")),
        "gsp_grouped": ("GSP (grouped order)", scale.gsp("grouped")),
    }
    if loogle is not None:
        tables["loogle_sample"] = ("LooGLE real sample (5 documents)", scale.longdoc(loogle))
    return {
        key: {"title": title, "workload": argv, "real_text": "--dataset" in argv}
        for key, (title, argv) in tables.items()
    }


def plan(scale: Scale) -> tuple[list[Task], dict[str, Any]]:
    tasks: list[Task] = []
    layout: dict[str, Any] = {"fleet": {}, "sweeps": {}, "seeds": scale.seeds}
    layout["speeds"] = scale.speeds
    for key, table in fleet_tables(scale).items():
        tasks += [Task(key, table["workload"], fleet(4), p, e) for p in POLICIES for e in EVICTIONS]
        layout["fleet"][key] = {
            **table,
            "command": command(table["workload"], fleet(4), " ".join(POLICIES), " ".join(EVICTIONS))
            + " --ceiling",
        }
    tasks += plan_bands(scale, layout)
    tasks += plan_sensitivity(scale, layout)
    tasks += plan_sweeps(scale, layout)
    tasks += plan_workers(scale, layout)
    tasks += plan_routing_ceiling(scale, layout)
    # Longest first, so the two processes finish together.
    tasks.sort(key=lambda t: (t.table.startswith("pass"), t.policy != "lbgr_paper"))
    return tasks, layout


def pair_command(argv: tuple[str, ...], fleet_argv: tuple[str, ...]) -> str:
    return " ; ".join(command(argv, fleet_argv, p, e) for p, e in (BASELINE, OURS))


def plan_bands(scale: Scale, layout: dict[str, Any]) -> list[Task]:
    """Part 2: the headline pair over seeds x speeds (GSP also with token matching), and the
    rlt side again with the whole-path marking rule (speed 1)."""
    tasks: list[Task] = []
    layout["bands"], layout["marking"] = {}, {}
    variants = [(key, key, "text") for key in MAIN_TABLES] + [("gsp_ids", "gsp", "ids")]
    for band, key, prompt in variants:
        argv = layout["fleet"][key]["workload"]
        for seed in scale.seeds:
            for speed in scale.speeds:
                extra = (("seed", seed), ("speed", speed))
                fleet_argv = fleet(4, speed, prompt)
                tasks += [
                    Task(f"band:{band}", seeded(argv, seed), fleet_argv, p, e, extra)
                    for p, e in (BASELINE, OURS)
                ]
        layout["bands"][band] = pair_command(seeded(argv, "S"), fleet(4, "X", prompt))
    for key in MAIN_TABLES:
        argv = layout["fleet"][key]["workload"]
        path = fleet(4, marking="path")
        tasks += [
            Task(f"marking:{key}", seeded(argv, seed), path, *OURS, (("seed", seed),))
            for seed in scale.seeds
        ]
        layout["marking"][key] = command(seeded(argv, "S"), path, *OURS)
    return tasks


def plan_sensitivity(scale: Scale, layout: dict[str, Any]) -> list[Task]:
    """Part 3: cache_aware on GSP, matched on tokens, at threshold 0.51, today's preset."""
    gsp = scale.gsp("random")
    variants = {
        "paper preset, token matching (ids)": (
            fleet(4, prompt="ids"),
            ("cache_aware", "lbgr_paper"),
        ),
        "threshold 0.51": ((*fleet(4), "--cache-threshold", "0.51"), ("cache_aware",)),
        "sglang preset (0.3 / 64 / 1.5)": (
            (*fleet(4), "--cache-aware-preset", "sglang"),
            ("cache_aware",),
        ),
    }
    tasks: list[Task] = []
    layout["sensitivity"] = {}
    for label, (flags, policies) in variants.items():
        tasks += [
            Task("sensitivity", gsp, flags, p, e, (("variant", label),))
            for p in policies
            for e in EVICTIONS
        ]
        layout["sensitivity"][label] = command(gsp, flags, " ".join(policies), "lru rlt")
    return tasks


def plan_sweeps(scale: Scale, layout: dict[str, Any]) -> list[Task]:
    """Part 4: one worker, capacity sweeps; GSP round_robin around one pass, over the bands."""
    tasks: list[Task] = []
    default = get_profile(PROFILE).kv_capacity_tokens
    for key, argv in (("gsp_round_robin", scale.gsp("round_robin")), ("cyclic", scale.cyclic())):
        working_set = reusable(argv)
        points = sorted({*(round(f * working_set) for f in SWEEP_FACTORS), default})
        for capacity in points:
            fleet_argv = fleet(1, capacity=capacity)
            extra = (
                ("capacity_factor", capacity / working_set),
                ("paper_default", capacity == default),
            )
            tasks += [
                Task(f"sweep:{key}", argv, fleet_argv, "round_robin", e, extra) for e in EVICTIONS
            ]
        layout["sweeps"][key] = {
            "workload": argv,
            "working_set": working_set,
            "cycle_tokens": first_pass_tokens(argv),
            "capacities": points,
            "command": command(
                argv,
                fleet(1, capacity="C"),
                "round_robin",
                "lru rlt",
            )
            + " --ceiling",
        }
    tasks += plan_pass(scale, layout)
    cyclic = scale.cyclic()
    for seed in scale.seeds:
        for speed in scale.speeds:
            flags = fleet(1, speed, capacity=default)
            extra = (("seed", seed), ("speed", speed))
            tasks += [
                Task("cyclic_band", seeded(cyclic, seed), flags, "round_robin", e, extra)
                for e in EVICTIONS
            ]
    layout["cyclic_band"] = command(
        seeded(cyclic, "S"),
        fleet(1, "X", capacity=default),
        "round_robin",
        "lru rlt",
    )
    return tasks


def plan_pass(scale: Scale, layout: dict[str, Any]) -> list[Task]:
    """GSP round_robin, one worker, at 0.95x..1.25x of each seed's round_robin pass."""
    tasks: list[Task] = []
    argv = scale.gsp("round_robin")
    passes = {seed: first_pass_tokens(seeded(argv, seed)) for seed in scale.seeds}
    for seed, one_pass in passes.items():
        for factor in scale.pass_factors:
            capacity = str(round(factor * one_pass))
            extra = (("seed", seed), ("pass_factor", factor), ("pass_tokens", one_pass))
            for speed in scale.speeds:
                for table, refresh in PASS_SCHEDULERS:
                    flags = fleet(1, speed, refresh=refresh, capacity=capacity)
                    tasks += [
                        Task(
                            table,
                            seeded(argv, seed),
                            flags,
                            "round_robin",
                            e,
                            (*extra, ("speed", speed)),
                        )
                        for e in EVICTIONS
                    ]
            if factor in (0.99, 1.0):  # the rlt side with the whole-path marking rule
                flags = fleet(1, marking="path", capacity=capacity)
                tasks.append(
                    Task("pass_marking", seeded(argv, seed), flags, "round_robin", "rlt", extra)
                )
    for table, refresh in PASS_SCHEDULERS:
        layout[table] = {
            "passes": passes,
            "factors": scale.pass_factors,
            "command": command(
                seeded(argv, "S"),
                fleet(1, "X", refresh=refresh, capacity="F x PASS"),
                "round_robin",
                "lru rlt",
            ),
        }
    return tasks


def plan_workers(scale: Scale, layout: dict[str, Any]) -> list[Task]:
    """Part 5: 1..10 workers on GSP, the headline pair over the bands."""
    gsp = scale.gsp("random")
    tasks: list[Task] = []
    for n in scale.worker_counts:
        for seed in scale.seeds:
            for speed in scale.speeds:
                extra = (("seed", seed), ("speed", speed))
                tasks += [
                    Task("workers", seeded(gsp, seed), fleet(n, speed), p, e, extra)
                    for p, e in (BASELINE, OURS)
                ]
    layout["workers"] = {
        "counts": scale.worker_counts,
        "command": pair_command(seeded(gsp, "S"), fleet("N", "X")),
    }
    return tasks


def plan_routing_ceiling(scale: Scale, layout: dict[str, Any]) -> list[Task]:
    """Part 6: GSP random on 4 workers, every router, each worker holding every token of the
    workload (nothing is evicted): what the routing alone keeps together."""
    gsp = scale.gsp("random")
    unlimited = sum(len(r.prompt) + r.max_new_tokens for r in workload_of(gsp))
    flags = fleet(4, capacity=unlimited)
    layout["routing_ceiling"] = {
        "capacity_tokens": unlimited,
        "command": command(gsp, flags, " ".join(POLICIES), "lru"),
    }
    return [Task("routing_ceiling", gsp, flags, p, "lru") for p in POLICIES]


def reusable(argv: tuple[str, ...]) -> int:
    """Tokens that can ever be reused (the sweep's unit): distinct tokens hit at unlimited room."""
    limit = OfflineLimits(workload_of(argv)).ceiling().reusable_tokens
    return int(limit or 0)


def first_pass_tokens(argv: tuple[str, ...]) -> int:
    """Tokens one pass over the groups puts in the tree (prompt + all output tokens but one):
    under LRU a shared prefix is only hit again if the capacity holds a whole pass."""
    args = parsed(argv)
    groups = args.gsp_groups if args.workload == "gsp" else len(workload_of(argv))
    items = list(workload_of(argv))
    if args.workload == "cyclic":
        groups = len({r.prompt for r in items})
    return sum(len(r.prompt) + r.max_new_tokens - 1 for r in items[:groups])
