"""``PendingOps``: a replica's load operations Redis does not hold yet, and their sums."""

from __future__ import annotations

from router_service.load_store.interface import Ticket
from router_service.routing.load import decayed

__all__ = ["PendingOps"]


class PendingOps:
    """This replica's load operations at one stage of ``RedisMirror``, queued or in the batch
    on the wire: the operations themselves (to send, and to know whether a reservation is in
    the batch) and their per-worker sums, so a read costs O(workers), not O(operations): a
    saturated replica has hundreds pending.

    Reserved ms (with a count, so that a worker whose reservations were all cancelled reads
    exactly 0), and released ms grouped by the tick their reservation reached Redis at: a
    release subtracts ``decayed(inc, now - tick)``, which is linear in ``inc``, so one sum per
    tick is exact.

    >>> ops = PendingOps()
    >>> ops.reserve(Ticket("w", 100.0, -1, "redis")); ops.adjust("w", tick=0)
    100.0
    >>> ops.release(Ticket("w", 50.0, 10, "redis")); round(ops.adjust("w", tick=12), 3)
    53.076
    """

    __slots__ = ("released", "releases", "reserved", "reserves")

    def __init__(self) -> None:
        self.reserves: dict[int, Ticket] = {}  # by id()
        self.releases: list[Ticket] = []  # their reservations were applied
        self.reserved: dict[str, list[float]] = {}  # worker -> [ms, count]
        self.released: dict[str, dict[int, float]] = {}  # worker -> {tick: ms}

    def __bool__(self) -> bool:
        return bool(self.reserves or self.releases)

    def reserve(self, ticket: Ticket) -> None:
        self.reserves[id(ticket)] = ticket
        entry = self.reserved.get(ticket.worker)
        if entry is None:
            self.reserved[ticket.worker] = [ticket.inc_ms, 1]
        else:
            entry[0] += ticket.inc_ms
            entry[1] += 1

    def cancel(self, ticket: Ticket) -> bool:
        """Take back ``ticket``'s reservation if it is here (False if not)."""
        if self.reserves.pop(id(ticket), None) is None:
            return False
        entry = self.reserved[ticket.worker]
        entry[1] -= 1
        if entry[1] <= 0:
            del self.reserved[ticket.worker]
        else:
            entry[0] -= ticket.inc_ms
        return True

    def release(self, ticket: Ticket) -> None:
        self.releases.append(ticket)
        by_tick = self.released.setdefault(ticket.worker, {})
        by_tick[ticket.tick] = by_tick.get(ticket.tick, 0.0) + ticket.inc_ms

    def adjust(self, worker: str, tick: int) -> float:
        """What these operations add to ``worker``'s load at ``tick``."""
        entry = self.reserved.get(worker)
        out = entry[0] if entry is not None else 0.0
        by_tick = self.released.get(worker)
        if by_tick:
            for at, inc in by_tick.items():
                out -= decayed(inc, tick - at)
        return out

    def drop(self, worker: str) -> None:
        self.reserves = {k: t for k, t in self.reserves.items() if t.worker != worker}
        self.releases = [t for t in self.releases if t.worker != worker]
        self.reserved.pop(worker, None)
        self.released.pop(worker, None)
