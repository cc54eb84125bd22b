"""Data-plane, explain, health and metrics endpoints."""

from __future__ import annotations

from typing import Any

import aiohttp
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from router_service.api_control import is_admin
from router_service.api_schema import (
    CHAT_BODY,
    COMPLETIONS_BODY,
    EXPLAIN_BODY,
    GENERATE_BODY,
    ExplainAnswer,
    HealthAnswer,
    data_plane_doc,
    errors,
    request_body,
)
from router_service.errors import ServiceError
from router_service.proxy import client_key, forward, read_body, route_only
from router_service.request_parsing import detect_kind, load_json, parse_body
from router_service.state import ServiceState
from router_service.tokenizer import tokenized

__all__ = ["DATA_PLANE", "router"]

router = APIRouter()


def _state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.kvroute
    return state


# The proxied routes: path -> (request kind, the worker's path). ``app.KVRouteApp`` answers
# them before FastAPI's middleware stack; the FastAPI declarations below are for the schema
# (and serve a request only if the fast path is bypassed, e.g. under a root path).
DATA_PLANE: dict[str, tuple[str, str]] = {
    "/generate": ("generate", "/generate"),
    "/v1/completions": ("completions", "/v1/completions"),
    "/v1/chat/completions": ("chat", "/v1/chat/completions"),
}


_DATA_ERRORS = errors(400, 408, 413, 429, 502, 503, 504)


@router.post(
    "/generate",
    openapi_extra=data_plane_doc(GENERATE_BODY),
    responses=_DATA_ERRORS,
    tags=["data plane"],
)
async def generate(request: Request) -> Response:
    """SGLang's native API: ``text`` or ``input_ids``, ``sampling_params``, ``stream``."""
    return await forward(_state(request), request, "generate", "/generate")


@router.post(
    "/v1/completions",
    openapi_extra=data_plane_doc(COMPLETIONS_BODY),
    responses=_DATA_ERRORS,
    tags=["data plane"],
)
async def completions(request: Request) -> Response:
    return await forward(_state(request), request, "completions", "/v1/completions")


@router.post(
    "/v1/chat/completions",
    openapi_extra=data_plane_doc(CHAT_BODY),
    responses=_DATA_ERRORS,
    tags=["data plane"],
)
async def chat_completions(request: Request) -> Response:
    return await forward(_state(request), request, "chat", "/v1/chat/completions")


