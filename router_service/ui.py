"""``/ui``: a live view of the router's decisions, served by the router itself.

Plain files in ``router_service/ui/`` (HTML, CSS, one script; no build step, nothing fetched
from elsewhere) and two read-only endpoints:

- ``GET /ui/events``: server-sent events. ``hello`` (policy, model, workers, the recent
  decisions and the per-worker history), then ``decision`` and ``outcome`` as they happen, and
  ``stats`` every second (the history's newest second, the model's rolling error).
- ``GET /ui/state``: the ``hello`` payload as JSON.

What a caller sees follows ``/explain``'s rules: with the admin token
(``Authorization: Bearer ...``) everything; without it, workers by label (unless the router
exposes URLs) and none of the per-worker figures that tell what a worker caches or carries
(``cached``, ``queue_ms``, ``in_flight``...; docs/explain.md). Prompt text is never shown unless
prompt logging is on (``KVROUTE_LOG_PROMPTS``), and then to admin callers only.

The feed costs the request path one append per decision and outcome, and keeps the last
``RECENT`` decisions and ``HISTORY_S`` seconds of per-worker figures: requests routed, the
router's estimate of their cached share, in flight, and the queue term of the latest decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from router_service.api_control import is_admin
from router_service.api_data import _CACHE_DETAIL as CACHE_DETAIL  # /explain's rule, shared
from router_service.errors import ServiceError
from router_service.routing import Decision, RouteRequest
from router_service.state import ServiceState

__all__ = ["CACHE_DETAIL", "HISTORY_S", "RECENT", "UiFeed", "install_ui"]

STATIC_DIR = Path(__file__).with_name("ui")
FILES = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}
# The page loads nothing but its own files.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
RECENT = 200  # decisions kept for a viewer that connects
HISTORY_S = 300  # seconds of per-worker history
PROMPT_CHARS = 500  # of a prompt, when prompt logging is on
QUEUE_SIZE = 2000  # events waiting for one viewer; past that it misses some (and is told)


class _Entry:
    __slots__ = ("decision", "extra", "outcome", "prompt", "t")

    def __init__(self, t: float, decision: Decision, extra: dict[str, Any], prompt: str | None):
        self.t, self.decision, self.extra, self.prompt = t, decision, extra, prompt
        self.outcome: dict[str, Any] | None = None


class UiFeed:
    """Recent decisions, per-worker history and the viewers' event queues (a ``DecisionFeed``)."""

    def __init__(self, state: ServiceState, clock: Callable[[], float] = time.time) -> None:
        self.state = state
        self.clock = clock
        self.recent: OrderedDict[str, _Entry] = OrderedDict()
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_S)
        self.viewers: set[asyncio.Queue[tuple[str, str]]] = set()
        self._second = int(clock())
        self._routed: Counter[str] = Counter()
        self._cached: Counter[str] = Counter()
        self._units: Counter[str] = Counter()
        self._queue_ms: dict[str, float] = {}

    # -- fed by DecisionLog, on the request path: keep it to appends --------------------------
    def decided(
        self, decision: Decision, extra: dict[str, Any], route: RouteRequest | None
    ) -> None:
        now = self.clock()
        self.roll(now)
        for cand in decision.candidates:
            if cand.queue_ms is not None:
                self._queue_ms[cand.worker] = cand.queue_ms
            if cand.worker == decision.chosen:
                self._routed[cand.worker] += 1
                if cand.cached is not None and cand.uncached is not None:
                    self._cached[cand.worker] += cand.cached
                    self._units[cand.worker] += cand.cached + cand.uncached
        prompt = None
        if route is not None and self.state.settings.log_prompts:
            prompt = _prompt_text(route)
        self.recent[decision.decision_id] = _Entry(now, decision, extra, prompt)
        if len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        self._notify("decision", decision.decision_id)

    def finished(self, decision_id: str, outcome: dict[str, Any]) -> None:
        entry = self.recent.get(decision_id)
        if entry is not None:
            entry.outcome = outcome
            self._notify("outcome", decision_id)

    def _notify(self, kind: str, decision_id: str) -> None:
        for queue in self.viewers:
            with contextlib.suppress(asyncio.QueueFull):  # a slow viewer misses events
                queue.put_nowait((kind, decision_id))

    # -- the per-second history ----------------------------------------------------------------
    def roll(self, now: float) -> None:
        """Close the current second (and start the one ``now`` is in) once it has passed."""
        second = int(now)
        if second <= self._second:
            return
        in_flight = self.state.router.in_flight
        workers = {}
        for url in self.state.pool.urls():
            units = self._units.get(url, 0)
            workers[url] = {
                "routed": self._routed.get(url, 0),
                "hit_rate": self._cached.get(url, 0) / units if units else None,
                "in_flight": in_flight.get(url, 0),
                "queue_ms": self._queue_ms.get(url),
            }
        self.history.append({"t": self._second, "workers": workers})
        self._second = second
        self._routed.clear()
        self._cached.clear()
        self._units.clear()

    # -- what a viewer sees --------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue[tuple[str, str]]:
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue(QUEUE_SIZE)
        self.viewers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[tuple[str, str]]) -> None:
        self.viewers.discard(queue)

    def entry(self, decision_id: str, admin: bool) -> dict[str, Any] | None:
        """One decision as the viewer may see it (``None`` once aged out)."""
        item = self.recent.get(decision_id)
        if item is None:
            return None
        record = {
            **item.decision.to_dict(),
            **item.extra,
            "t": item.t,
            "outcome": item.outcome,
            "prompt": item.prompt if admin else None,
        }
        return record if admin else self._redacted(record)

    def _redacted(self, record: dict[str, Any]) -> dict[str, Any]:
        name = self.state.public
        candidates = [
            {**c, **dict.fromkeys(CACHE_DETAIL), "worker": name(c["worker"])}
            for c in record["candidates"]
        ]
        return {
            **record,
            "candidates": candidates,
            "chosen": name(record["chosen"]),
            "reserve_ms": None,
        }

    def samples(self, admin: bool, after: int | None = None) -> list[dict[str, Any]]:
        """The history (its seconds after ``after``); without admin, requests routed only."""
        rows = [row for row in self.history if after is None or row["t"] > after]
        if admin:
            return rows
        name = self.state.public
        return [
            {
                "t": row["t"],
                "workers": {
                    name(url): {
                        "routed": w["routed"],
                        "hit_rate": None,
                        "in_flight": None,
                        "queue_ms": None,
                    }
                    for url, w in row["workers"].items()
                },
            }
            for row in rows
        ]

    def summary(self, admin: bool) -> dict[str, Any]:
        """Policy, model (and its rolling error, admin only), workers and their health."""
        state = self.state
        slot = state.model_slot()
        model = None
        if slot is not None:
            champion = slot.status()["champion"]
            model = {
                "kind": champion["spec"]["kind"],
                "version": slot.version,
                "mae_ms": champion["mae_ms"] if admin else None,
                "samples": champion["samples"] if admin else None,
            }
        name = (lambda url: url) if admin else state.public
        workers = [
            {"worker": name(w.url), "healthy": w.healthy, "circuit": w.breaker.state}
            for w in state.pool.workers.values()
        ]
        return {
            "replica_id": state.replica_id,
            "policy": state.router.policy.name,
            "model": model,
            "workers": workers,
            "admin": admin,
            "admin_configured": state.settings.admin_token is not None,
            "prompts": state.settings.log_prompts and admin,
            "time_scale": state.settings.time_scale,
            "now": self.clock(),
        }

    def hello(self, admin: bool) -> dict[str, Any]:
        decisions = [self.entry(i, admin) for i in self.recent]
        return {**self.summary(admin), "decisions": decisions, "history": self.samples(admin)}


