"""What the reproduction's modules share: its tables, routers and pairs, and how a row is found.

A row is one simulation's summary (``sim.report.summarize``) with the ``table`` it belongs to
(``reproduction_plan.Task``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["BASELINE", "EVICTIONS", "MAIN_TABLES", "OURS", "POLICIES", "Row", "find", "rows_in"]

Row = dict[str, Any]
# The paper's four benchmarks, the routers of every fleet table and the evictions.
MAIN_TABLES = ("gsp", "sharegpt", "ultrachat", "loogle")
POLICIES = ("random", "round_robin", "power_of_two", "cache_aware", "lbgr_paper")
EVICTIONS = ("lru", "rlt")
# The headline pair: the paper's baseline and its method.
BASELINE = ("cache_aware", "lru")
OURS = ("lbgr_paper", "rlt")


def rows_in(rows: Sequence[Row], table: str) -> list[Row]:
    """The rows of one table, in router then eviction order (as the commands list them)."""
    picked = [r for r in rows if r["table"] == table]
    return sorted(picked, key=lambda r: (_rank(r["policy"]), r["eviction"]))


def find(rows: Sequence[Row], policy: str, eviction: str) -> Row:
    """The row of ``policy`` + ``eviction`` among ``rows``."""
    return next(r for r in rows if r["policy"] == policy and r["eviction"] == eviction)


def _rank(policy: str) -> int:
    return POLICIES.index(policy) if policy in POLICIES else len(POLICIES)
