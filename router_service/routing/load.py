"""Decayed queue load per worker, embedded in the process (docs/design.md).

Each worker's load L (ms) decays by 31/32 every 20 ms on a global grid of ticks (half-life
about 436 ms), as the paper's router decays it on a 20 ms timer. Decay is lazy: a value and
the tick it was last brought up to date; reads decay it. A reservation adds ``inc`` and
remembers its tick; releasing subtracts ``inc * (31/32) ** ticks_since_reserve``, floored at 0,
so a request's contribution leaves the load exactly as it would have decayed anyway.

>>> store = DecayedLoads()
>>> r = store.reserve("w", 100.0, now_ms=0)
>>> round(store.read("w", now_ms=40), 3)   # two ticks
93.848
>>> _ = store.release(r, now_ms=40); store.read("w", now_ms=40)
0.0
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DECAY_FACTOR", "DECAY_TICK_MS", "DecayedLoads", "Reservation", "decayed"]

DECAY_FACTOR = 31 / 32
DECAY_TICK_MS = 20


def _tick(now_ms: float) -> int:
    return int(now_ms // DECAY_TICK_MS)


def decayed(value: float, ticks: int) -> float:
    """``value`` after ``ticks`` decay steps."""
    return value * DECAY_FACTOR**ticks if ticks > 0 else value


@dataclass(frozen=True, slots=True)
class Reservation:
    worker: str
    inc_ms: float
    tick: int


class DecayedLoads:
    """Every worker's decayed load, on the clock the caller passes (``now_ms``): the
    simulator's, or the service's through ``load_store.EmbeddedStore``. Costs nothing idle."""

    def __init__(self) -> None:
        self._loads: dict[str, tuple[float, int]] = {}

    def read(self, worker: str, now_ms: float) -> float:
        value, tick = self._loads.get(worker, (0.0, 0))
        return decayed(value, _tick(now_ms) - tick)

    def read_many(self, workers: list[str], now_ms: float) -> dict[str, float]:
        return {w: self.read(w, now_ms) for w in workers}

    def reserve(self, worker: str, inc_ms: float, now_ms: float) -> Reservation:
        tick = _tick(now_ms)
        self._loads[worker] = (self.read(worker, now_ms) + inc_ms, tick)
        return Reservation(worker, inc_ms, tick)

    def release(self, reservation: Reservation, now_ms: float) -> float:
        """Subtract the reservation's decayed remainder; returns what was subtracted."""
        worker = reservation.worker
        if worker not in self._loads:
            return 0.0
        tick = _tick(now_ms)
        remainder = decayed(reservation.inc_ms, tick - reservation.tick)
        self._loads[worker] = (max(0.0, self.read(worker, now_ms) - remainder), tick)
        return remainder

    def remove(self, worker: str) -> None:
        self._loads.pop(worker, None)
