"""Admission control: a cap on requests in flight and an optional token bucket.

Past ``max_in_flight`` concurrent requests the router answers 503 (overloaded, retry soon);
past the token bucket's rate (``rate_rps``, bursts of ``burst``) it answers 429. Both carry
``Retry-After``. A refusal costs nothing downstream: nothing was routed or reserved.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from router_service.errors import ServiceError

__all__ = ["Admission"]


class Admission:
    def __init__(
        self,
        max_in_flight: int = 0,
        rate_rps: float = 0.0,
        burst: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_in_flight = max_in_flight  # 0: no cap
        self.rate_rps = rate_rps  # 0: no rate limit
        self.burst = max(1, burst or math.ceil(rate_rps))
        self.clock = clock
        self.in_flight = 0
        self.rejected_overload = 0
        self.rejected_rate = 0
        self._tokens = float(self.burst)
        self._refilled = clock()

    def acquire(self) -> Callable[[], None]:
        """Take a slot or raise 503/429; returns the (idempotent) release."""
        if self.max_in_flight and self.in_flight >= self.max_in_flight:
            self.rejected_overload += 1
            raise ServiceError(
                503,
                f"router overloaded: {self.in_flight} requests in flight "
                f"(limit {self.max_in_flight}); retry shortly",
                error_type="overloaded",
                headers={"Retry-After": "1"},
            )
        if self.rate_rps > 0:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.rate_rps)
            self._refilled = now
            if self._tokens < 1.0:
                self.rejected_rate += 1
                wait = math.ceil((1.0 - self._tokens) / self.rate_rps)
                raise ServiceError(
                    429,
                    f"rate limit of {self.rate_rps:g} requests/s exceeded",
                    error_type="rate_limited",
                    headers={"Retry-After": str(max(1, wait))},
                )
            self._tokens -= 1.0
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return release
