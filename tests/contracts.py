"""The contracts of ``../shared/DESIGN.md`` that several test modules check, written down once
and independently of the code under test."""

from __future__ import annotations

# DESIGN 7: the keys of one run's ``--json`` summary (``kvroute sim``, ``kvroute bench``,
# ``kvroute cluster``).
DESIGN_7_KEYS = frozenset(
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

# DESIGN 5: what ``/explain`` gives for every worker (``candidates[]``).
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
