"""``create_app(settings)``: the router service. No work at import, no module state.

Everything is built in the lifespan (Starlette's lifespan state) and closed on shutdown:
one pooled aiohttp client, one load store (embedded or Redis), the routing core, the worker
health checker, the index trimmer and, when configured, periodic model snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvroute import __version__
from router_service.admission import Admission
from router_service.api_control import (
    build_policy,
    forget_worker,
    register_worker,
    unregister_worker,
)
from router_service.api_control import router as control_router
from router_service.api_data import DATA_PLANE
from router_service.api_data import router as data_router
from router_service.api_schema import install_openapi
from router_service.breaker import BreakerSettings
from router_service.decisions import DecisionLog
from router_service.discovery import WorkerDiscovery, event_source_for
from router_service.dispatch import DispatchQueue
from router_service.errors import ServiceError, error_response, internal_error_response
from router_service.index_sync import IndexSync
from router_service.kv_events import EventDiscovery, disallowed_host, feed_from_settings
from router_service.load_store import make_store
from router_service.metrics import Metrics
from router_service.model_snapshots import ModelSnapshots
from router_service.proxy import forward
from router_service.redis_client import connect
from router_service.routing import HoldSettings, Router
from router_service.routing.block_keys import BlockKeys
from router_service.routing.block_sets import BlockSets
from router_service.settings import Settings
from router_service.state import ServiceState
from router_service.tokenizer import load_tokenizer
from router_service.ui import install_ui
from router_service.worker_metrics import MetricsPoller
from router_service.workers import WorkerPool

__all__ = ["create_app"]

log = logging.getLogger("kvroute.app")

# Served on the control listener only: the control plane and the operators' read-only views.
CONTROL_PATHS = ("/workers", "/policy", "/models", "/metrics")
OPS_PATHS = ("/metrics",)  # ... of which these need no admin token


def _build_state(settings: Settings) -> ServiceState:
    rng = random.Random(secrets.randbits(64))
    shared = bool(settings.redis_url and settings.index_sync)
    policy = build_policy(settings, rng, settings.policy, settings.policy_params)
    state = ServiceState(
        settings=settings,
        router=Router(
            policy,
            keys=BlockKeys(settings.index_block_units) if shared else None,
            blocks=BlockSets(settings.kv_events_stale_s),
            time_scale=settings.time_scale,
        ),
        pool=WorkerPool(
            lambda: state.http(),  # bound late: the session opens in the lifespan
            timeout_s=settings.health_timeout_s,
            unhealthy_after=settings.unhealthy_after_failures,
            healthy_after=settings.healthy_after_successes,
            breaker=BreakerSettings(
                failure_threshold=settings.breaker_failures,
                success_threshold=settings.breaker_successes,
                open_s=settings.breaker_open_s,
                trial_timeout_s=settings.breaker_trial_timeout_s,
            ),
        ),
        admission=Admission(
            settings.max_in_flight,
            settings.rate_limit_rps,
            settings.rate_limit_burst,
            per_worker_in_flight=settings.per_worker_in_flight,
            workers=lambda: len(state.pool.workers),
            explain_rps=settings.explain_rate_limit_rps,
            max_body_bytes_in_flight=settings.max_body_bytes_in_flight,
        ),
        store=make_store(
            settings.redis_url,
            settings.cluster,
            settings.redis_timeout_ms,
            settings.time_scale,
            settings.load_sync_ms,
            on_read_age=lambda age_s: _observe_copy_age(state, age_s),
        ),
        decisions=DecisionLog(settings.explain_buffer),
        replica_id=settings.replica_id or f"replica-{secrets.token_hex(4)}",
        rng=rng,
        policy_params=dict(settings.policy_params),
    )
    for url in settings.worker_urls:
        state.pool.add(url)
    if settings.worker_metrics_s > 0:
        state.worker_load = MetricsPoller(lambda: state.http(), state.own_load)
    state.metrics = Metrics(state.snapshot, state.replica_id)
    assert state.router.blocks is not None
    state.kv_feed = feed_from_settings(
        settings, state.router.blocks, state.now_ms, lambda: state.http()
    )
    state.metrics.registry.register(state.kv_feed.collector())
    if settings.kv_events_discover:
        state.kv_discovery = EventDiscovery(
            state.kv_feed,
            lambda: state.http(),
            lambda source: disallowed_host(settings, source),
            registered=lambda url: url in state.pool.workers,
        )
    state.tokenizer = load_tokenizer(settings.tokenizer)
    if settings.worker_dns is not None:
        state.discovery = _discovery(state, settings.worker_dns)
        state.metrics.registry.register(state.discovery.collector())
    hold = HoldSettings(
        slots=settings.queue_slots,
        max_wait_ms=settings.queue_max_wait_s * 1000.0,
        window=settings.queue_window,
        bind_ratio=settings.queue_bind_ratio,
        free_at_first_token=settings.queue_free_at == "first_token",
        free_at_last_token=settings.queue_free_at == "last_token",
    )
    if hold.enabled:
        pool = state.pool
        state.queue = DispatchQueue(
            hold,
            state.router,
            lambda: [s.url for s in pool.statuses({}) if s.healthy],  # health and breakers
            state.now_ms,
            state.metrics,
        )
    redis = None
    if settings.redis_url:
        # Separate from the load store's client: XREAD blocks for a second and snapshots are
        # large, far beyond the load store's millisecond timeouts.
        redis = connect(settings.redis_url, socket_timeout=5.0, socket_connect_timeout=1.0)
    state.snapshots = ModelSnapshots(
        settings.model_snapshot_path,
        redis,
        settings.cluster,
        state.replica_id,
        settings.snapshot_key(),
    )
    if shared and redis is not None:
        state.index_sync = IndexSync(
            redis,
            settings.cluster,
            state.replica_id,
            state.router,
            on_worker_added=lambda url: _adopt_worker(state, url),
            on_worker_removed=lambda url: _drop_worker(state, url),
            on_lag=state.metrics.index_lag_seconds.observe,
            accept_worker=lambda url: settings.accepted_worker(url, state.own_ports()),
        )
    return state


def _observe_copy_age(state: ServiceState, age_s: float) -> None:
    """kvroute_load_copy_age_seconds, for the load mirror (built before the metrics are)."""
    if state.metrics is not None:
        state.metrics.load_copy_age_seconds.observe(age_s)


def _discovery(state: ServiceState, target: str) -> WorkerDiscovery:
    """Workers from the headless Service's DNS name, added and removed as POST and DELETE
    /workers do (the allow-list included)."""
    settings = state.settings
    events = settings.worker_dns_kv_events

    async def register(url: str) -> None:
        source = event_source_for(events, url) if events is not None else None
        await register_worker(state, url, source)

    return WorkerDiscovery(
        target,
        register=register,
        unregister=lambda url: unregister_worker(state, url),
        registered=lambda: state.pool.workers.keys(),
        accept=lambda url: settings.accepted_worker(url, state.own_ports()),
        static=settings.worker_urls,
    )


def _adopt_worker(state: ServiceState, url: str) -> None:
    """Another replica registered a worker: register it here too (health decides traffic)."""
    if url not in state.pool:
        state.pool.add(url)
        asyncio.get_running_loop().create_task(state.pool.check(url))


def _drop_worker(state: ServiceState, url: str) -> None:
    """Another replica removed a worker: forget it here too."""
    if url in state.pool:
        forget_worker(state, url)


async def _restore_models(state: ServiceState) -> None:
    policy = state.router.policy
    if policy.models is None:  # a policy that learns nothing has nothing to restore
        return
    slot = await state.snapshots.restore()
    if slot is not None:
        policy.adopt_models(slot)
        log.info("loaded model snapshot %s (version %s)", state.snapshots.source, slot.version)


async def _save_models(state: ServiceState) -> None:
    slot = state.router.policy.models
    if slot is not None:
        await state.snapshots.save(slot)


async def _every(interval_s: float, action: Callable[[], Awaitable[None] | None]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            result = action()
            if result is not None:
                await result
        except Exception:  # a periodic chore must never die silently
            log.exception("periodic task failed")


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServiceState = app.state.kvroute
    settings = state.settings
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    # No cookie jar: a cookie one worker sets must not ride along on other clients' requests.
    state.session = aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
    )
    if state.discovery is not None:  # the workers the Service has now, before serving
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.discovery.refresh(), settings.health_timeout_s + 5.0)
    await state.store.start(state.pool.urls())  # with Redis: the loads copied before serving
    await _restore_models(state)
    await asyncio.wait_for(state.pool.check_all(), settings.health_timeout_s + 1.0)
    state.pool.warn_at_start()
    if state.kv_discovery is not None:  # the publishers the workers name, before serving
        with contextlib.suppress(TimeoutError):
            found = state.kv_discovery.check_all(state.pool.healthy_urls())
            await asyncio.wait_for(found, 5.0)

    def trim() -> None:
        state.router.maybe_trim(state.now_ms())

    tasks = [
        asyncio.create_task(state.pool.run(settings.health_interval_s), name="health"),
        asyncio.create_task(_every(1.0, trim), name="trim"),
    ]
    if state.worker_load is not None:
        healthy = state.pool.healthy_urls
        tasks.append(
            asyncio.create_task(
                state.worker_load.run(healthy, settings.worker_metrics_s), name="worker-metrics"
            )
        )
    if state.discovery is not None:
        tasks.append(
            asyncio.create_task(
                state.discovery.run(settings.worker_dns_interval_s), name="discovery"
            )
        )
    if state.kv_discovery is not None:
        tasks.append(
            asyncio.create_task(
                state.kv_discovery.run(state.pool.healthy_urls, settings.kv_events_discover_s),
                name="kv-events-discovery",
            )
        )
    if state.queue is not None:
        # Arrivals and freed slots run the queue's passes; this one catches what neither
        # does: a worker back from down or newly added, a request reaching its max wait.
        tasks.append(asyncio.create_task(_every(0.25, state.queue.pump), name="queue"))
    if state.index_sync is not None:
        state.index_sync.start()
    if state.kv_feed is not None:
        state.kv_feed.start()
    if state.snapshots.client is not None and state.snapshots.key is None:
        log.warning(
            "model snapshots are OFF: learned models are not shared through Redis nor kept "
            "across restarts, because no key signs them; set KVROUTE_MODEL_SNAPSHOT_KEY (the "
            "same secret on every replica, not the admin token) to turn them on"
        )
    if state.snapshots.enabled:
        tasks.append(
            asyncio.create_task(
                _every(settings.model_snapshot_interval_s, lambda: _save_models(state)),
                name="snapshot",
            )
        )
    where = f"{settings.control_host}:{state.control_port or settings.control_port_to_bind}"
    if settings.admin_token is None:
        log.warning(
            "control plane is OFF (no admin token): /workers, /policy and /models answer 403; "
            "start with KVROUTE_ADMIN_TOKEN or --admin-token to turn it on at %s "
            "(/metrics is served there either way)",
            where,
        )
    else:
        log.info("control plane and /metrics on %s (bearer token required)", where)
    log.info(
        "kvroute %s router %s: policy %s, %d workers, load store %s",
        __version__,
        state.replica_id,
        state.router.policy.name,
        len(state.pool.urls()),
        state.store.status()["mode"],
    )
    try:
        yield
    finally:
        state.draining = True
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if state.index_sync is not None:
            await state.index_sync.stop()
        if state.kv_feed is not None:
            await state.kv_feed.stop()
        await _save_models(state)
        await state.session.close()
        await state.store.close()
        if state.snapshots.client is not None:
            await state.snapshots.client.aclose()


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        return error_response(400, f"{field}: {first.get('msg', 'invalid')}", field=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            # Starlette's Allow names only the first route on the path; list them all.
            allowed = ", ".join(_methods_on(app, request.url.path))
            message = f"method {request.method} is not allowed on {request.url.path}; use {allowed}"
            headers = {"Allow": allowed}
        return error_response(
            exc.status_code,
            message,
            error_type="not_found" if exc.status_code == 404 else "invalid_request_error",
            headers=headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return internal_error_response()


def _methods_on(app: FastAPI, path: str) -> list[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.methods and route.path_regex.fullmatch(path):
            methods |= route.methods
    return sorted(methods)


class KVRouteApp(FastAPI):
    """FastAPI, with the proxied routes (``POST`` on ``api_data.DATA_PLANE``) answered first.

    Every proxied request would otherwise pass FastAPI's and Starlette's middleware stack,
    router and dependency machinery (``benchmarks/proxy_overhead.py`` measures what that
    costs). The fast path does what that stack does for these routes: call the handler, turn a
    ``ServiceError`` into its JSON error and anything unexpected into a logged 500.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["method"] == "POST" and not scope.get("root_path"):
                target = DATA_PLANE.get(scope["path"])
                if target is not None:
                    await self._proxy(scope, receive, send, *target)
                    return
            refusal = self._port_refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _port_refusal(self, scope: Scope) -> Response | None:
        """The control plane (and /metrics) answer on the control listener only, and the
        control plane only with an admin token configured."""
        path: str = scope["path"]
        if not path.startswith(CONTROL_PATHS):
            return None
        state: ServiceState = self.state.kvroute
        settings = state.settings
        where = f"{settings.control_host}:{state.control_port or settings.control_port_to_bind}"
        if not state.on_control_port(scope):
            return error_response(
                404,
                f"{path} is served on the control listener ({where}), not on this port",
                error_type="not_found",
            )
        if settings.admin_token is None and not path.startswith(OPS_PATHS):
            return error_response(
                403,
                "the control plane is off: start the router with an admin token "
                "(KVROUTE_ADMIN_TOKEN or --admin-token) to use /workers, /policy and /models",
                error_type="control_plane_off",
            )
        return None

    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, kind: str, path: str
    ) -> None:
        scope["app"] = self
        request = Request(scope, receive)
        response: Response
        try:
            response = await forward(self.state.kvroute, request, kind, path)
        except ServiceError as exc:
            response = exc.response()
        except Exception:
            log.exception("unexpected error on POST %s", scope["path"])
            response = internal_error_response()
        await response(scope, receive, send)


def create_app(settings: Settings) -> FastAPI:
    """The router service for ``settings``; state is built now, connections in the lifespan."""
    app = KVRouteApp(
        title="kvroute",
        version=__version__,
        lifespan=_lifespan,
        description="KV-cache-aware, learning-based router for LLM workers.",
    )
    app.state.kvroute = _build_state(settings)
    _install_error_handlers(app)
    app.include_router(data_router)
    app.include_router(control_router)
    install_ui(app)  # /ui: the live decision viewer
    install_openapi(app)
    return app
