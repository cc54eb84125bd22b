"""The data plane: admit, route, send with retries, relay.

A request that fails before any byte reached the client (connection refused or reset, a
timeout waiting for the answer, a 502/503/504 from the worker, a non-streamed answer cut
short) is retried on *another* worker with exponential backoff and jitter (sglang-router/SMG's
shape: 50 ms x 1.5, jitter 0.2), bounded by ``retry_max_attempts`` and ``retry_deadline_s``;
each attempt is its own decision (its load reservation released, its outcome recorded in
``/explain``). A stream that breaks after it started is never retried: it ends with an SSE
error event (relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from router_service.admission import Admission
from router_service.dispatch import DispatchQueue
from router_service.errors import ServiceError
from router_service.relay import SKIP_REQUEST_HEADERS, BrokeOff, Flight, end_to_end, relay
from router_service.request_parsing import ParsedRequest, load_json, parse_body
from router_service.routing import Decision, NoEligibleWorker, RouteRequest, WorkerStatus
from router_service.state import ServiceState
from router_service.tokenizer import tokenized

__all__ = ["forward", "read_body", "route_only"]

log = logging.getLogger("kvroute.proxy")

_RETRY_STATUSES = frozenset({502, 503, 504})


async def read_body(
    request: Request,
    limit: int,
    *,
    admission: Admission | None = None,
    timeout_s: float | None = None,
) -> tuple[bytes, Callable[[], None]]:
    """The request body and the release of the memory it holds in ``admission``'s budget.

    Refused with 413 past ``limit`` bytes (checked while reading), 503 when the body does not
    fit the budget of bodies in flight (a declared length is checked before anything is
    read), 408 when it has not all arrived within ``timeout_s``.
    """
    declared = request.headers.get("content-length")
    size_hint = int(declared) if declared is not None and declared.isdigit() else None
    if size_hint is not None and size_hint > limit:
        raise ServiceError(
            413,
            f"request body is {declared} bytes; the limit is {limit}",
            field="body",
            error_type="request_too_large",
        )
    releases: list[Callable[[], None]] = []

    def release() -> None:
        for undo in releases:
            undo()

    if admission is not None and size_hint:
        releases.append(admission.reserve_body(size_hint))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ServiceError(
                        413,
                        f"request body exceeds the limit of {limit} bytes",
                        field="body",
                        error_type="request_too_large",
                    )
                if admission is not None and size > (size_hint or 0):
                    releases.append(admission.reserve_body(len(chunk)))
                chunks.append(chunk)
    except ClientDisconnect:
        release()
        raise ServiceError(400, "client disconnected while sending the body") from None
    except TimeoutError:
        release()
        raise ServiceError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            field="body",
            error_type="request_timeout",
        ) from None
    except BaseException:
        release()
        raise
    return b"".join(chunks), release


def client_key(state: ServiceState, request: Request) -> str:
    """Who sent ``request``, for per-client limits: the peer's address, or behind a trusted
    proxy the X-Forwarded-For hop the nearest untrusted party added."""
    peer = request.client.host if request.client is not None else "unknown"
    trusted = state.trusted_networks
    if not trusted or not _in(peer, trusted):
        return peer
    hops = [h.strip() for h in request.headers.get("x-forwarded-for", "").split(",") if h.strip()]
    for hop in reversed(hops):
        if not _in(hop, trusted):
            return hop
    return hops[0] if hops else peer


def _in(address: str, networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)


def route_only(state: ServiceState, parsed: ParsedRequest, statuses: list[Any]) -> Decision:
    """Decide (no side effects); 503 when no worker can take the request."""
    try:
        return state.router.decide(parsed.route, statuses, state.now_ms())
    except NoEligibleWorker as exc:
        if state.settings.expose_worker_urls:
            detail = str(exc)
        else:  # the reasons name hosts and ports: the control plane's /workers has them
            detail = f"{len(statuses)} registered, none healthy" if statuses else str(exc)
        raise ServiceError(
            503,
            f"no worker can take the request: {detail}",
            error_type="no_healthy_worker",
            headers={"Retry-After": "1"},
        ) from None


class _Retryable(Exception):
    """This attempt failed before the client saw anything: another worker may succeed."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


