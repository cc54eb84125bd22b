"""Control plane: workers, policy, models (hot swap, challenger). Bearer-token protected.

Served on the control listener only (``control_host:control_port``, loopback by default;
``app.KVRouteApp`` refuses these paths on the data port). Every endpoint needs
``Authorization: Bearer <admin token>`` (compared in constant time); without a configured
token the control plane is off (403).
"""

from __future__ import annotations

import hmac
import math
import random
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.responses import JSONResponse

from models import ModelSpecError, NoChallenger, parse_spec
from router_service.api_schema import (
    PolicyAnswer,
    WorkerAnswer,
    WorkerListAnswer,
    WorkerRemovedAnswer,
    errors,
)
from router_service.errors import ServiceError
from router_service.kv_events import EventSource, allowed_source
from router_service.routing import RoutingPolicy, make_policy
from router_service.routing.policy import policy_factory
from router_service.settings import Settings, normalize_worker_url
from router_service.state import ServiceState

__all__ = ["build_policy", "is_admin", "register_worker", "router", "unregister_worker"]


def _state(request: Request) -> ServiceState:
    state: ServiceState = request.app.state.kvroute
    return state


def is_admin(request: Request) -> bool:
    """Whether the request carries the admin token (a valid one; none is configured: no)."""
    token = _state(request).settings.admin_token
    if token is None:
        return False
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    expected = token.get_secret_value().encode()
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)


def require_admin(request: Request) -> None:
    token = _state(request).settings.admin_token
    if token is None:  # unreachable through the app (the control plane is off), kept safe
        raise ServiceError(403, "the control plane is off", error_type="control_plane_off")
    if not is_admin(request):
        raise ServiceError(
            401,
            "this endpoint needs 'Authorization: Bearer <admin token>'",
            error_type="unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
        )


router = APIRouter(
    dependencies=[Depends(require_admin)], responses=errors(401), tags=["control plane"]
)


_MODELS_DOC = "the residual models: version, champion and challenger (spec, sharing, errors)"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerBody(_Body):
    url: str = Field(description="worker base URL, e.g. http://127.0.0.1:30001")
    kv_events: str | None = Field(
        None,
        description="the worker's KV-event publisher, tcp://host:port, and its replay endpoint "
        "after a comma (SGLang --kv-events-config); the router then reads its cache from them",
    )