def _prompt_text(route: RouteRequest) -> str:
    if route.tokens:
        return f"({route.units} token ids)"
    key = route.key
    return key[:PROMPT_CHARS] if isinstance(key, str) else f"({route.units} units)"


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _stream(state: ServiceState, feed: UiFeed, admin: bool) -> AsyncIterator[bytes]:
    queue = feed.subscribe()
    try:
        sent_t = feed.history[-1]["t"] if feed.history else None  # seconds the viewer has
        yield _sse("hello", feed.hello(admin))
        last_stats = time.monotonic()
        while not state.draining:
            try:
                kind, decision_id = await asyncio.wait_for(queue.get(), 1.0)
            except TimeoutError:
                kind, decision_id = "", ""
            if kind:
                record = feed.entry(decision_id, admin)
                if record is not None:
                    yield _sse(kind, record)
            if time.monotonic() - last_stats >= 1.0:
                last_stats = time.monotonic()
                feed.roll(feed.clock())
                rows = feed.samples(admin, sent_t)
                sent_t = rows[-1]["t"] if rows else sent_t
                yield _sse("stats", {**feed.summary(admin), "history": rows})
    finally:
        feed.unsubscribe(queue)


def _feed(request: Request) -> tuple[ServiceState, UiFeed]:
    state: ServiceState = request.app.state.kvroute
    feed = state.decisions.feed
    if not isinstance(feed, UiFeed):  # pragma: no cover - install_ui sets it
        raise ServiceError(503, "the /ui feed is not installed")
    return state, feed


def install_ui(app: FastAPI) -> None:
    """Serve /ui on ``app`` and feed it from the app's decision log."""
    state: ServiceState = app.state.kvroute
    state.decisions.feed = UiFeed(state)
    pages = {path: ((STATIC_DIR / name).read_bytes(), kind) for path, (name, kind) in FILES.items()}

    def page(path: str) -> Callable[[], Awaitable[Response]]:
        body, kind = pages[path]

        async def serve() -> Response:
            return Response(body, media_type=kind, headers=HEADERS)

        return serve

    for path in pages:
        app.add_api_route(path, page(path), methods=["GET"], include_in_schema=False)

    async def ui_state(request: Request) -> JSONResponse:
        _, feed = _feed(request)
        return JSONResponse(feed.hello(is_admin(request)), headers={"Cache-Control": "no-store"})

    async def ui_events(request: Request) -> StreamingResponse:
        state, feed = _feed(request)
        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        stream = _stream(state, feed, is_admin(request))
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    app.add_api_route("/ui/state", ui_state, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/events", ui_events, methods=["GET"], include_in_schema=False)
