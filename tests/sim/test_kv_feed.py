"""The simulator's routers matching on their workers' KV events (``ClusterConfig.kv_events``).

The same GSP run with the approximate index and with events: with events the router's
prediction for the chosen worker is what the worker then reports (``cached_tokens``) up to
evictions that happen between routing and admission; the approximate index over-predicts
often, as it never learns what was evicted.
"""

from __future__ import annotations

import pytest

from sim.cluster import ClusterConfig, RequestRecord, simulate
from sim.workloads import GSPConfig, GSPWorkload

PAGE = 16


def over_share(records: list[RequestRecord]) -> float:
    """Share of requests the router over-predicted by more than a page."""
    done = [r for r in records if r.finished_ms is not None]
    return sum((r.predicted_cached or 0) - r.cached_tokens > PAGE for r in done) / len(done)


@pytest.mark.parametrize("eviction", ["lru", "rlt"])
def test_events_make_the_prediction_what_the_worker_reports(eviction: str) -> None:
    def run(kv_events: bool) -> list[RequestRecord]:
        workload = GSPWorkload(GSPConfig(num_groups=24, prompts_per_group=12, rate=4.0), limit=250)
        config = ClusterConfig(
            workers=3,
            eviction=eviction,
            capacity_tokens=40_000,
            page_size=PAGE,
            kv_events=kv_events,
            policy="cache_aware",
        )
        return simulate(config, workload).records

    approximate, exact = run(False), run(True)
    assert over_share(exact) < 0.01
    assert over_share(approximate) > 0.05  # the cache is small: the guess goes stale
    done = [r for r in exact if r.finished_ms is not None]
    within_a_page = sum(abs((r.predicted_cached or 0) - r.cached_tokens) <= PAGE for r in done)
    assert within_a_page / len(done) > 0.95
