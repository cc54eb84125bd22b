"""Per-worker circuit breakers: stop sending to a worker that keeps failing, probe it later.

States (Envoy/SMG style): *closed* (traffic flows; ``failure_threshold`` consecutive failures
open it), *open* (no traffic for ``open_s``), *half-open* (up to ``half_open_requests`` trial
requests in flight; ``success_threshold`` successes close it, one failure opens it again).

Every attempt ends in one of three outcomes, and every outcome frees the trial slot it held:

- ``success``: the worker answered (2xx/3xx);
- ``failure``: the worker's fault: connection errors, timeouts, 5xx answers, a broken stream;
- ``neutral``: nobody's fault on the worker's side: a 4xx (the client's request was wrong),
  the client left, the router cancelled it. It neither closes nor opens the circuit.

A trial slot also expires after ``trial_timeout_s``: whatever happens to one request (a hung
stream, a bug that never reports), a half-open worker gets probed again, so the circuit can
never stay half-open with no slot free. The outcome of an expired trial still counts when it
comes.

The data plane reports outcomes as they happen (passive ejection), independently of the
periodic /health checks. Defaults follow sglang-router/SMG (10 failures, 3 successes) with a
shorter open window (10 s; SMG uses 60 s) because an emulated or restarted worker usually
comes back in seconds.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["BreakerSettings", "CircuitBreaker", "Verdict"]

Verdict = Literal["success", "failure", "neutral"]


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 10
    success_threshold: int = 3
    open_s: float = 10.0
    half_open_requests: int = 3
    trial_timeout_s: float = 30.0


@dataclass
class CircuitBreaker:
    """One worker's breaker; ``clock`` is injectable (seconds, monotonic).

    >>> now = [0.0]
    >>> b = CircuitBreaker(BreakerSettings(failure_threshold=1, open_s=5), clock=lambda: now[0])
    >>> b.record(b.on_send(), "failure"); b.state, b.allows()
    ('open', False)
    >>> now[0] = 5.0
    >>> trial = b.on_send(); b.state, trial is not None
    ('half_open', True)
    >>> b.record(trial, "neutral"); b.state, b.trials   # a 4xx: the slot is free again
    ('half_open', 0)
    """

    settings: BreakerSettings = field(default_factory=BreakerSettings)
    clock: Callable[[], float] = time.monotonic
    state: str = "closed"
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0
    opens: int = 0
    _trials: dict[int, float] = field(default_factory=dict)  # trial id -> sent at
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def trials(self) -> int:
        """Trial requests holding a slot now (expired ones do not)."""
        self._expire()
        return len(self._trials)

    def _expire(self) -> None:
        if self._trials:
            cutoff = self.clock() - self.settings.trial_timeout_s
            for trial, sent in list(self._trials.items()):
                if sent <= cutoff:
                    del self._trials[trial]

    def allows(self) -> bool:
        """Whether a request may go to the worker now (no side effects but expiry)."""
        if self.state == "open":
            return self.clock() - self.opened_at >= self.settings.open_s
        if self.state == "half_open":
            return self.trials < self.settings.half_open_requests
        return True

    def on_send(self) -> int | None:
        """A request is being sent: an expired open breaker moves to half-open. Returns the
        trial's id when the request takes a trial slot (give it back to ``record``)."""
        if self.state == "open" and self.clock() - self.opened_at >= self.settings.open_s:
            self.state, self.successes = "half_open", 0
            self._trials.clear()
        if self.state != "half_open":
            return None
        trial = next(self._ids)
        self._trials[trial] = self.clock()
        return trial

    def record(self, trial: int | None, outcome: Verdict) -> None:
        """An attempt ended: free its trial slot (if it held one), then count the outcome."""
        if trial is not None:
            self._trials.pop(trial, None)
        if outcome == "success":
            self._success()
        elif outcome == "failure":
            self._failure()

    def _success(self) -> None:
        self.failures = 0
        if self.state == "half_open":
            self.successes += 1
            if self.successes >= self.settings.success_threshold:
                self.state = "closed"
                self._trials.clear()

    def _failure(self) -> None:
        if self.state == "half_open":
            self._open()
            return
        self.failures += 1
        if self.state == "closed" and self.failures >= self.settings.failure_threshold:
            self._open()

    def _open(self) -> None:
        self.state, self.opened_at, self.failures = "open", self.clock(), 0
        self.opens += 1
        self._trials.clear()

    def reason(self) -> str | None:
        """Why no request may go now, or None when one may."""
        if self.allows():
            return None
        if self.state == "open":
            left = max(0.0, self.settings.open_s - (self.clock() - self.opened_at))
            return f"circuit open after repeated failures (retry in {left:.1f} s)"
        return "circuit half-open: trial requests in flight"
