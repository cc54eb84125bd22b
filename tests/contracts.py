"""The contracts of ``docs/design.md`` that several test modules check, written down once
and independently of the code under test."""

from __future__ import annotations

# The keys of one run's ``--json`` summary (``kvroute sim``, ``kvroute bench``,
# ``kvroute cluster``).
SUMMARY_KEYS = frozenset(
    {
        "policy",
        "eviction",
        "workers",
        "requests",
        "completed",
        "failed",
        "hit_rate",
        "p50_latency_s",
        "p95_latency_s",
        "p50_ttft_s",
        "p95_ttft_s",
        "throughput_rps",
        "per_worker",
    }
)

# What ``/explain`` gives for every worker (``candidates[]``).
EXPLAIN_CANDIDATE_KEYS = frozenset(
    {
        "worker",
        "cached",
        "uncached",
        "base_ms",
        "queue_ms",
        "residual_ms",
        "predicted_ms",
        "eligible",
        "reason",
    }
)
