"""The data plane: route a request, forward it to the chosen worker, record the outcome.

Bodies pass through unchanged (the router parses only what it routes on); streaming (SSE)
responses are relayed chunk by chunk as they arrive. Every path releases the load
reservation and closes the decision exactly once: success, worker error, client disconnect.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from router_service.errors import ServiceError
from router_service.load_store import StoreReservation
from router_service.request_parsing import ParsedRequest, load_json, parse_body
from router_service.routing import Decision, NoEligibleWorker, Outcome
from router_service.state import ServiceState

__all__ = ["forward", "read_body", "route_only"]

log = logging.getLogger("kvroute.proxy")

# Hop-by-hop and framing headers are the proxy's own business on each side.
_SKIP_REQUEST = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "proxy-connection",
    "accept-encoding",
}
_SKIP_RESPONSE = {
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-encoding",
    "server",
    "date",
}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (checked while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServiceError(
            413,
            f"request body is {declared} bytes; the limit is {limit}",
            field="body",
            error_type="request_too_large",
        )
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ServiceError(
                    413,
                    f"request body exceeds the limit of {limit} bytes",
                    field="body",
                    error_type="request_too_large",
                )
            chunks.append(chunk)
    except ClientDisconnect:
        raise ServiceError(400, "client disconnected while sending the body") from None
    return b"".join(chunks)


@dataclass
class _Flight:
    """One routed request on its way: closes its decision exactly once."""

    state: ServiceState
    parsed: ParsedRequest
    decision: Decision
    reservation: StoreReservation | None
    started: float = field(default_factory=time.perf_counter)
    first_byte: float | None = None
    closed: bool = False

    async def close(self, ok: bool, status: str) -> None:
        if self.closed:
            return
        self.closed = True
        state, decision = self.state, self.decision
        now = time.perf_counter()
        latency_ms = (now - self.started) * 1000.0
        ttft_ms = (self.first_byte - self.started) * 1000.0 if self.first_byte else None
        if self.reservation is not None:
            try:
                await state.store.release(self.reservation)
            except Exception:  # a release failure must not lose the response
                log.exception("load release failed for %s", decision.chosen)
        learned = state.router.complete(
            decision, Outcome(ok, latency_ms if ok else None, ttft_ms, status)
        )
        outcome: dict[str, Any] = {
            "status": status,
            "latency_ms": round(latency_ms, 3),
            "ttft_ms": round(ttft_ms, 3) if ttft_ms is not None else None,
            "residual_target_ms": learned.residual_target_ms if learned else None,
            "model_error_ms": learned.model_error_ms if learned else None,
        }
        state.decisions.set_outcome(decision.decision_id, outcome)
        metrics = state.metrics
        if metrics is not None:
            worker = decision.chosen
            metrics.requests.labels(worker, decision.policy, status).inc()
            if ok:
                metrics.latency_seconds.labels(worker).observe(latency_ms / 1000.0)
                if ttft_ms is not None:
                    metrics.ttft_seconds.labels(worker).observe(ttft_ms / 1000.0)


def route_only(state: ServiceState, parsed: ParsedRequest, statuses: list[Any]) -> Decision:
    """Decide (no side effects); 503 when no worker can take the request."""
    try:
        return state.router.decide(parsed.route, statuses)
    except NoEligibleWorker as exc:
        raise ServiceError(
            503,
            f"no worker can take the request: {exc}",
            error_type="no_healthy_worker",
            headers={"Retry-After": "1"},
        ) from None


async def forward(state: ServiceState, request: Request, kind: str, path: str) -> Response:
    """Route one data-plane request and relay the worker's answer."""
    raw = await read_body(request, state.settings.max_body_bytes)
    parsed = parse_body(load_json(raw), kind, state.new_request_id())
    statuses = await state.worker_statuses()
    started = time.perf_counter()
    decision = route_only(state, parsed, statuses)
    now_ms = state.now_ms()
    state.router.commit(parsed.route, decision, now_ms)
    if state.index_sync is not None:
        index_key = state.router.index_key(parsed.route)
        if isinstance(index_key, str):  # block digests: always a str with index sync on
            state.index_sync.publish_insert(decision.chosen, index_key, now_ms)
    _count_units(state, decision, parsed)
    if state.metrics is not None:
        state.metrics.decision_seconds.labels(decision.policy).observe(
            time.perf_counter() - started
        )
    reservation = None
    if decision.reserve_ms is not None:
        reservation = await state.store.reserve(decision.chosen, decision.reserve_ms)
    state.decisions.add(decision, replica_id=state.replica_id)
    flight = _Flight(state, parsed, decision, reservation, started=started)
    headers = {"X-KVRoute-Decision-Id": decision.decision_id, "X-KVRoute-Worker": decision.chosen}
    try:
        upstream = await _send(state, request, decision.chosen, path, raw)
    except ServiceError as exc:
        await flight.close(False, exc.error_type)
        exc.headers.update(headers)
        raise
    except BaseException:
        await flight.close(False, "cancelled")
        raise
    return await _relay(flight, upstream, headers)


