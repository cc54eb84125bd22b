"""REPRODUCTION.md: the headline figures with their bands and verdicts, then every table."""

from __future__ import annotations

import argparse
import os
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reproduction_bands import (
    CLOSE,
    PAPER,
    Band,
    max_band,
    pair_band,
    pass_max_band,
    pass_points,
    pct,
    vanish_verdict,
    verdict,
    workers_bands,
    x,
)
from reproduction_notes import capacity_note, headline_verdict, marking_note, strict_threshold
from reproduction_rows import MAIN_TABLES, Row
from reproduction_tables import (
    bands_section,
    fleet_section,
    pass_section,
    profile_table,
    routing_ceiling_section,
    sensitivity_section,
    sweep_section,
    trace_section,
    workers_section,
)


def _text(found: Band | None, fmt: Any) -> str:
    return "none" if found is None else found.text(fmt)


def refresh_note(rows: Sequence[Row]) -> str:
    """The one-pass study on SGLang 0.5.23's scheduler against 0.4.6's (``pass_refresh``)."""
    figures = []
    for table in ("pass", "pass_refresh"):
        points = pass_points(rows, table)
        zero = sum(p["lru_zero"] for p in points)
        total = sum(p["runs"] for p in points)
        hit, gain = pass_max_band(rows, "ratio", table), pass_max_band(rows, "throughput", table)
        figures.append((_text(hit, x), _text(gain, pct), f"{zero} of {total}"))
    (hit0, gain0, zero0), (hit1, gain1, zero1) = figures
    return (
        f"Per run, the largest rlt/lru where both hit: {hit1} on 0.5.23's scheduler, against "
        f"{hit0} on 0.4.6's (above); rlt's largest throughput gain over lru: {gain1} against "
        f"{gain0}; runs where lru hits nothing: {zero1} against {zero0}."
    )


# -- the headline table ------------------------------------------------------------------------
def claims(rows: Sequence[Row], layout: dict[str, Any]) -> list[dict[str, str]]:
    """One line per paper figure: its setting here, our band, the verdict and why."""
    out = []
    hit = pass_max_band(rows, "ratio")
    points = pass_points(rows)
    ahead = ", ".join(f"{p['factor']:g}" for p in points if p["ratio"] and p["ratio"].lo > 1)
    behind = [p for p in points if p["ratio"] and p["ratio"].hi < 1]
    zero = sum(p["lru_zero"] for p in points)
    total = sum(p["runs"] for p in points)
    why = (
        f"lru hits nothing in {zero} of {total} runs (below one pass: no ratio, not counted); "
        f"rlt/lru > 1 only at {ahead or 'no capacity'} x one pass"
    )
    if behind:
        why += (
            f"; from {behind[0]['factor']:g}x on lru keeps every prefix and rlt/lru is "
            f"{x(min(p['ratio'].lo for p in behind))}-{x(max(p['ratio'].hi for p in behind))}"
        )
    out.append(
        {
            "claim": "hit rate, rlt / lru, one worker, GSP round_robin",
            "paper": f"up to {PAPER['hit']}x",
            "setting": "one worker, capacity 0.95x-1.25x of one round_robin pass; per run the "
            "largest rlt/lru where both hit",
            "band": _text(hit, x),
            "verdict": verdict(PAPER["hit"], hit),
            "why": why,
        }
    )
    for key, label in (("p50", "p50 latency"), ("ttft", "p50 TTFT")):
        found = max_band(rows, [f"band:{k}" for k in MAIN_TABLES], key)
        out.append(
            {
                "claim": f"{label}, cache_aware+lru / lbgr_paper+rlt, 4 workers",
                "paper": f"up to {PAPER[key]}x",
                "setting": "the largest of the four workloads, per run",
                "band": _text(found, x),
                "verdict": verdict(PAPER[key], found),
                "why": f"per workload: section 2; {fleet_sizes(rows, key)}",
            }
        )
    out.append(throughput_claim(rows))
    out.append(vanish_claim(rows))
    return out


def fleet_sizes(rows: Sequence[Row], key: str) -> str:
    """Where the ratio gets largest over the fleet-size study (GSP, 1..10 workers)."""
    sub = [r for r in rows if r["table"] == "workers"]
    best: tuple[float, int] | None = None
    for n in sorted({r["workers"] for r in sub}):
        found = pair_band([dict(r, table="n") for r in sub if r["workers"] == n], "n", key)
        if found is not None and (best is None or found.hi > best[0]):
            best = (found.hi, n)
    if best is None:
        return "no fleet-size study"
    return f"GSP at 1..10 workers reaches {x(best[0])} (at {best[1]} workers)"


