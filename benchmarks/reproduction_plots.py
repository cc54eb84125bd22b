"""The PNG figures of REPRODUCTION.md (matplotlib, headless, small files)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from reproduction_rows import MAIN_TABLES, POLICIES, find, rows_in

COLORS = {"lru": "#d95f02", "rlt": "#1b9e77"}
DPI = 90


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fleet_bars(
    rows: Sequence[dict[str, Any]], layout: dict[str, Any], path: Path, hit: bool
) -> None:
    """p50 latency (log, p95 as ticks) or hit rate (with the ceiling) per workload."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    x = np.arange(len(POLICIES))
    for ax, table in zip(axes, MAIN_TABLES, strict=True):
        sub = rows_in(rows, table)
        for offset, ev in ((-0.2, "lru"), (0.2, "rlt")):
            picked = [find(sub, p, ev) for p in POLICIES]
            if hit:
                ax.bar(x + offset, [r["hit_rate"] for r in picked], 0.4, color=COLORS[ev], label=ev)
            else:
                ax.bar(
                    x + offset,
                    [r["p50_latency_s"] for r in picked],
                    0.4,
                    color=COLORS[ev],
                    label=f"{ev} p50",
                )
                ax.plot(
                    x + offset,
                    [r["p95_latency_s"] for r in picked],
                    "k_",
                    markersize=12,
                    label="p95" if ev == "rlt" else None,
                )
        if hit:
            ax.axhline(layout["fleet"][table]["ceiling"], color="k", ls="--", lw=1, label="ceiling")
            ax.set_ylim(0, 1)
        else:
            ax.set_yscale("log")
        ax.set_title(layout["fleet"][table]["title"], fontsize=9)
        ax.set_xticks(x, POLICIES, fontsize=8, rotation=20)
    axes[0].set_ylabel("cluster hit rate" if hit else "end-to-end latency (s)")
    axes[0].legend(fontsize=7)
    fig.suptitle("4 workers, llama3.1-8b-l40 profile, 12 req/s (simulated)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def sweeps(rows: Sequence[dict[str, Any]], layout: dict[str, Any], path: Path) -> None:
    plt = _plt()
    keys = list(layout["sweeps"])
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 3.8))
    titles = {"gsp_round_robin": "GSP, round_robin order", "cyclic": "cyclic (LRU's worst case)"}
    for ax, key in zip(np.atleast_1d(axes), keys, strict=True):
        sweep = layout["sweeps"][key]
        sub = rows_in(rows, f"sweep:{key}")
        caps = sweep["capacities"]
        factor = [c / sweep["working_set"] for c in caps]
        for ev in ("lru", "rlt"):
            by_cap = {r["capacity_tokens"]: r["hit_rate"] for r in sub if r["eviction"] == ev}
            ax.plot(factor, [by_cap[c] for c in caps], "o-", color=COLORS[ev], label=ev)
        ax.plot(
            factor,
            [sweep["bounds"][c] for c in caps],
            "s--",
            color="#7570b3",
            label="offline bound",
        )
        ax.axhline(sweep["ceiling"], color="k", ls=":", lw=1, label="ceiling (unlimited)")
        default = next(r["capacity_factor"] for r in sub if r["paper_default"])
        ax.axvline(default, color="grey", lw=1, ls="-.", label="paper-default capacity")
        ax.set_xlabel("capacity / reusable working set")
        ax.set_ylabel("hit rate (one worker)")
        ax.set_ylim(0, 1)
        ax.set_title(titles.get(key, key), fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    return float(np.median(values)), float(min(values)), float(max(values))


def workers(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Median and range over seeds x speeds of p50 latency and throughput, per fleet size."""
    plt = _plt()
    sub = rows_in(rows, "workers")
    counts = sorted({r["workers"] for r in sub})
    fig, (lat, rps) = plt.subplots(1, 2, figsize=(12, 3.8))
    pairs = ((("cache_aware", "lru"), "#d95f02"), (("lbgr_paper", "rlt"), "#1b9e77"))
    for (policy, ev), color in pairs:
        for ax, key in ((lat, "p50_latency_s"), (rps, "throughput_rps")):
            spread = [
                _spread(
                    [
                        r[key]
                        for r in sub
                        if r["workers"] == n and r["policy"] == policy and r["eviction"] == ev
                    ]
                )
                for n in counts
            ]
            mid, lo, hi = zip(*spread, strict=True)
            ax.plot(counts, mid, "o-", color=color, label=f"{policy}+{ev} (median)")
            ax.fill_between(counts, lo, hi, color=color, alpha=0.2)
    lat.set_yscale("log")
    lat.set_ylabel("p50 end-to-end latency (s)")
    rps.set_ylabel("throughput (completed req/s)")
    for ax in (lat, rps):
        ax.set_xlabel("workers")
        ax.set_xticks(counts)
        ax.legend(fontsize=7)
    fig.suptitle(
        "GSP, random order, 12 req/s: more workers (simulated; band: seeds x speeds)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def around_one_pass(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """One worker, GSP round_robin, capacities around one pass: hit rates and throughput."""
    plt = _plt()
    sub = rows_in(rows, "pass")
    factors = sorted({r["pass_factor"] for r in sub})
    fig, (hit, rps) = plt.subplots(1, 2, figsize=(12, 3.8))
    for ev in ("lru", "rlt"):
        for ax, key in ((hit, "hit_rate"), (rps, "throughput_rps")):
            spread = [
                _spread([r[key] for r in sub if r["pass_factor"] == f and r["eviction"] == ev])
                for f in factors
            ]
            mid, lo, hi = zip(*spread, strict=True)
            ax.plot(factors, mid, "o-", color=COLORS[ev], label=f"{ev} (median)")
            ax.fill_between(factors, lo, hi, color=COLORS[ev], alpha=0.2)
    hit.set_ylabel("hit rate (one worker)")
    rps.set_ylabel("throughput (completed req/s)")
    for ax in (hit, rps):
        ax.set_xlabel("capacity / tokens of one round_robin pass")
        ax.legend(fontsize=7)
    fig.suptitle("GSP round_robin, one worker, 12 req/s (band: seeds x speeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_all(
    rows: Sequence[dict[str, Any]], layout: dict[str, Any], folder: Path, root: Path
) -> dict[str, str]:
    """Write every figure; returns name -> path relative to ``root`` (for the page's links)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {
        "latency": folder / "reproduction_fleet_latency.png",
        "hit": folder / "reproduction_fleet_hit_rate.png",
        "sweep": folder / "reproduction_eviction_sweep.png",
        "workers": folder / "reproduction_workers.png",
        "pass": folder / "reproduction_one_pass.png",
    }
    fleet_bars(rows, layout, paths["latency"], hit=False)
    fleet_bars(rows, layout, paths["hit"], hit=True)
    sweeps(rows, layout, paths["sweep"])
    workers(rows, paths["workers"])
    around_one_pass(rows, paths["pass"])
    out = {}
    for name, path in paths.items():
        try:
            out[name] = str(path.resolve().relative_to(root.resolve()))
        except ValueError:
            out[name] = str(path)
    return out