def _finite(value: Any, where: str = "params") -> Any:
    """``value`` unchanged, if every number in it is finite (JSON's NaN and Infinity, which
    Python's parser accepts, would break every later answer that serializes them)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} holds {value!r}; use a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            _finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _finite(item, f"{where}[{i}]")
    return value


class PolicyBody(_Body):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _check_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _finite(value)  # type: ignore[no-any-return]


class ModelBody(_Body):
    spec: str | dict[str, Any] = Field(description='kind name or {"kind": ..., "params": {...}}')
    worker: str | None = Field(None, description="swap only this worker's model")
    sharing: str | None = Field(None, description="per_worker or shared")

    @field_validator("spec", mode="before")
    @classmethod
    def _check_spec(cls, value: Any) -> Any:
        # Checked here so a bad spec is reported as `spec`, not as a union member (`spec.str`).
        if not isinstance(value, str | dict):
            raise ValueError('give a model kind name or {"kind": ..., "params": {...}}')
        return _finite(value, "spec")


def _worker_view(state: ServiceState, url: str) -> dict[str, Any]:
    w = state.pool.workers[url]
    ledger = state.router.ledger
    others = state.worker_load.others(url) if state.worker_load is not None else (0.0, 0.0)
    discovery = state.kv_discovery
    return {
        **w.to_dict(),
        "in_flight": ledger.in_flight.get(url, 0),
        "pending_units": ledger.pending_units.get(url, 0),
        "prefill_tokens": round(ledger.prefill_tokens.get(url, 0.0), 1),
        "kv_tokens": round(ledger.kv_tokens.get(url, 0.0), 1),
        "other_requests": others[0],
        "other_kv_tokens": others[1],
        "queue_ms": state.last_queue_ms.get(url, 0.0),
        "index_units": state.router.index_units(url),
        "cache_survival": state.router.survival.view(url),
        "kv_events": state.kv_feed.worker_status(url) if state.kv_feed is not None else None,
        # --kv-events-discover: "subscribed", or why the worker's /server_info named none
        "kv_events_discovery": discovery.outcomes.get(url) if discovery is not None else None,
    }


@router.get("/workers", responses={200: {"model": WorkerListAnswer}})
async def list_workers(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse({"workers": [_worker_view(state, u) for u in state.pool.urls()]})


@router.post(
    "/workers",
    status_code=201,
    responses={201: {"model": WorkerAnswer}, **errors(400, 403, 409)},
)
async def add_worker(body: WorkerBody, request: Request) -> JSONResponse:
    """Register a worker; it takes traffic once its /health answers."""
    state = _state(request)
    try:
        url = normalize_worker_url(body.url)
    except ValueError as exc:
        raise ServiceError(400, f"url: {exc}", field="url") from None
    if not state.settings.worker_allowed(url, state.own_ports()):
        raise ServiceError(
            403,
            f"url: {url} is not on the worker allow-list; allow its network with "
            "KVROUTE_ALLOWED_WORKER_NETWORKS or its host name with "
            "KVROUTE_ALLOWED_WORKER_HOSTS (the router's own ports, Redis's and well-known "
            "non-HTTP service ports are refused unless listed in KVROUTE_WORKER_URLS)",
            field="url",
            error_type="forbidden",
        )
    if url in state.pool:
        raise ServiceError(
            409, f"worker {url} is already registered", field="url", error_type="conflict"
        )
    source = allowed_source(state.settings, body.kv_events) if body.kv_events else None
    await register_worker(state, url, source)
    return JSONResponse(_worker_view(state, url), status_code=201)


@router.delete("/workers", responses={200: {"model": WorkerRemovedAnswer}, **errors(400, 404)})
async def remove_worker(request: Request, url: str | None = None) -> JSONResponse:
    """Remove a worker (``?url=`` or a JSON body ``{"url"}``); its load and index go too."""
    state = _state(request)
    if url is None:
        raw = await request.body()
        try:
            url = WorkerBody.model_validate_json(raw or b"{}").url
        except ValueError:
            raise ServiceError(
                400, 'url: give the worker URL as ?url= or {"url": ...}', field="url"
            ) from None
    try:
        url = normalize_worker_url(url)
    except ValueError as exc:
        raise ServiceError(400, f"url: {exc}", field="url") from None
    if url not in state.pool:
        raise ServiceError(
            404, f"worker {url} is not registered", field="url", error_type="not_found"
        )
    await unregister_worker(state, url)
    return JSONResponse({"removed": url, "workers": state.pool.urls()})


async def register_worker(state: ServiceState, url: str, source: EventSource | None = None) -> None:
    """Register ``url`` (normalized, allowed, not registered yet: the caller checked), with
    its KV-event source if any, health-check it and tell the other replicas. ``POST
    /workers`` and DNS discovery (``router_service.discovery``) both add workers here."""
    state.pool.add(url)
    if source is not None and state.kv_feed is not None:
        state.kv_feed.add(url, source)
    await state.pool.check(url)
    if state.index_sync is not None:
        state.index_sync.publish_worker(url, added=True)


async def unregister_worker(state: ServiceState, url: str) -> None:
    """Remove a registered worker everywhere: here, its shared load, the other replicas
    (``DELETE /workers`` and DNS discovery)."""
    forget_worker(state, url)
    await state.store.remove(url)
    if state.index_sync is not None:
        state.index_sync.publish_worker(url, added=False)


def forget_worker(state: ServiceState, url: str) -> None:
    """Drop a worker from the pool, the routing core and the per-worker counters."""
    state.pool.remove(url)
    state.router.remove_worker(url)
    for per_worker in (state.prompt_units, state.cached_units, state.last_queue_ms):
        per_worker.pop(url, None)
    if state.queue is not None:
        state.queue.forget_worker(url)
    if state.worker_load is not None:
        state.worker_load.forget(url)
    if state.kv_feed is not None:
        state.kv_feed.remove(url)
    if state.kv_discovery is not None:
        state.kv_discovery.forget(url)


def build_policy(
    settings: Settings, rng: random.Random, name: str, params: dict[str, Any]
) -> RoutingPolicy:
    """A policy from the registry; one that says ``configurable_model`` gets the configured
    residual model and sharing unless ``params`` name their own."""
    params = dict(params)
    try:
        if getattr(policy_factory(name), "configurable_model", False):
            if settings.model is not None:
                params.setdefault("model", settings.model)
            params.setdefault("sharing", settings.model_sharing)
        return make_policy(name, random.Random(rng.getrandbits(64)), **params)
    except (ValueError, ModelSpecError) as exc:
        field = "name" if "unknown policy" in str(exc) else "params"
        raise ServiceError(400, f"{field}: {exc}", field=field) from None


@router.get("/policy", responses={200: {"model": PolicyAnswer}})
async def get_policy(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse({"name": state.router.policy.name, "params": state.policy_params})


@router.put("/policy", responses={200: {"model": PolicyAnswer}, **errors(400)})
async def put_policy(body: PolicyBody, request: Request) -> JSONResponse:
    """Switch policy at run time; requests in flight finish under the old one."""
    state = _state(request)
    policy = build_policy(state.settings, state.rng, body.name, body.params)
    old, new = state.router.policy.models, policy.models
    if (
        old is not None
        and new is not None
        and "model" not in body.params
        and old.champion.spec == new.champion.spec
    ):
        policy.adopt_models(old)  # the same kind of model: keep what it learned
    state.router.set_policy(policy)
    state.policy_params = dict(body.params)
    return JSONResponse({"name": policy.name, "params": state.policy_params})


def _slot(state: ServiceState) -> Any:
    slot = state.router.policy.models
    if slot is None:
        raise ServiceError(
            409,
            f"policy {state.router.policy.name!r} has no residual models; "
            "switch to lbgr first (PUT /policy)",
            error_type="conflict",
        )
    return slot


@router.get("/models", responses={200: {"description": _MODELS_DOC}})
async def get_models(request: Request) -> JSONResponse:
    state = _state(request)
    slot = state.router.policy.models
    return JSONResponse(
        {
            "policy": state.router.policy.name,
            "models": slot.status() if slot is not None else None,
            "snapshots": state.snapshots.status(),
        }
    )


@router.put("/models", responses={200: {"description": _MODELS_DOC}, **errors(400, 404, 409)})
async def put_models(body: ModelBody, request: Request) -> JSONResponse:
    """Hot swap: fresh models of ``spec`` for every worker, or for one worker."""
    state = _state(request)
    slot = _slot(state)
    worker = None
    if body.worker is not None:
        try:
            worker = normalize_worker_url(body.worker)
        except ValueError as exc:
            raise ServiceError(400, f"worker: {exc}", field="worker") from None
        if worker not in state.pool:
            raise ServiceError(
                404, f"worker {worker} is not registered", field="worker", error_type="not_found"
            )
    try:
        slot.swap(parse_spec(body.spec), worker=worker, sharing=body.sharing)
    except (ModelSpecError, ValueError) as exc:
        raise ServiceError(400, f"spec: {exc}", field="spec") from None
    return JSONResponse(slot.status())


@router.post(
    "/models/challenger",
    status_code=201,
    responses={201: {"description": _MODELS_DOC}, **errors(400, 409)},
)
async def start_challenger(body: ModelBody, request: Request) -> JSONResponse:
    """Start a challenger that learns in shadow on the live stream."""
    slot = _slot(_state(request))
    try:
        slot.start_challenger(parse_spec(body.spec), sharing=body.sharing)
    except (ModelSpecError, ValueError) as exc:
        raise ServiceError(400, f"spec: {exc}", field="spec") from None
    return JSONResponse(slot.status(), status_code=201)


@router.get("/models/challenger", responses={200: {"description": _MODELS_DOC}, **errors(409)})
async def challenger_status(request: Request) -> JSONResponse:
    status = _slot(_state(request)).status()
    return JSONResponse(
        {
            "champion": status["champion"],
            "challenger": status["challenger"],
            "version": status["version"],
        }
    )


@router.delete("/models/challenger", responses={200: {"description": _MODELS_DOC}, **errors(409)})
async def drop_challenger(request: Request) -> JSONResponse:
    slot = _slot(_state(request))
    slot.drop_challenger()
    return JSONResponse(slot.status())


@router.post("/models/promote", responses={200: {"description": _MODELS_DOC}, **errors(409)})
async def promote(request: Request) -> JSONResponse:
    """The challenger becomes the champion, with what it learned in shadow."""
    slot = _slot(_state(request))
    try:
        slot.promote()
    except NoChallenger as exc:
        raise ServiceError(409, str(exc), error_type="conflict") from None
    return JSONResponse(slot.status())
