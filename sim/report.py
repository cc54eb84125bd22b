"""Summaries of a run in the JSON shape of docs/design.md (*The summary of sim
and bench --json*), and the markdown tables we print."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sim.cluster import SimRun

__all__ = ["FLEET_METRIC_COLUMNS", "markdown_table", "percentile_s", "summarize"]

# (header, key, format) of a fleet run's summary, after the column(s) naming the run.
FLEET_METRIC_COLUMNS = (
    ("eviction", "eviction", "{}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("p50 lat (s)", "p50_latency_s", "{:.2f}"),
    ("p95 lat (s)", "p95_latency_s", "{:.2f}"),
    ("p50 TTFT (s)", "p50_ttft_s", "{:.2f}"),
    ("p95 TTFT (s)", "p95_ttft_s", "{:.2f}"),
    ("req/s", "throughput_rps", "{:.2f}"),
    ("done", "completed", "{}"),
)
TABLE_COLUMNS = (("policy", "policy", "{}"), *FLEET_METRIC_COLUMNS, ("failed", "failed", "{}"))


def percentile_s(values_ms: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values_ms, q)) / 1000.0 if len(values_ms) else None


def summarize(run: SimRun, **extra: Any) -> dict[str, Any]:
    """The summary (docs/design.md): its keys, per-worker figures and ``extra`` (workload...)."""
    done = [r for r in run.records if r.finished_ms is not None]
    latencies = [r.latency_ms for r in done if r.latency_ms is not None]
    ttfts = [r.ttft_ms for r in done if r.ttft_ms is not None]
    prompt = sum(w.cache.stats.prompt_tokens for w in run.workers)
    cached = sum(w.cache.stats.cached_tokens for w in run.workers)
    finished = [r.finished_ms for r in done if r.finished_ms is not None]
    span_ms = max(finished) - min(r.arrival_ms for r in run.records) if finished else 0.0
    per_worker = []
    for w in run.workers:
        stats = w.cache.stats
        per_worker.append(
            {
                "worker": w.url,
                "requests": sum(1 for r in run.records if r.worker == w.url),
                "hit_rate": round(stats.hit_rate, 6),
                "prompt_tokens": stats.prompt_tokens,
                "cached_tokens": stats.cached_tokens,
                "evicted_tokens": stats.evicted_tokens,
                "busy_s": round(w.busy_ms / 1000.0, 3),
            }
        )
    cfg = run.config
    out: dict[str, Any] = {
        "policy": cfg.policy,
        "eviction": cfg.eviction,
        "workers": cfg.workers,
        "requests": len(run.records),
        "completed": len(done),
        "failed": sum(1 for r in run.records if r.failed),
        "hit_rate": round(cached / prompt, 6) if prompt else 0.0,
        "p50_latency_s": _r(percentile_s(latencies, 50)),
        "p95_latency_s": _r(percentile_s(latencies, 95)),
        "p99_latency_s": _r(percentile_s(latencies, 99)),
        "mean_latency_s": _r(float(np.mean(latencies)) / 1000.0 if latencies else None),
        "p50_ttft_s": _r(percentile_s(ttfts, 50)),
        "p95_ttft_s": _r(percentile_s(ttfts, 95)),
        "throughput_rps": round(len(done) / (span_ms / 1000.0), 4) if span_ms > 0 else 0.0,
        "per_worker": per_worker,
        "profile": cfg.profile,
        "capacity_tokens": cfg.capacity_tokens
        or min(p.kv_capacity_tokens for p in cfg.worker_profiles()),
        "seed": cfg.seed,
        "policy_params": dict(cfg.policy_params),
        "prompt_format": cfg.prompt_format,
        "output_hint": cfg.output_hint,
        "marking": cfg.marking,
    }
    if cfg.hold.enabled:
        waits = [r.sent_ms - r.arrival_ms for r in run.records if r.sent_ms is not None]
        out["queue"] = {
            "slots": cfg.hold.slots,
            "free_at": cfg.hold.free_at,
            "max_wait_s": cfg.hold.max_wait_ms / 1000.0,
            "p50_wait_s": _r(percentile_s(waits, 50)),
            "p95_wait_s": _r(percentile_s(waits, 95)),
        }
    out.update(extra)
    return out


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def markdown_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]] = TABLE_COLUMNS
) -> str:
    """A markdown table of summary rows; missing values print as ``-``."""
    head = "| " + " | ".join(title for title, _, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, rule]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