async def forward(state: ServiceState, request: Request, kind: str, path: str) -> Response:
    """Admit, then route and send until an attempt answers or the retry budget is spent.

    The client's rate is checked first, the body read within its budget and timeout, then a
    slot taken; both are held until the response is complete: for a stream, until its last
    chunk (the final attempt's ``Flight`` frees them when it closes).
    """
    settings, admission = state.settings, state.admission
    admission.check_rate(client_key(state, request))
    raw, release_body = await read_body(
        request, settings.max_body_bytes, admission=admission, timeout_s=settings.body_timeout_s
    )
    # The slot is taken once the body is in: a slow body holds memory, never a slot.
    try:
        release_slot = admission.acquire()
    except BaseException:
        release_body()
        raise

    def release() -> None:
        release_slot()
        release_body()

    try:
        parsed = parse_body(load_json(raw), kind, state.new_request_id())
        parsed = await tokenized(state.tokenizer, parsed)
        if state.settings.log_prompts:  # off by default: prompts are user data
            log.info("request %s %s: %r", parsed.route.request_id, kind, parsed.route.key[:2000])
        response, flight = await _with_retries(state, request, parsed, path, raw)
    except BaseException:
        release()
        raise
    if flight.closed:
        release()
    else:
        flight.on_close = release
    return response


async def _with_retries(
    state: ServiceState, request: Request, parsed: ParsedRequest, path: str, raw: bytes
) -> tuple[Response, Flight]:
    settings = state.settings
    deadline = time.monotonic() + settings.retry_deadline_s
    failed: dict[str, str] = {}
    last: ServiceError | None = None
    for attempt in range(1, settings.retry_max_attempts + 1):
        try:
            return await _attempt(state, request, parsed, path, raw, attempt, failed)
        except _Retryable as exc:
            last = exc.error
            if attempt == settings.retry_max_attempts or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_backoff_s(settings.retry_backoff_ms, attempt))
        except ServiceError as exc:
            if last is not None and exc.error_type == "no_healthy_worker":
                break  # no other worker to try: the client gets the failure itself
            raise
    assert last is not None  # retry_max_attempts >= 1
    if len(failed) > 1:
        tried = ", ".join(state.public(url) for url in failed)
        last.message += f" (tried {len(failed)} workers: {tried})"
    raise last


def _backoff_s(base_ms: float, attempt: int) -> float:
    delay = base_ms * 1.5 ** (attempt - 1) / 1000.0
    return delay * random.uniform(0.8, 1.2)


async def _attempt(
    state: ServiceState,
    request: Request,
    parsed: ParsedRequest,
    path: str,
    raw: bytes,
    attempt: int,
    failed: dict[str, str],
) -> tuple[Response, Flight]:
    if failed:  # a retry: its own decision id
        route = RouteRequest(
            f"{parsed.route.request_id}-{attempt}",
            parsed.route.key,
            parsed.route.prompt_tokens,
            parsed.route.max_new_tokens,
        )
        parsed = ParsedRequest(parsed.kind, route, parsed.stream, parsed.body)
    queue, slot = state.queue, None
    if queue is not None and any(url not in failed for url in queue.healthy()):
        # The hold queue picks the worker (and when): wait for a free slot, then route there.
        slot = await _wait_for_slot(queue, request, parsed.route, frozenset(failed))
    try:
        statuses = _restrict(await state.worker_statuses(), failed, slot)
        if slot is not None and not any(s.healthy for s in statuses):
            failed[slot] = "unavailable_while_queued"  # it went down while this one waited
            raise _Retryable(
                ServiceError(
                    503,
                    f"worker {state.public(slot)} became unavailable while the request waited",
                    error_type="upstream_unavailable",
                )
            )
        flight = await _commit(state, parsed, statuses, attempt)
    except BaseException:
        if queue is not None and slot is not None:
            queue.release(slot)
        raise
    flight.queue_slot = slot is not None
    decision = flight.decision
    headers = {
        "X-KVRoute-Decision-Id": decision.decision_id,
        "X-KVRoute-Worker": state.public(decision.chosen),
    }
    try:
        upstream = await _send(state, request, decision.chosen, path, raw)
    except ServiceError as exc:
        await flight.close(False, exc.error_type, worker_fault=True)
        failed[decision.chosen] = exc.error_type
        exc.headers.update(headers)
        raise _Retryable(exc) from None
    except BaseException:
        await flight.close(False, "cancelled")
        raise
    if upstream.status in _RETRY_STATUSES:
        body = await _drain(upstream)
        await flight.close(False, f"http_{upstream.status}", worker_fault=True)
        failed[decision.chosen] = f"http_{upstream.status}"
        error = ServiceError(
            upstream.status,
            f"worker {state.public(decision.chosen)} answered {upstream.status}: {body[:200]!r}",
            error_type="upstream_unavailable",
            headers=headers,
        )
        raise _Retryable(error)
    try:
        return await relay(flight, upstream, headers), flight
    except BrokeOff as exc:  # a non-streamed answer cut short: the client has none of it
        failed[decision.chosen] = "upstream_broken"
        exc.headers.update(headers)
        raise _Retryable(exc) from None


