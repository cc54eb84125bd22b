"""The fleet as the service sees it: registered workers and their health.

A worker is identified by its base URL as configured. A background task polls each worker's
``/health``; a worker turns unhealthy after ``unhealthy_after_failures`` failed checks in a row
and healthy again after ``healthy_after_successes`` good ones. The data plane reports passive
failures (connection errors) through ``record_failure`` too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from router_service.breaker import BreakerSettings, CircuitBreaker, Verdict
from router_service.routing import WorkerStatus

__all__ = ["WorkerPool", "WorkerState"]

log = logging.getLogger("kvroute.workers")


@dataclass(slots=True)
class WorkerState:
    url: str
    healthy: bool = False
    reason: str | None = "not checked yet"
    failures: int = 0
    successes: int = 0
    last_check_s: float | None = None
    added_s: float = field(default_factory=time.time)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    label: str = ""  # how client-facing answers name it (w0, w1, ...; never reused)

    def to_dict(self) -> dict[str, object]:
        return {
            "url": self.url,
            "label": self.label,
            "healthy": self.healthy,
            "reason": self.reason,
            "consecutive_failures": self.failures,
            "last_check_s": self.last_check_s,
            "circuit": self.breaker.state,
            "circuit_opens": self.breaker.opens,
        }


class WorkerPool:
    """Registered workers in the order they were added, with health state."""

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],
        *,
        timeout_s: float = 2.0,
        unhealthy_after: int = 2,
        healthy_after: int = 1,
        breaker: BreakerSettings | None = None,
    ) -> None:
        self._session = session
        self.breaker_settings = breaker or BreakerSettings()
        self.timeout_s = timeout_s
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.workers: dict[str, WorkerState] = {}
        self._labels = 0

    def __contains__(self, url: str) -> bool:
        return url in self.workers

    def urls(self) -> list[str]:
        return list(self.workers)

    def add(self, url: str) -> WorkerState:
        if url in self.workers:
            raise KeyError(url)
        label = f"w{self._labels}"
        self._labels += 1
        state = self.workers[url] = WorkerState(
            url, breaker=CircuitBreaker(self.breaker_settings), label=label
        )
        return state

    def label(self, url: str) -> str:
        """The worker's label; a URL no longer registered is "a removed worker"."""
        state = self.workers.get(url)
        return state.label if state is not None else "a removed worker"

    def remove(self, url: str) -> None:
        del self.workers[url]

    def statuses(self, queue_ms: dict[str, float]) -> list[WorkerStatus]:
        """Eligible = healthy by /health and not cut off by its circuit breaker."""
        out = []
        for s in self.workers.values():
            if s.healthy and not s.breaker.allows():
                out.append(WorkerStatus(s.url, False, s.breaker.reason(), queue_ms.get(s.url, 0.0)))
            else:
                out.append(WorkerStatus(s.url, s.healthy, s.reason, queue_ms.get(s.url, 0.0)))
        return out

    def on_send(self, url: str) -> int | None:
        """A request goes to ``url``: its breaker's trial id, if it takes a trial slot."""
        state = self.workers.get(url)
        return state.breaker.on_send() if state is not None else None

    def record_request(
        self, url: str, outcome: Verdict, *, trial: int | None = None, reason: str = ""
    ) -> None:
        """Passive outlier detection: the data plane reports each attempt's fate, every
        one of them (a trial slot is freed by whatever ends the attempt)."""
        state = self.workers.get(url)
        if state is None:
            return
        before = state.breaker.state
        state.breaker.record(trial, outcome)
        after = state.breaker.state
        if after == "open" and before != "open":
            log.warning("worker %s ejected (circuit open) after failures: %s", url, reason)
        elif after == "closed" and before != "closed":
            log.info("worker %s: circuit closed again", url)

    def healthy_urls(self) -> list[str]:
        return [s.url for s in self.workers.values() if s.healthy]

    def record_success(self, url: str) -> None:
        state = self.workers.get(url)
        if state is None:
            return
        state.failures = 0
        state.successes += 1
        if not state.healthy and state.successes >= self.healthy_after:
            state.healthy, state.reason = True, None
            log.info("worker %s is healthy", url)

    def record_failure(self, url: str, reason: str) -> None:
        state = self.workers.get(url)
        if state is None:
            return
        state.successes = 0
        state.failures += 1
        if state.healthy and state.failures >= self.unhealthy_after:
            state.healthy = False
            log.warning("worker %s is unhealthy: %s", url, reason)
        if not state.healthy:
            state.reason = reason

    async def check(self, url: str) -> bool:
        """One ``GET {url}/health``; updates the worker's state."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._session().get(f"{url}/health", timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
                reason = None if ok else f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, reason = False, f"/health failed: {type(exc).__name__}: {exc}"[:200]
        state = self.workers.get(url)
        if state is not None:
            state.last_check_s = time.time()
        if ok:
            self.record_success(url)
        else:
            self.record_failure(url, reason or "unhealthy")
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(url) for url in self.urls()))

    def warn_at_start(self) -> None:
        """After the first checks: a warning per worker that did not answer, and a loud one
        when there is no worker (or none healthy), so a router that cannot serve says so."""
        if not self.workers:
            log.warning(
                "0 workers: every request will answer 503. Give workers with --worker-urls "
                "(or KVROUTE_WORKER_URLS), or add them with POST /workers on the control plane"
            )
            return
        for state in self.workers.values():
            if not state.healthy:
                log.warning("worker %s is unreachable at start-up: %s", state.url, state.reason)
        if not self.healthy_urls():
            log.warning(
                "0 of %d workers healthy: requests answer 503 until one answers /health "
                "(checked every few seconds)",
                len(self.workers),
            )

    async def run(self, interval_s: float) -> None:
        """Poll every worker's /health every ``interval_s``; cancelled on shutdown."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all()
