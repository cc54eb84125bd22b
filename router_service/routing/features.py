"""Features for residual models: pure functions of the request and one worker's snapshot.

| name            | meaning                                                        |
|-----------------|----------------------------------------------------------------|
| ``cached_k``    | units the index believes the worker caches, in thousands       |
| ``uncached_k``  | units it would have to prefill, in thousands                   |
| ``queue_ms``    | the worker's decayed queue load (ms)                           |
| ``in_flight``   | requests this router has in flight on the worker               |
| ``pending_k``   | uncached units this router sent the worker, not yet completed  |
|                 | (a backlog estimate), in thousands                             |
| ``prompt_k``    | prompt length in tokens when known, else units, in thousands   |
| ``max_new_k``   | requested output tokens, in thousands (0 when not given)       |
| ``estimate_ms`` | the policy's own latency estimate for the worker before any    |
|                 | residual (LBGR: ``base + alpha * queue``), in ms               |

Lengths are in thousands so that raw features sit near 1 for learners without scaling.
``estimate_ms`` is the one feature that is not a function of the request and the snapshot
alone: the policy passes it, so that a model can learn the worker's latency *relative* to what
the router already predicts (``ratio``).
"""

from __future__ import annotations

from models.base import Features
from router_service.routing.types import RouteRequest, WorkerSnapshot

__all__ = ["FEATURE_NAMES", "residual_features"]

FEATURE_NAMES = (
    "cached_k",
    "uncached_k",
    "queue_ms",
    "in_flight",
    "pending_k",
    "prompt_k",
    "max_new_k",
    "estimate_ms",
)


def residual_features(
    request: RouteRequest, worker: WorkerSnapshot, estimate_ms: float
) -> Features:
    prompt = request.prompt_tokens if request.prompt_tokens is not None else request.units
    return {
        "cached_k": worker.cached / 1000.0,
        "uncached_k": (request.units - worker.cached) / 1000.0,
        "queue_ms": worker.queue_ms,
        "in_flight": float(worker.in_flight),
        "pending_k": worker.pending_units / 1000.0,
        "prompt_k": prompt / 1000.0,
        "max_new_k": (request.max_new_tokens or 0) / 1000.0,
        "estimate_ms": estimate_ms,
    }