async def _wait_for_slot(
    queue: DispatchQueue, request: Request, route: RouteRequest, avoid: frozenset[str]
) -> str:
    """The hold queue's pick for ``route``; a client that leaves meanwhile leaves the queue
    (its request is never sent) instead of holding a place it will not use."""
    turn = asyncio.ensure_future(queue.wait_turn(route, avoid))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({turn, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not turn.done():  # the client left (or this handler is cancelled): leave the queue
            turn.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await turn
    if turn.cancelled():
        raise ServiceError(400, "client disconnected while the request waited for a worker")
    return turn.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _restrict(
    statuses: list[WorkerStatus], failed: dict[str, str], only: str | None
) -> list[WorkerStatus]:
    """Workers that already failed this request are ineligible (never the same worker twice);
    with the hold queue's pick ``only``, so is every other worker (``/explain`` says why)."""
    if not failed and only is None:
        return statuses
    out = []
    for s in statuses:
        if s.url in failed:
            s = WorkerStatus(s.url, False, f"failed this request: {failed[s.url]}", s.queue_ms)
        elif only is not None and s.url != only:
            reason = f"hold queue: sent to {only}, which had a free slot first"
            s = WorkerStatus(s.url, False, reason, s.queue_ms)
        out.append(s)
    return out


async def _commit(
    state: ServiceState, parsed: ParsedRequest, statuses: list[WorkerStatus], attempt: int
) -> Flight:
    """Decide, commit, publish, reserve, record: the attempt is on its way."""
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
    trial = state.pool.on_send(decision.chosen)
    reservation = None
    try:
        if decision.reserve_ms is not None:
            reservation = await state.store.reserve(decision.chosen, decision.reserve_ms)
    except BaseException:
        state.pool.record_request(decision.chosen, "neutral", trial=trial)
        raise
    state.decisions.add(decision, parsed.route, replica_id=state.replica_id, attempt=attempt)
    return Flight(state, parsed, decision, reservation, started=started, breaker_trial=trial)


async def _drain(upstream: aiohttp.ClientResponse) -> bytes:
    try:
        return await upstream.read()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return b""
    finally:
        upstream.release()


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
    """POST to the worker; returns once its status and headers arrived (the first byte)."""
    settings = state.settings
    url = worker + path
    headers = end_to_end(request.headers, SKIP_REQUEST_HEADERS)
    # Without it the HTTP client would ask for gzip on the client's behalf.
    if not any(k.lower() == "accept-encoding" for k in headers):
        headers["Accept-Encoding"] = "identity"
    timeout = aiohttp.ClientTimeout(
        total=settings.request_timeout_s, sock_connect=settings.connect_timeout_s
    )
    try:
        # asyncio.timeout, not wait_for: no extra task per request on the hot path.
        async with asyncio.timeout(settings.first_byte_timeout_s):
            return await state.http().post(url, data=raw, headers=headers, timeout=timeout)
    except TimeoutError:
        raise ServiceError(
            504,
            f"worker {state.public(worker)} did not answer within the timeout",
            error_type="upstream_timeout",
        ) from None
    except (aiohttp.ClientError, OSError) as exc:
        if isinstance(exc, aiohttp.ClientConnectorError):
            state.pool.record_failure(worker, f"connection failed: {type(exc).__name__}")
        raise ServiceError(
            502,
            f"worker {state.public(worker)} is unreachable: {type(exc).__name__}",
            error_type="upstream_unavailable",
        ) from None
