"""Bands and verdicts for REPRODUCTION.md: each headline figure over seeds x service speeds.

A single simulated run is one draw: the seed decides the prompts and arrivals, and the
service model's speed (0.8x, 1x, 1.2x) decides how close to saturation the fleet runs, which
decides most ratios. So every headline figure is a *band*: its values over seeds 0-4 and the
three speeds (15 runs). The paper's figure is then judged against the band (``verdict``):

- ``reproduced``: inside the band, and the band's median within a factor ``CLOSE`` of it;
- ``inside band``: inside the band, but the median is further off (some runs reach it, a
  typical run does not);
- ``not reproduced``: outside the band.

A ratio is only formed where both sides are positive (``ratio_of``): a hit-rate ratio over an
LRU that hit nothing is not a number, and is neither counted nor shown as one.

>>> verdict(6.92, Band((5.0, 6.5, 7.1)))
'reproduced'
>>> verdict(11.96, Band((1.2, 2.0, 12.5)))
'inside band'
>>> verdict(11.96, Band((1.2, 2.0))), verdict(6.92, None)
('not reproduced', 'not reproduced')
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from reproduction_rows import BASELINE, OURS, Row, find

__all__ = [
    "CLOSE",
    "PAPER",
    "Band",
    "pair_band",
    "pair_values",
    "pass_points",
    "ratio_of",
    "verdict",
    "workers_bands",
]

PAPER = {"hit": 6.92, "p50": 11.96, "ttft": 14.06, "throughput": 0.774}
CLOSE = 1.25
VANISH = 0.01  # a throughput gain within +-1% is no gain (run-to-run noise at a fixed rate)


@dataclass(frozen=True, slots=True)
class Band:
    """Values of one figure over the runs of a band (one per seed x speed)."""

    values: tuple[float, ...]

    @property
    def lo(self) -> float:
        return min(self.values)

    @property
    def hi(self) -> float:
        return max(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def text(self, fmt: Callable[[float], str]) -> str:
        """``a-b (median m, n runs)``."""
        n = len(self.values)
        if n == 1:
            return f"{fmt(self.lo)} (1 run)"
        return f"{fmt(self.lo)} to {fmt(self.hi)} (median {fmt(self.median)}, {n} runs)"


def band(values: Iterable[float | None]) -> Band | None:
    kept = tuple(v for v in values if v is not None)
    return Band(kept) if kept else None


def verdict(paper: float, found: Band | None) -> str:
    """The paper's figure against our band (module docstring)."""
    if found is None or not found.lo <= paper <= found.hi:
        return "not reproduced"
    return "reproduced" if 1 / CLOSE <= found.median / paper <= CLOSE else "inside band"


