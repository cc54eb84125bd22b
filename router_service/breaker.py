"""Per-worker circuit breakers: stop sending to a worker that keeps failing, probe it later.

States (Envoy/SMG style): *closed* (traffic flows; ``failure_threshold`` consecutive failures
open it), *open* (no traffic for ``open_s``), *half-open* (up to ``half_open_requests`` trial
requests; ``success_threshold`` successes close it, one failure opens it again). Failures are
connection errors, timeouts and 5xx answers; the data plane reports them as they happen
(passive ejection), independently of the periodic /health checks. Defaults follow
sglang-router/SMG (10 failures, 3 successes) with a shorter open window (10 s; SMG uses 60 s)
because an emulated or restarted worker usually comes back in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["BreakerSettings", "CircuitBreaker"]


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 10
    success_threshold: int = 3
    open_s: float = 10.0
    half_open_requests: int = 3


@dataclass
class CircuitBreaker:
    settings: BreakerSettings = field(default_factory=BreakerSettings)
    clock: Callable[[], float] = time.monotonic
    state: str = "closed"
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0
    trials: int = 0
    opens: int = 0

    def allows(self) -> bool:
        """Whether a request may go to the worker now (no side effects)."""
        if self.state == "open":
            return self.clock() - self.opened_at >= self.settings.open_s
        if self.state == "half_open":
            return self.trials < self.settings.half_open_requests
        return True

    def on_send(self) -> None:
        """A request is being sent: an expired open breaker moves to half-open."""
        if self.state == "open" and self.clock() - self.opened_at >= self.settings.open_s:
            self.state, self.trials, self.successes = "half_open", 0, 0
        if self.state == "half_open":
            self.trials += 1

    def record_success(self) -> None:
        self.failures = 0
        if self.state == "half_open":
            self.successes += 1
            if self.successes >= self.settings.success_threshold:
                self.state = "closed"

    def record_failure(self) -> None:
        if self.state == "half_open":
            self._open()
            return
        self.failures += 1
        if self.state == "closed" and self.failures >= self.settings.failure_threshold:
            self._open()

    def _open(self) -> None:
        self.state, self.opened_at, self.failures, self.opens = (
            "open",
            self.clock(),
            0,
            self.opens + 1,
        )

    def reason(self) -> str | None:
        if self.state == "open":
            left = max(0.0, self.settings.open_s - (self.clock() - self.opened_at))
            return f"circuit open after repeated failures (retry in {left:.1f} s)"
        if self.state == "half_open" and not self.allows():
            return "circuit half-open: trial requests in flight"
        return None
