"""One attempt on its way: relay the worker's answer and close the decision exactly once.

Bodies pass through unchanged; streaming (SSE) responses are relayed chunk by chunk as they
arrive. Every path releases the load reservation, completes the decision (the policy learns
from successes), records the outcome for ``/explain`` and reports success or failure to the
worker's circuit breaker: success, worker error, broken stream, client disconnect.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from router_service.breaker import Verdict
from router_service.errors import ServiceError
from router_service.load_store import Ticket
from router_service.request_parsing import ParsedRequest
from router_service.routing import Decision, Outcome
from router_service.state import ServiceState

__all__ = ["SKIP_REQUEST_HEADERS", "BrokeOff", "Flight", "relay"]

log = logging.getLogger("kvroute.proxy")

# Hop-by-hop headers (RFC 9110 7.6.1: those below and any the Connection header lists) and
# framing are the proxy's own business on each side. Content-Encoding is end to end: the
# router never decodes a body (its HTTP client does not decompress), so the worker's encoding
# reaches the client with its header, and the client's Accept-Encoding reaches the worker.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
    }
)
SKIP_REQUEST_HEADERS = _HOP_BY_HOP | {"host", "content-length"}
_SKIP_RESPONSE = _HOP_BY_HOP | {"content-length", "server", "date"}


def end_to_end(headers: Any, skip: frozenset[str]) -> dict[str, str]:
    """``headers`` less ``skip`` and whatever their Connection header names."""
    items = list(headers.items())
    named = {
        token.strip().lower()
        for key, value in items
        if key.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    }
    return {k: v for k, v in items if k.lower() not in skip and k.lower() not in named}


_TAIL_CHUNKS = 4  # a stream's last chunks kept: its last events say what was cached
CacheReport = tuple[int, int | None]  # prompt tokens found cached, and of the prompt (if said)


@dataclass
class Flight:
    """One routed attempt: closes its decision exactly once."""

    state: ServiceState
    parsed: ParsedRequest
    decision: Decision
    reservation: Ticket | None
    started: float = field(default_factory=time.perf_counter)
    first_byte: float | None = None
    closed: bool = False
    on_close: Callable[[], None] | None = None  # e.g. free the request's admission slot
    queue_slot: bool = False  # holds a hold-queue slot on its worker until freed
    events_to_free: int = 0  # with free_at_last_token: SSE events after which the slot goes
    events: int = 0  # SSE data events relayed (a stream's tokens, give or take a few)
    output_tokens: int | None = None  # tokens generated, as the answer says (or its events)
    cache_report: CacheReport | None = None  # what the worker says it found cached
    # A stream's last chunks: its last events say what was cached.
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=_TAIL_CHUNKS))
    breaker_trial: int | None = None  # the circuit breaker's trial slot this attempt holds

    def free_queue_slot(self) -> None:
        """Give the hold-queue slot back (once): at the first chunk or at the end."""
        if self.queue_slot:
            self.queue_slot = False
            queue = self.state.queue
            if queue is not None:
                queue.release(self.decision.chosen)

    def first_chunk(self) -> None:
        """The worker's first streamed chunk: its prefill is done, so with the hold queue's
        ``free_at_first_token`` the slot goes back now. With ``free_at_last_token`` it goes
        when the stream has brought all tokens but the last (``stream_chunk``): one data
        event per token, and on chat streams a role-only event first (SGLang's), so the
        last decode step is running. A stream that sends several tokens per event, or none
        of ``max_new_tokens``, frees it later, at the end, never earlier. The router's
        ledger learns the prefill is done."""
        self.state.router.first_token(self.decision.decision_id, self.state.now_ms())
        queue = self.state.queue
        if not self.queue_slot or queue is None:
            return
        if queue.settings.free_at_first_token:
            self.free_queue_slot()
        elif queue.settings.free_at_last_token and _one_sequence(self.parsed.body):
            max_new = self.parsed.route.max_new_tokens
            if max_new is not None and max_new >= 2:
                self.events_to_free = max_new - 1 + (self.parsed.kind == "chat")

    def stream_chunk(self, chunk: bytes) -> None:
        """Count the stream's data events toward ``events_to_free``: ``data:`` at the start
        of a line (JSON escapes newlines, so generated text never starts one; an event split
        across chunks right inside ``data:`` goes uncounted, which only frees later)."""
        if self.events_to_free > 0:
            self.events_to_free -= chunk.count(b"\ndata:") + chunk.startswith(b"data:")
            if self.events_to_free <= 0:
                self.events_to_free = 0
                self.free_queue_slot()

    async def close(self, ok: bool, status: str, *, worker_fault: bool = False) -> None:
        """Release, learn, record. ``worker_fault`` counts against the worker's breaker; a
        failure that is not the worker's (a 4xx, the client leaving) counts for nothing, but
        frees the breaker's trial slot like every other outcome."""
        if self.closed:
            return
        self.closed = True
        self.free_queue_slot()
        if self.on_close is not None:
            self.on_close()
        state, decision = self.state, self.decision
        scale = state.settings.time_scale  # emulated workers: learn in their time
        latency_ms = (time.perf_counter() - self.started) * 1000.0 * scale
        ttft_ms = (self.first_byte - self.started) * 1000.0 * scale if self.first_byte else None
        verdict: Verdict = "success" if ok else "failure" if worker_fault else "neutral"
        state.pool.record_request(decision.chosen, verdict, trial=self.breaker_trial, reason=status)
        if self.reservation is not None:
            try:
                await state.store.release(self.reservation)
            except Exception:  # a release failure must not lose the response
                log.exception("load release failed for %s", decision.chosen)
        learned = state.router.complete(
            decision,
            Outcome(
                ok,
                latency_ms if ok else None,
                ttft_ms,
                status,
                output_tokens=self.output_tokens,
                cached_tokens=self.cache_report[0] if self.cache_report else None,
                prompt_tokens=self.cache_report[1] if self.cache_report else None,
            ),
            state.now_ms(),
        )
        record: dict[str, Any] = {
            "status": status,
            "latency_ms": round(latency_ms, 3),
            "ttft_ms": round(ttft_ms, 3) if ttft_ms is not None else None,
            "residual_target_ms": learned.residual_target_ms if learned else None,
            "model_error_ms": learned.model_error_ms if learned else None,
            "estimate_ms": learned.estimate_ms if learned else None,
        }
        state.decisions.set_outcome(decision.decision_id, record)
        metrics = state.metrics
        if metrics is not None:
            worker = decision.chosen
            metrics.requests.labels(worker, decision.policy, status).inc()
            if ok:
                metrics.latency_seconds.labels(worker).observe(latency_ms / 1000.0)
                if ttft_ms is not None:
                    metrics.ttft_seconds.labels(worker).observe(ttft_ms / 1000.0)


def state_public(flight: Flight) -> str:
    """How the client is told which worker served it (a label unless configured)."""
    return flight.state.public(flight.decision.chosen)


_MAX_USAGE_BODY = 1 << 20  # larger answers are not parsed for their token counts


def completion_tokens(body: bytes, media_type: str | None) -> int | None:
    """Tokens generated, from a JSON answer: OpenAI's ``usage.completion_tokens`` or SGLang's
    ``meta_info.completion_tokens`` (summed over a batch); None when the answer does not say.

    >>> completion_tokens(b'{"usage": {"completion_tokens": 7}}', "application/json")
    7
    >>> completion_tokens(b'[{"meta_info": {"completion_tokens": 2}}, '
    ...                   b'{"meta_info": {"completion_tokens": 3}}]', "application/json")
    5
    >>> completion_tokens(b"not json", "application/json") is None
    True
    """
    if not media_type or "json" not in media_type or len(body) > _MAX_USAGE_BODY:
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    items = answer if isinstance(answer, list) else [answer]
    total = 0
    for item in items:
        if not isinstance(item, dict):
            return None
        holder = item.get("usage") or item.get("meta_info")
        count = holder.get("completion_tokens") if isinstance(holder, dict) else None
        if type(count) is not int or count < 0:
            return None
        total += count
    return total


def _report_in(item: object) -> CacheReport | None:
    """SGLang's ``meta_info.cached_tokens`` (and ``prompt_tokens``) or OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` (and ``usage.prompt_tokens``) of one answer
    object (or stream event)."""
    if not isinstance(item, dict):
        return None
    holders = [h for h in (item.get("meta_info"), item.get("usage")) if isinstance(h, dict)]
    for holder in holders:
        count = holder.get("cached_tokens")
        if count is None:
            details = holder.get("prompt_tokens_details")
            count = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(count) is int and count >= 0:
            prompt = holder.get("prompt_tokens")
            return count, prompt if type(prompt) is int and prompt > 0 else None
    return None


def cache_report(body: bytes, media_type: str | None) -> CacheReport | None:
    """Prompt tokens the worker found cached, and the prompt's tokens, from a JSON answer for
    one prompt; None when it does not say (an engine without cache reports).

    >>> cache_report(b'{"meta_info": {"cached_tokens": 96, "prompt_tokens": 120}}', "json")
    (96, 120)
    >>> cache_report(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 64}}}', "json")
    (64, None)
    >>> cache_report(b'{"usage": {"prompt_tokens": 80}}', "application/json") is None
    True
    """
    if not media_type or "json" not in media_type or len(body) > _MAX_USAGE_BODY:
        return None
    try:
        return _report_in(json.loads(body))
    except ValueError:
        return None


def stream_cache_report(tail: bytes) -> CacheReport | None:
    r"""The cache report of a stream's last event that has one (SGLang's ``/generate`` events
    carry ``meta_info``; OpenAI streams only a final ``usage``, when asked for).

    >>> stream_cache_report(b'data: {"meta_info": {"cached_tokens": 5}}\n\n'
    ...                     b'data: {"meta_info": {"cached_tokens": 7}}\n\ndata: [DONE]\n\n')
    (7, None)
    >>> stream_cache_report(b'data: {"choices": []}\n\ndata: [DONE]\n\n') is None
    True
    """
    for line in reversed(tail.split(b"\n")):
        if not line.startswith(b"data:") or b"cached_tokens" not in line:
            continue
        try:
            report = _report_in(json.loads(line[5:]))
        except ValueError:
            continue
        if report is not None:
            return report
    return None


def _one_sequence(body: dict[str, Any]) -> bool:
    """One generated sequence per stream: no batch of prompts, no ``n`` or ``best_of`` > 1
    (their events interleave several sequences, so counting them would free a slot early)."""
    params = body.get("sampling_params")
    sources = (body, params) if isinstance(params, dict) else (body,)
    if any(src.get(name) not in (None, 1) for src in sources for name in ("n", "best_of")):
        return False
    if isinstance(body.get("text"), list):
        return False
    for batch in (body.get("input_ids"), body.get("prompt")):  # a list of prompts
        if isinstance(batch, list) and batch and isinstance(batch[0], (list, str)):
            return False
    return True


class BrokeOff(ServiceError):
    """The worker's answer broke off before any of it reached the client (a non-streamed
    body is read whole first): another worker may answer it."""


async def relay(
    flight: Flight, upstream: aiohttp.ClientResponse, headers: dict[str, str]
) -> Response:
    """The client's response: the whole body, or a stream of the worker's chunks.

    A non-streamed body that breaks off raises ``BrokeOff`` (the caller retries it); a stream
    that breaks off after its first chunk ends with an SSE error event.
    """
    out_headers = end_to_end(upstream.headers, _SKIP_RESPONSE)
    out_headers.update(headers)
    media_type = upstream.headers.get("content-type")
    ok = upstream.status < 400
    status = "ok" if ok else f"http_{upstream.status}"
    if not (flight.parsed.stream and ok):
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            upstream.release()
            await flight.close(False, "upstream_broken", worker_fault=True)
            # An answer cut short is retried elsewhere; an error answer, or one cut by the
            # request's own timeout (the worker may still be generating it), is not.
            retry = ok and not isinstance(exc, TimeoutError)
            raise (BrokeOff if retry else ServiceError)(
                502,
                f"worker {state_public(flight)} broke off: {type(exc).__name__}",
                error_type="upstream_unavailable",
            ) from None
        upstream.release()
        flight.first_byte = flight.first_byte or time.perf_counter()
        if ok:
            flight.output_tokens = completion_tokens(body, media_type)
            if _one_sequence(flight.parsed.body):
                flight.cache_report = cache_report(body, media_type)
        await flight.close(ok, status, worker_fault=upstream.status >= 500)
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


async def _stream(flight: Flight, upstream: aiohttp.ClientResponse) -> AsyncGenerator[bytes]:
    completed = False
    try:
        async for chunk in upstream.content.iter_any():
            if flight.first_byte is None:
                flight.first_byte = time.perf_counter()
                flight.first_chunk()
            flight.events += chunk.count(b"\ndata:") + chunk.startswith(b"data:")
            if flight.events_to_free:
                flight.stream_chunk(chunk)
            flight.tail.append(chunk)
            yield chunk
        completed = True
        # One event per token, less the closing [DONE] (and a chat stream's role-only event).
        extra = 1 + (flight.parsed.kind == "chat")
        flight.output_tokens = max(0, flight.events - extra)
        if _one_sequence(flight.parsed.body):
            flight.cache_report = stream_cache_report(b"".join(flight.tail))
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        # Bytes already reached the client, so no retry: end the stream with an SSE error
        # event the client can see (and no [DONE]: the answer is incomplete).
        message = f"worker {state_public(flight)} broke off mid-stream: {type(exc).__name__}"
        event = {"error": {"message": message, "type": "upstream_broken", "code": 502}}
        yield f"data: {json.dumps(event)}\n\n".encode()
        await flight.close(False, "upstream_broken", worker_fault=True)
    finally:
        if completed:
            await flight.close(True, "ok")
