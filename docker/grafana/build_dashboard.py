"""Writes ``docker/grafana/dashboards/kvroute.json``, the provisioned Grafana dashboard.

The dashboard is generated rather than edited by hand so that every panel is a few lines
here, its PromQL reviewable in one place. After a change run::

    python docker/grafana/build_dashboard.py

``tests/docker/test_observability_config.py`` checks that the JSON file is what this script
writes, and that every metric a query names is one that a router's ``/metrics`` exports or
one of SGLang's listed in ``docs/metrics.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).parent / "dashboards" / "kvroute.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # provisioning/datasources/prometheus.yml
QUANTILES = (0.5, 0.95, 0.99)
WINDOW = "[$__rate_interval]"

# A panel: (title, unit, description, [(PromQL, legend), ...]); a row: (title, [panels]).
Target = tuple[str, str]
Panel = tuple[str, str, str, list[Target]]


def _rate(metric: str, by: str = "", where: str = "") -> str:
    """``sum [by (...)] (rate(metric{where}[window]))``."""
    group = f" by ({by}) " if by else ""
    return f"sum{group}(rate({metric}{where}{WINDOW}))"


def _ratio(numerator: str, denominator: str, by: str = "") -> str:
    return f"{_rate(numerator, by)} / {_rate(denominator, by)}"


def _quantiles(metric: str, by: str = "") -> list[Target]:
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        (f"histogram_quantile({q}, {_rate(metric + '_bucket', group)})", f"p{q * 100:g}{suffix}")
        for q in QUANTILES
    ]


NOT_OK = '{status!="ok"}'

ROUTING: list[Panel] = [
    (
        "Routing decisions (req/s by worker and status)",
        "reqps",
        "Proxied requests per second, summed over router replicas.",
        [(_rate("kvroute_requests_total", "worker, status"), "{{worker}} {{status}}")],
    ),
    (
        "Error ratio",
        "percentunit",
        (
            "Share of requests whose outcome was not ok (worker errors, timeouts, unavailable "
            "workers, client disconnects)."
        ),
        [
            (
                (
                    # `or vector(0)`: 0 rather than "no data" while nothing failed.
                    f"({_rate('kvroute_requests_total', where=NOT_OK)} or vector(0)) / "
                    f"{_rate('kvroute_requests_total')}"
                ),
                "errors",
            )
        ],
    ),
    (
        "Decision time",
        "s",
        "Time one routing decision takes in the router (pure code, no I/O).",
        _quantiles("kvroute_decision_seconds", "policy"),
    ),
    (
        "Worker health (router view)",
        "short",
        "1 while the routers' health checks pass; the lowest replica's view.",
        [("min by (worker) (kvroute_worker_healthy)", "{{worker}}")],
    ),
]

QUEUE: list[Panel] = [
    (
        "Decayed queue load per worker",
        "ms",
        "LBGR's queue term, shared by the replicas through Redis (they agree; max).",
        [("max by (worker) (kvroute_queue_load_ms)", "{{worker}}")],
    ),
    (
        "Requests in flight per worker",
        "short",
        "Requests the routers have sent and not yet seen finish, all replicas.",
        [("sum by (worker) (kvroute_in_flight)", "{{worker}}")],
    ),
    (
        "Worker queues (SGLang)",
        "short",
        "The workers' own running and waiting requests.",
        [
            ("sum by (instance) (sglang:num_running_reqs)", "running {{instance}}"),
            ("sum by (instance) (sglang:num_queue_reqs)", "queued {{instance}}"),
        ],
    ),
    (
        "KV cache usage (SGLang)",
        "percentunit",
        "Fraction of each worker's KV pool in use.",
        [("max by (instance) (sglang:token_usage)", "{{instance}}")],
    ),
]

HIT_RATE: list[Panel] = [
    (
        "Hit rate: workers (cached / prompt tokens)",
        "percentunit",
        (
            "The paper's measure, from the workers' counters: "
            "rate(sglang:cached_tokens_total) / rate(sglang:prompt_tokens_total)."
        ),
        [
            (
                _ratio("sglang:cached_tokens_total", "sglang:prompt_tokens_total", "instance"),
                "{{instance}}",
            ),
            (_ratio("sglang:cached_tokens_total", "sglang:prompt_tokens_total"), "fleet"),
        ],
    ),
    (
        "Hit rate: router estimate",
        "percentunit",
        (
            "What the routers' prefix index predicted: since start, per replica "
            "(kvroute_cache_hit_ratio_estimate), and over the window, all replicas."
        ),
        [
            ("avg by (worker) (kvroute_cache_hit_ratio_estimate)", "{{worker}} (since start)"),
            (_ratio("kvroute_cached_units_total", "kvroute_prompt_units_total"), "fleet (window)"),
        ],
    ),
    (
        "Evicted tokens (SGLang)",
        "short",
        "Tokens evicted per second by each worker's radix cache (RLT or LRU).",
        [(_rate("sglang:evicted_tokens_total", "instance"), "{{instance}}")],
    ),
]

LATENCY: list[Panel] = [
    (
        "Time to first token (router)",
        "s",
        "From the router receiving a request to the worker's first byte.",
        _quantiles("kvroute_ttft_seconds"),
    ),
    (
        "End-to-end latency (router)",
        "s",
        "From the router receiving a request to the last byte relayed.",
        _quantiles("kvroute_latency_seconds"),
    ),
    (
        "Latency per worker",
        "s",
        "Which worker is slow: latency quantiles per worker.",
        _quantiles("kvroute_latency_seconds", "worker"),
    ),
]

MAE_ALL = 'kvroute_residual_mae_ms{worker="all"}'
MAE_WORKERS = 'kvroute_residual_mae_ms{role="champion", worker!="all"}'

MODEL: list[Panel] = [
    (
        "Residual model error (rolling MAE)",
        "ms",
        "LBGR's residual model: champion, and challenger while one runs in shadow.",
        [(f"max by (role, instance) ({MAE_ALL})", "{{role}} {{instance}}")],
    ),
    (
        "Champion error per worker",
        "ms",
        "Rolling MAE of the champion, per worker (per-worker models).",
        [(f"max by (worker) ({MAE_WORKERS})", "{{worker}}")],
    ),
    (
        "Model version and failures",
        "short",
        (
            "The version moves on every hot swap and promote; failures are isolated predict/learn "
            "errors."
        ),
        [
            ("max by (instance) (kvroute_model_version)", "version {{instance}}"),
            ("sum by (role) (kvroute_model_failures_total)", "failures {{role}}"),
        ],
    ),
]

REDIS: list[Panel] = [
    (
        "Redis fallbacks",
        "short",
        (
            "Load-store operations per second that a replica served from its embedded store "
            "because Redis failed or was slow."
        ),
        [(_rate("kvroute_redis_fallbacks_total", "instance"), "{{instance}}")],
    ),
    (
        "Redis connected",
        "short",
        "1 while a replica uses the shared Redis load store.",
        [("min by (instance) (kvroute_redis_connected)", "{{instance}}")],
    ),
    (
        "Index sync lag",
        "s",
        "From another replica's decision to its prefix-index update here.",
        _quantiles("kvroute_index_sync_lag_seconds", "instance"),
    ),
    (
        "Index sync events",
        "short",
        "Shared-index events per second: published, applied, dropped (Redis down).",
        [(_rate("kvroute_index_sync_events", "kind, instance"), "{{kind}} {{instance}}")],
    ),
    (
        "Prefix index size per worker",
        "short",
        "Units the routers' prefix index holds per worker.",
        [("max by (worker) (kvroute_index_units)", "{{worker}}")],
    ),
]

ROWS: list[tuple[str, list[Panel]]] = [
    ("Routing", ROUTING),
    ("Queue load", QUEUE),
    ("Cache hit rate", HIT_RATE),
    ("Latency", LATENCY),
    ("Latency model", MODEL),
    ("Redis and index sync", REDIS),
]


def _panel(panel_id: int, panel: Panel, x: int, y: int) -> dict[str, Any]:
    title, unit, description, targets = panel
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def build() -> dict[str, Any]:
    """The dashboard: one collapsed-free row per topic, panels two to a line."""
    panels: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        for i, panel in enumerate(row_panels):
            panels.append(_panel(next_id, panel, x=12 * (i % 2), y=y + 8 * (i // 2)))
            next_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": "kvroute",
        "title": "kvroute",
        "description": "Routing decisions, queue load, hit rate, latency, model error, Redis.",
        "tags": ["kvroute", "sglang"],
        "timezone": "browser",
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