@router.get(
    "/v1/models",
    responses={200: {"description": "a healthy worker's model list"}, **errors(503)},
    tags=["data plane"],
)
async def list_models(request: Request) -> Response:
    """The model list of a healthy worker (all workers serve the same model)."""
    state = _state(request)
    for url in state.pool.healthy_urls():
        try:
            async with state.http().get(
                f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                body = await resp.read()
                if resp.status == 200:
                    return Response(body, media_type=resp.headers.get("content-type"))
        except (aiohttp.ClientError, TimeoutError, OSError):
            continue
    raise ServiceError(
        503,
        "no healthy worker answered /v1/models",
        error_type="no_healthy_worker",
        headers={"Retry-After": "1"},
    )


@router.post(
    "/explain",
    openapi_extra=request_body(EXPLAIN_BODY),
    responses={200: {"model": ExplainAnswer}, **errors(400, 408, 413, 429, 503)},
    tags=["explain"],
)
async def explain(request: Request) -> JSONResponse:
    """The decision the router would make now for this body; nothing is reserved or sent."""
    state = _state(request)
    settings, admission = state.settings, state.admission
    admission.check_rate(client_key(state, request), explain=not is_admin(request))
    raw, release = await read_body(
        request, settings.max_body_bytes, admission=admission, timeout_s=settings.body_timeout_s
    )
    try:
        body = load_json(raw)
        parsed = parse_body(body, detect_kind(body), "explain-" + state.new_request_id())
        parsed = await tokenized(state.tokenizer, parsed)
        decision = route_only(state, parsed, await state.worker_statuses())
    finally:
        release()
    record = {**decision.to_dict(), "replica_id": state.replica_id, "outcome": None}
    return JSONResponse({**_shown(request, record), "dry_run": True})


@router.get(
    "/explain/{decision_id}",
    responses={200: {"model": ExplainAnswer}, **errors(404, 429)},
    tags=["explain"],
)
async def explain_recorded(decision_id: str, request: Request) -> JSONResponse:
    """A recorded decision with its outcome (kept in a bounded ring buffer)."""
    state = _state(request)
    state.admission.check_rate(client_key(state, request), explain=not is_admin(request))
    record = state.decisions.get(decision_id)
    if record is None:
        raise ServiceError(
            404,
            f"no recorded decision {decision_id!r} (unknown, or aged out of the ring buffer)",
            field="decision_id",
            error_type="not_found",
        )
    return JSONResponse({**_shown(request, record), "dry_run": False})


# Per-candidate figures that reveal what a worker caches (and so, by probing, what other
# clients sent): shown to holders of the admin token only (docs/operations.md, Security).
_CACHE_DETAIL = (
    "cached",
    "uncached",
    "base_ms",
    "queue_ms",
    "residual_ms",
    "predicted_ms",
    "impact_ms",
    "evict_ms",
    "stall_ms",
    "cost_ms",
    "in_flight",
    "index_cached",
)


def _shown(request: Request, record: dict[str, Any]) -> dict[str, Any]:
    """A decision as this caller may see it: everything with the admin token; without it,
    workers by label (unless configured) and no per-worker cache figures."""
    state = _state(request)
    if is_admin(request):
        return record
    name = state.public
    candidates = [
        {**c, **dict.fromkeys(_CACHE_DETAIL), "worker": name(c["worker"])}
        for c in record.get("candidates", ())
    ]
    shown = {**record, "candidates": candidates, "chosen": name(record["chosen"])}
    shown["reserve_ms"] = None
    return shown


@router.get(
    "/health",
    responses={
        200: {"model": HealthAnswer},
        503: {"model": HealthAnswer, "description": "no healthy worker, or draining"},
    },
    tags=["operations"],
)
async def health(request: Request) -> JSONResponse:
    """200 while at least one worker can take a request (healthy, its circuit not open) and
    the router is not draining, else 503; ``degraded`` when a circuit is open, the load store
    runs on its fallback, or index sync is restarting after an error. Says how the load
    store and index sync run."""
    state = _state(request)
    snap = state.snapshot()
    name = (lambda u: u) if state.on_control_port(request.scope) else state.public
    workers = {
        name(u): {
            "healthy": w["healthy"],
            "reason": w["reason"] if not w["healthy"] else w["circuit_reason"],
            "circuit": w["circuit"],
            "routable": w["healthy"] and w["circuit_reason"] is None,
        }
        for u, w in snap["workers"].items()
    }
    healthy = [u for u, w in workers.items() if w["healthy"]]
    routable = [u for u, w in workers.items() if w["routable"]]
    store = snap["store"]
    if state.draining:
        status = "draining"
    elif not routable:
        status = "unavailable"
    elif (
        store.get("mode") == "embedded-fallback"
        or len(routable) < len(healthy)
        or (snap["index_sync"] or {}).get("state") == "restarting"
    ):
        status = "degraded"
    else:
        status = "ok"
    body: dict[str, Any] = {
        "status": status,
        "replica_id": state.replica_id,
        "policy": state.router.policy.name,
        "healthy_workers": len(healthy),
        "routable_workers": len(routable),
        "workers": workers,
        "store": store,
        "index_sync": snap["index_sync"],
        "queue": snap["queue"],
        "draining": state.draining,
    }
    return JSONResponse(body, status_code=503 if status in ("unavailable", "draining") else 200)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text format"}},
    tags=["operations"],
)
async def metrics(request: Request) -> Response:
    state = _state(request)
    if state.metrics is None:  # pragma: no cover - always set in the lifespan
        raise ServiceError(503, "metrics are not ready")
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