def _count_units(state: ServiceState, decision: Decision, parsed: ParsedRequest) -> None:
    """Router-side hit estimate: units routed vs units the index predicted cached."""
    chosen = decision.chosen
    cand = next((c for c in decision.candidates if c.worker == chosen), None)
    units = parsed.route.units
    state.prompt_units[chosen] = state.prompt_units.get(chosen, 0) + units
    cached = cand.cached if cand is not None and cand.cached is not None else None
    if cached is None:
        cached = state.router.cached_for(parsed.route, chosen)
    state.cached_units[chosen] = state.cached_units.get(chosen, 0) + cached
    if state.metrics is not None:
        state.metrics.prompt_units.labels(chosen).inc(units)
        state.metrics.cached_units.labels(chosen).inc(cached)


async def _send(
    state: ServiceState, request: Request, worker: str, path: str, raw: bytes
) -> aiohttp.ClientResponse:
    settings = state.settings
    url = worker + path
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_REQUEST}
    timeout = aiohttp.ClientTimeout(
        total=settings.request_timeout_s, sock_connect=settings.connect_timeout_s
    )
    try:
        return await state.http().post(url, data=raw, headers=headers, timeout=timeout)
    except TimeoutError:
        raise ServiceError(
            504, f"worker {url} did not answer within the timeout", error_type="upstream_timeout"
        ) from None
    except (aiohttp.ClientError, OSError) as exc:
        state.pool.record_failure(worker, f"connection failed: {type(exc).__name__}")
        raise ServiceError(
            502,
            f"worker {url} is unreachable: {type(exc).__name__}: {exc}",
            error_type="upstream_unavailable",
        ) from None


async def _relay(
    flight: _Flight, upstream: aiohttp.ClientResponse, headers: dict[str, str]
) -> Response:
    out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP_RESPONSE}
    out_headers.update(headers)
    media_type = upstream.headers.get("content-type")
    ok = upstream.status < 400
    status = "ok" if ok else f"http_{upstream.status}"
    if not (flight.parsed.stream and ok):
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            upstream.release()
            await flight.close(False, "upstream_broken")
            raise ServiceError(
                502,
                f"worker {flight.decision.chosen} broke off: {exc}",
                error_type="upstream_unavailable",
            ) from None
        upstream.release()
        flight.first_byte = flight.first_byte or time.perf_counter()
        await flight.close(ok, status)
        return Response(
            body, status_code=upstream.status, headers=out_headers, media_type=media_type
        )
    chunks = _stream(flight, upstream)

    async def finish() -> None:
        await chunks.aclose()
        upstream.release()
        await flight.close(False, "client_disconnected")  # no-op when the stream completed

    return StreamingResponse(
        chunks,
        status_code=upstream.status,
        headers=out_headers,
        media_type=media_type,
        background=BackgroundTask(finish),
    )


async def _stream(flight: _Flight, upstream: aiohttp.ClientResponse) -> AsyncGenerator[bytes]:
    completed = False
    try:
        async for chunk in upstream.content.iter_any():
            if flight.first_byte is None:
                flight.first_byte = time.perf_counter()
            yield chunk
        completed = True
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        # Bytes already reached the client: end the stream with an SSE error event.
        message = f"worker {flight.decision.chosen} broke off mid-stream: {type(exc).__name__}"
        event = {"error": {"message": message, "type": "upstream_broken"}}
        yield f"data: {json.dumps(event)}\n\n".encode()
        await flight.close(False, "upstream_broken")
    finally:
        if completed:
            await flight.close(True, "ok")
