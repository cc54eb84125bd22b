"""Admission control: what a request may use before it costs the fleet anything.

- **Requests in flight** (503 past the cap): ``max_in_flight`` when set (0: no cap), else
  ``per_worker_in_flight`` x the registered workers, so that an overload is shed with
  ``Retry-After`` before every request's latency explodes.
- **Rate per client** (429): a token bucket per client (its address, or the first
  ``X-Forwarded-For`` hop when the peer is a trusted proxy), so one client cannot starve the
  others; ``explain`` requests of callers without the admin token have their own, lower
  rate (``/explain`` is a probe of what workers cache).
- **Body bytes in flight** (503): request bodies held by the router at once, so many large
  bodies cannot take its memory; a body that does not fit is refused before it is read.

Every refusal carries ``Retry-After`` and costs nothing downstream: nothing was routed or
reserved. The clock is injectable.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from router_service.errors import ServiceError

__all__ = ["Admission", "TokenBuckets"]

_MAX_CLIENTS = 10_000  # buckets kept (least recently used dropped): bounded memory


class TokenBuckets:
    """One token bucket per key (``rate`` tokens/s, ``burst`` at most); LRU-bounded.

    >>> now = [0.0]
    >>> buckets = TokenBuckets(1.0, 2, clock=lambda: now[0])
    >>> [buckets.take("a") for _ in range(3)], buckets.take("b")
    ([0.0, 0.0, 1.0], 0.0)
    >>> now[0] = 1.0; buckets.take("a")
    0.0
    """

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = max(1, burst or math.ceil(rate))
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str) -> float:
        """Take a token for ``key``: 0.0 if one was there, else the seconds until one is."""
        now = self.clock()
        tokens, stamp = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(self.burst, tokens + (now - stamp) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens - 1.0, now)
        if len(self._buckets) > _MAX_CLIENTS:
            self._buckets.popitem(last=False)
        return 0.0


class Admission:
    def __init__(
        self,
        max_in_flight: int | None = None,
        rate_rps: float = 0.0,
        burst: int = 0,
        clock: Callable[[], float] = time.monotonic,
        *,
        per_worker_in_flight: int = 256,
        workers: Callable[[], int] = lambda: 1,
        explain_rps: float = 0.0,
        max_body_bytes_in_flight: int = 0,
    ) -> None:
        self.max_in_flight = max_in_flight  # None: per_worker_in_flight x workers; 0: no cap
        self.per_worker_in_flight = per_worker_in_flight
        self.workers = workers
        self.rate_rps = rate_rps  # per client; 0: no rate limit
        self.clock = clock
        self.in_flight = 0
        self.rejected_overload = 0
        self.rejected_rate = 0
        self.rejected_body = 0
        self._rate = TokenBuckets(rate_rps, burst, clock) if rate_rps > 0 else None
        self._explain = TokenBuckets(explain_rps, 0, clock) if explain_rps > 0 else None
        self.max_body_bytes_in_flight = max_body_bytes_in_flight  # 0: no budget
        self.body_bytes = 0

    @property
    def cap(self) -> int:
        """Requests in flight allowed now (0: no cap)."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return max(64, self.per_worker_in_flight * self.workers())

    def check_rate(self, client: str, *, explain: bool = False) -> None:
        """429 when ``client`` is past its rate (or, for ``explain``, its explain rate)."""
        for buckets, what in ((self._rate, "requests"), (self._explain if explain else None, "")):
            if buckets is None:
                continue
            wait = buckets.take(client)
            if wait > 0.0:
                self.rejected_rate += 1
                kind = what or "/explain requests"
                raise ServiceError(
                    429,
                    f"rate limit of {buckets.rate:g} {kind}/s per client exceeded",
                    error_type="rate_limited",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )

    def acquire(self) -> Callable[[], None]:
        """Take a slot or raise 503; returns the (idempotent) release."""
        cap = self.cap
        if cap and self.in_flight >= cap:
            self.rejected_overload += 1
            raise ServiceError(
                503,
                f"router overloaded: {self.in_flight} requests in flight (limit {cap}); "
                "retry shortly",
                error_type="overloaded",
                headers={"Retry-After": "1"},
            )
        self.in_flight += 1
        return self._release(lambda: setattr(self, "in_flight", self.in_flight - 1))

    def reserve_body(self, size: int) -> Callable[[], None]:
        """Count ``size`` more body bytes held, or raise 503 when they do not fit."""
        budget = self.max_body_bytes_in_flight
        if budget and self.body_bytes + size > budget:
            self.rejected_body += 1
            raise ServiceError(
                503,
                "router busy: too many request bodies in flight; retry shortly",
                error_type="overloaded",
                headers={"Retry-After": "1"},
            )
        self.body_bytes += size
        return self._release(lambda: setattr(self, "body_bytes", self.body_bytes - size))

    @staticmethod
    def _release(undo: Callable[[], None]) -> Callable[[], None]:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                undo()

        return release

    def status(self) -> dict[str, object]:
        return {
            "in_flight": self.in_flight,
            "cap": self.cap,
            "body_bytes": self.body_bytes,
            "rejected_overload": self.rejected_overload,
            "rejected_rate": self.rejected_rate,
            "rejected_body": self.rejected_body,
        }
