"""Prometheus metrics of one router replica, on a registry of its own (no globals).

| metric | type | labels |
|---|---|---|
| ``kvroute_requests_total`` | counter | worker, policy, status |
| ``kvroute_decision_seconds`` | histogram | policy |
| ``kvroute_ttft_seconds`` / ``kvroute_latency_seconds`` | histogram | worker |
| ``kvroute_prompt_units_total`` / ``kvroute_cached_units_total`` | counter | worker |
| ``kvroute_cache_hit_ratio_estimate`` | gauge | worker |
| ``kvroute_queue_load_ms`` | gauge | worker |
| ``kvroute_in_flight`` | gauge | worker |
| ``kvroute_worker_healthy`` | gauge | worker |
| ``kvroute_residual_mae_ms`` | gauge | role (champion/challenger), worker |
| ``kvroute_model_failures_total`` | gauge | role |
| ``kvroute_model_version`` | gauge | |
| ``kvroute_redis_fallbacks_total`` | gauge | |
| ``kvroute_redis_connected`` | gauge | |
| ``kvroute_index_units`` | gauge | worker |
| ``kvroute_cache_horizon_seconds`` | gauge | worker |
| ``kvroute_cache_refetch_share`` | gauge | worker |
| ``kvroute_index_sync_lag_seconds`` | histogram | |
| ``kvroute_load_copy_age_seconds`` | histogram | |
| ``kvroute_index_sync_events`` | gauge | kind (published/applied/dropped) |
| ``kvroute_replica_info`` | gauge | replica_id |

Gauges are computed when scraped from the live state (``StateCollector``), so they cost
nothing on the request path. The estimated hit ratio is the router's view (cached units the
prefix index predicted / units routed), not the workers' own counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        state = self.snapshot()
        per_worker = {
            "kvroute_queue_load_ms": ("Decayed queue load per worker (ms)", "queue_ms"),
            "kvroute_in_flight": ("Requests in flight per worker (this replica)", "in_flight"),
            "kvroute_worker_healthy": ("1 if the worker is healthy", "healthy"),
            "kvroute_index_units": ("Units the prefix index holds per worker", "index_units"),
            "kvroute_cache_hit_ratio_estimate": (
                "Router-estimated cache hit ratio per worker",
                "hit_ratio_estimate",
            ),
            "kvroute_cache_refetch_share": (
                "Of what the worker prefilled lately, the share it had held before and evicted",
                "cache_refetch_share",
            ),
        }
        for name, (doc, key) in per_worker.items():
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            for worker, values in state["workers"].items():
                family.add_metric([worker], float(values.get(key) or 0.0))
            yield family
        horizon = GaugeMetricFamily(
            "kvroute_cache_horizon_seconds",
            "Age from which the worker's answers say under half of what the router sent it is "
            "still cached (only workers with one learned)",
            labels=["worker"],
        )
        for worker, values in state["workers"].items():
            if values.get("cache_horizon_ms") is not None:
                horizon.add_metric([worker], values["cache_horizon_ms"] / 1000.0)
        yield horizon
        mae = GaugeMetricFamily(
            "kvroute_residual_mae_ms",
            "Rolling MAE of residual predictions",
            labels=["role", "worker"],
        )
        failures = GaugeMetricFamily(
            "kvroute_model_failures_total",
            "Model predict/learn failures (isolated)",
            labels=["role"],
        )
        learned = GaugeMetricFamily(
            "kvroute_residual_learned",
            "What each worker's residual model has learned (quantity: residual_ms or factor)",
            labels=["role", "worker", "quantity"],
        )
        for role, status in state.get("models", {}).items():
            if status is None:
                continue
            mae.add_metric([role, "all"], float(status["mae_ms"] or 0.0))
            for worker, value in status["per_worker_mae_ms"].items():
                mae.add_metric([role, worker], float(value or 0.0))
            failures.add_metric([role], float(status["failures"]))
            for worker, values in status["per_worker_learned"].items():
                for quantity, value in values.items():
                    learned.add_metric([role, worker, quantity], value)
        yield mae
        yield failures
        yield learned
        version = GaugeMetricFamily("kvroute_model_version", "Version of the champion model")
        version.add_metric([], float(state.get("model_version") or 0))
        yield version
        store = state["store"]
        fallbacks = GaugeMetricFamily(
            "kvroute_redis_fallbacks_total",
            "Load-store operations served locally because Redis failed",
        )
        fallbacks.add_metric([], float(store.get("fallback_operations", 0)))
        yield fallbacks
        connected = GaugeMetricFamily(
            "kvroute_redis_connected", "1 if the shared Redis load store is in use"
        )
        connected.add_metric([], 1.0 if store.get("redis_connected") else 0.0)
        yield connected
        sync = state.get("index_sync")
        events = GaugeMetricFamily(
            "kvroute_index_sync_events", "Shared-index events of this replica", labels=["kind"]
        )
        for kind in ("published", "applied", "dropped"):
            events.add_metric([kind], float(sync[kind]) if sync else 0.0)
        yield events


class Metrics:
    """Counters and histograms updated on the request path, gauges read on scrape."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], replica_id: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        info = Gauge("kvroute_replica_info", "This router replica", ["replica_id"], registry=r)
        info.labels(replica_id).set(1)
        self.index_lag_seconds = Histogram(
            "kvroute_index_sync_lag_seconds",
            "Delay from another replica's routing decision to its index update here",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.load_copy_age_seconds = Histogram(
            "kvroute_load_copy_age_seconds",
            "Age of the copy of the shared loads a routing decision read (Redis load mirror)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.requests = Counter(
            "kvroute_requests", "Proxied requests", ["worker", "policy", "status"], registry=r
        )
        self.decision_seconds = Histogram(
            "kvroute_decision_seconds",
            "Routing decision time",
            ["policy"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvroute_ttft_seconds",
            "Time to first token (streaming)",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency_seconds = Histogram(
            "kvroute_latency_seconds",
            "End-to-end latency",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_waiting = Gauge(
            "kvroute_queue_waiting",
            "Requests waiting in the hold queue for a free worker slot",
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "kvroute_queue_wait_seconds",
            "Time a request waited in the hold queue",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_units = Counter(
            "kvroute_prompt_units", "Prompt units routed", ["worker"], registry=r
        )
        self.cached_units = Counter(
            "kvroute_cached_units",
            "Prompt units the index predicted cached",
            ["worker"],
            registry=r,
        )
        r.register(_StateCollector(snapshot))