def throughput_claim(rows: Sequence[Row]) -> dict[str, str]:
    """+77.4% against the one-worker eviction study (the saturated setting); the 4-worker
    fleet's gain is given for contrast."""
    found = pass_max_band(rows, "throughput")
    fleet = max_band(rows, [f"band:{k}" for k in MAIN_TABLES], "throughput")
    return {
        "claim": "throughput, rlt vs lru (one worker, GSP round_robin)",
        "paper": f"up to +{PAPER['throughput']:.1%}",
        "setting": "one worker, capacity 0.95x-1.25x of one pass; per run the largest gain",
        "band": _text(found, pct),
        "verdict": verdict(1 + PAPER["throughput"], found),
        "why": "the paper's setting is inferred (*Where we differ*, 9); for contrast, the "
        f"4-worker fleet at 12 req/s: lbgr_paper+rlt vs cache_aware+lru {_text(fleet, pct)} "
        "(largest of the four workloads per run; a gain only where cache_aware+lru falls "
        "behind the arrivals)",
    }


def vanish_claim(rows: Sequence[Row]) -> dict[str, str]:
    table = workers_bands(rows)
    result, why = vanish_verdict(table)
    gains = "; ".join(
        f"{r['workers']}: {pct(r['throughput'].lo)} to {pct(r['throughput'].hi)}"
        for r in table
        if r["throughput"] is not None
    )
    return {
        "claim": "gains vanish with >= 6 workers (throughput)",
        "paper": "yes",
        "setting": "GSP, 1..10 workers, lbgr_paper+rlt vs cache_aware+lru throughput",
        "band": gains,
        "verdict": result,
        "why": why,
    }


def headline(rows: Sequence[Row], layout: dict[str, Any]) -> str:
    lines = [
        "| paper figure | paper | our setting | our band | verdict | why |",
        "|---|---|---|---|---|---|",
    ]
    for c in claims(rows, layout):
        lines.append(
            f"| {c['claim']} | {c['paper']} | {c['setting']} | {c['band']} | "
            f"**{c['verdict']}** | {c['why']} |"
        )
    cyclic = cyclic_text(rows)
    lines.append(
        f"| (worst case, no paper figure) cyclic, one pass = 1.1x the capacity, one worker | "
        f"- | paper-default capacity | {cyclic} | worst case | LRU hits nothing by "
        "construction, so there is no ratio to compare with 6.92x |"
    )
    return "\n".join(lines)


def cyclic_text(rows: Sequence[Row]) -> str:
    sub = [r for r in rows if r["table"] == "cyclic_band"]
    lru = [r["hit_rate"] for r in sub if r["eviction"] == "lru"]
    rlt = Band(tuple(r["hit_rate"] for r in sub if r["eviction"] == "rlt"))
    return (
        f"lru {min(lru):.3f}-{max(lru):.3f}, rlt {rlt.text(lambda v: f'{v:.3f}')}"
        if lru
        else "not run"
    )


TEMPLATE = Path(__file__).with_name("reproduction_template.md")


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def render(
    rows: Sequence[Row],
    layout: dict[str, Any],
    figures: dict[str, str],
    args: argparse.Namespace,
    timing: dict[str, Any],
) -> str:
    """The page: ``reproduction_template.md`` with the run's tables and sentences."""
    commit = (timing["commit"] or "unknown")[:10] + (" (dirty tree)" if timing["dirty"] else "")
    quick = (
        "\n> **--quick run: workloads cut down for a smoke test; not the page's real figures.**\n"
        if args.quick
        else ""
    )
    values = {
        "quick": quick,
        "jobs": timing["jobs"],
        "duration": duration(timing["wall_s"]),
        "cores": os.cpu_count(),
        "simulations": timing["simulations"],
        "date": timing["date"],
        "commit": commit,
        "headline": headline(rows, layout),
        "close": CLOSE,
        "headline_verdict": headline_verdict(rows, layout),
        "profile_table": profile_table(),
        "fleet_sections": "\n".join(fleet_section(rows, layout, k) for k in layout["fleet"]),
        "bands_section": bands_section(rows, layout),
        "marking_note": marking_note(rows, layout),
        "sensitivity_section": sensitivity_section(rows, layout),
        "sweep_gsp": sweep_section(rows, layout, "gsp_round_robin"),
        "pass_section": pass_section(rows, layout),
        "pass_refresh_section": pass_section(rows, layout, "pass_refresh"),
        "refresh_note": refresh_note(rows),
        "sweep_cyclic": sweep_section(rows, layout, "cyclic"),
        "workers_section": workers_section(rows, layout),
        "routing_ceiling_section": routing_ceiling_section(rows, layout),
        "trace_section": trace_section(layout),
        "capacity_note": capacity_note(layout),
        "strict_threshold": strict_threshold(rows),
        **{f"figure_{name}": path for name, path in figures.items()},
    }
    page = string.Template(TEMPLATE.read_text()).substitute(values)
    return re.sub(r"\n{3,}", "\n\n", page)  # sections end in a blank line of their own