def ratio_of(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator`` where both are positive; else None (no ratio)."""
    if numerator <= 0 or denominator <= 0:
        return None
    return numerator / denominator


def x(value: float) -> str:
    return f"{value:.2f}x"


def pct(factor: float) -> str:
    """A throughput factor as a gain: 1.66 -> ``+66.0%``."""
    return f"{factor - 1:+.1%}"


# -- the headline pair over a band -------------------------------------------------------------
def pair_values(rows: Sequence[Row], table: str) -> dict[tuple[int, float], tuple[Row, Row]]:
    """(seed, speed) -> (cache_aware+lru, lbgr_paper+rlt) rows of one band table."""
    out: dict[tuple[int, float], tuple[Row, Row]] = {}
    sub = [r for r in rows if r["table"] == table]
    for run in sorted({(r["seed"], r["speed"]) for r in sub}):
        at = [r for r in sub if (r["seed"], r["speed"]) == run]
        out[run] = (find(at, *BASELINE), find(at, *OURS))
    return out


METRICS: dict[str, Callable[[Row, Row], float | None]] = {
    "p50": lambda b, o: ratio_of(b["p50_latency_s"], o["p50_latency_s"]),
    "ttft": lambda b, o: ratio_of(b["p50_ttft_s"], o["p50_ttft_s"]),
    "throughput": lambda b, o: ratio_of(o["throughput_rps"], b["throughput_rps"]),
}


def pair_band(rows: Sequence[Row], table: str, metric: str) -> Band | None:
    """``metric`` (p50 or TTFT ratio baseline / ours, or ours' throughput factor) over a band."""
    return band(METRICS[metric](b, o) for b, o in pair_values(rows, table).values())


def max_band(rows: Sequence[Row], tables: Sequence[str], metric: str) -> Band | None:
    """Per run (seed x speed), the largest value over ``tables`` (the paper's "up to" is a
    maximum over its benchmarks), then the band of those maxima."""
    per = [pair_values(rows, t) for t in tables]
    runs = set.intersection(*(set(p) for p in per)) if per else set()
    values = []
    for run in sorted(runs):
        found = [METRICS[metric](*p[run]) for p in per]
        kept = [v for v in found if v is not None]
        values.append(max(kept) if kept else None)
    return band(values)


# -- one worker around one round_robin pass ------------------------------------------------------
def pass_points(rows: Sequence[Row], table: str = "pass") -> list[dict[str, Any]]:
    """Per capacity (as a fraction of one pass): lru and rlt hit rates, their finite ratios
    and rlt's throughput factor over lru, each over the band."""
    sub = [r for r in rows if r["table"] == table]
    points = []
    for factor in sorted({r["pass_factor"] for r in sub}):
        at = [r for r in sub if r["pass_factor"] == factor]
        runs = sorted({(r["seed"], r["speed"]) for r in at})
        lru, rlt, ratios, gains = [], [], [], []
        for run in runs:
            pair = {r["eviction"]: r for r in at if (r["seed"], r["speed"]) == run}
            lru.append(pair["lru"]["hit_rate"])
            rlt.append(pair["rlt"]["hit_rate"])
            ratios.append(ratio_of(pair["rlt"]["hit_rate"], pair["lru"]["hit_rate"]))
            gains.append(ratio_of(pair["rlt"]["throughput_rps"], pair["lru"]["throughput_rps"]))
        points.append(
            {
                "factor": factor,
                "runs": len(runs),
                "lru": band(lru),
                "rlt": band(rlt),
                "lru_zero": sum(1 for v in lru if v == 0),
                "ratio": band(ratios),
                "throughput": band(gains),
            }
        )
    return points


def pass_max_band(rows: Sequence[Row], key: str, table: str = "pass") -> Band | None:
    """Per run, the largest finite value of ``key`` ("ratio" or "throughput" of rlt over
    lru) over the capacities; the band of those "up to" figures."""
    sub = [r for r in rows if r["table"] == table]
    values = []
    for run in sorted({(r["seed"], r["speed"]) for r in sub}):
        best: float | None = None
        for factor in {r["pass_factor"] for r in sub}:
            pair = {
                r["eviction"]: r
                for r in sub
                if (r["seed"], r["speed"]) == run and r["pass_factor"] == factor
            }
            metric = "hit_rate" if key == "ratio" else "throughput_rps"
            value = ratio_of(pair["rlt"][metric], pair["lru"][metric])
            if value is not None and (best is None or value > best):
                best = value
        values.append(best)
    return band(values)


# -- fleet size --------------------------------------------------------------------------------
def workers_bands(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per fleet size: the headline pair's p50 ratio, throughput factor and req/s, as bands."""
    sub = [r for r in rows if r["table"] == "workers"]
    out = []
    for n in sorted({r["workers"] for r in sub}):
        at = [dict(r, table="n") for r in sub if r["workers"] == n]
        pairs = pair_values(at, "n").values()
        out.append(
            {
                "workers": n,
                "p50": pair_band(at, "n", "p50"),
                "throughput": pair_band(at, "n", "throughput"),
                "base_rps": band(b["throughput_rps"] for b, _ in pairs),
                "ours_rps": band(o["throughput_rps"] for _, o in pairs),
                "base_p50": band(b["p50_latency_s"] for b, _ in pairs),
                "ours_p50": band(o["p50_latency_s"] for _, o in pairs),
            }
        )
    return out


def vanishes(found: Band | None) -> bool:
    """No throughput gain either way anywhere in the band (within ``VANISH``)."""
    return found is not None and found.lo >= 1 - VANISH and found.hi <= 1 + VANISH


def vanish_verdict(table: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """ "Gains vanish with >= 6 workers", on throughput: (verdict, why)."""
    gone = [r["workers"] for r in table if vanishes(r["throughput"])]
    big = [r for r in table if r["workers"] >= 6]
    small = [r for r in table if r["workers"] < 6 and not vanishes(r["throughput"])]
    first = next(
        (n for n in sorted(gone) if all(r["workers"] in gone for r in table if r["workers"] >= n)),
        None,
    )
    if not big or not all(vanishes(r["throughput"]) for r in big):
        return "not reproduced", "a throughput gain outside +-1% remains at 6 workers or more"
    if not small:
        return "inside band", "no throughput gain at any fleet size: nothing to vanish"
    sizes = ", ".join(str(r["workers"]) for r in small)
    return (
        "reproduced",
        f"throughput gains (outside +-1%) at {sizes} worker(s); none from {first} workers on",
    )
