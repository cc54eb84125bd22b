"""The embedded load store: the routing core's ``DecayedLoads`` on a clock, for one replica.

>>> import asyncio
>>> class Stopped(MonotonicClock):  # a clock at 0 s that never moves
...     def now_s(self) -> float:
...         return 0.0
>>> async def reserve_then_release() -> tuple[float, float]:
...     store = EmbeddedStore(clock=Stopped())
...     ticket = await store.reserve("w", 100.0)
...     held = (await store.read_many(["w"]))["w"]
...     await store.release(ticket)
...     return held, (await store.read_many(["w"]))["w"]
>>> asyncio.run(reserve_then_release())
(100.0, 0.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router_service.load_store.clock import Clock, MonotonicClock
from router_service.load_store.interface import Ticket
from router_service.routing.load import DecayedLoads, Reservation

__all__ = ["EmbeddedStore"]


class EmbeddedStore:
    """In process, one replica, no set-up; its operations never fail.

    ``time_scale`` > 1 runs the decay that many times faster, for emulated workers whose
    time runs faster than real time (``kvroute emulate --time-scale``).
    """

    mode = "embedded"

    def __init__(self, time_scale: float = 1.0, *, clock: Clock | None = None) -> None:
        self._loads = DecayedLoads()
        self._scale = time_scale
        self._clock = clock or MonotonicClock()

    def _now_ms(self) -> float:
        return self._clock.now_s() * 1000.0 * self._scale

    async def start(self, workers: Sequence[str] = ()) -> None:
        pass

    async def read_many(self, workers: list[str]) -> dict[str, float]:
        return self._loads.read_many(workers, self._now_ms())

    async def reserve(self, worker: str, inc_ms: float) -> Ticket:
        reservation = self._loads.reserve(worker, inc_ms, self._now_ms())
        return Ticket(worker, inc_ms, reservation.tick, "embedded")

    async def release(self, ticket: Ticket) -> None:
        reservation = Reservation(ticket.worker, ticket.inc_ms, ticket.tick)
        self._loads.release(reservation, self._now_ms())

    async def remove(self, worker: str) -> None:
        self._loads.remove(worker)

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode}

    async def close(self) -> None:
        pass
