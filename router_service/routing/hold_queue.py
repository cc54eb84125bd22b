"""A router-side queue with late binding: hold requests until a worker has a free slot.

Without it, a router decides at arrival and the request waits in the chosen worker's queue,
behind whatever was sent there before, however long. With it (``slots`` > 0), at most
``slots`` requests are in flight per worker; the rest wait in the router, and whenever a
worker has a free slot the router picks which waiting request goes there:

- **affinity**: a request whose longest cached prefix (by the router's index) covers at
  least ``bind_ratio`` of it is *bound* to the worker(s) holding that prefix and waits for
  them; any other request is *free* and goes to whichever worker has a slot first (the one
  caching the most of it, then the least busy). A free request is matched again at every
  pass, so the rest of a group follows its first request as soon as that one is placed;
- **shortest first**: among the requests a worker may take, the one with the fewest uncached
  units there goes first (short jobs stop waiting behind long ones);
- **no starvation**: a request that has waited ``max_wait_ms`` becomes free for any worker
  and goes before all others, oldest first.

Only the ``window`` oldest requests are considered per pass, which bounds a pass's cost.
Pure: no I/O, no clock, no asyncio. The service (``router_service.dispatch``) and the
simulator drive it with ``push`` / ``remove`` / ``release`` and ``assign``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router_service.routing.types import RouteRequest

__all__ = ["Held", "HoldQueue", "HoldSettings"]

Matcher = Callable[[RouteRequest], Mapping[str, int]]


@dataclass(frozen=True, slots=True)
class HoldSettings:
    """``slots`` requests in flight per worker (0: no queue, decide at arrival)."""

    slots: int = 0
    max_wait_ms: float = 20_000.0
    window: int = 64
    bind_ratio: float = 0.25
    # A slot is the worker's prefill: free it when the first token comes back (streams),
    # so decoding requests do not count; False holds it until the response ends.
    free_at_first_token: bool = True
    # Free it when one decode step is left (a stream has brought max_new_tokens - 1 tokens):
    # the next request's hand-over (HTTP, parsing) overlaps that step instead of leaving the
    # worker idle after it. For short outputs held to their end.
    free_at_last_token: bool = False

    def __post_init__(self) -> None:
        if self.slots < 0:
            raise ValueError(f"queue slots must be >= 0, got {self.slots}")
        if self.max_wait_ms <= 0:
            raise ValueError(f"queue max wait must be > 0 ms, got {self.max_wait_ms}")
        if self.window < 1:
            raise ValueError(f"queue window must be >= 1, got {self.window}")
        if not 0.0 < self.bind_ratio <= 1.0:
            raise ValueError(f"queue bind ratio must be in (0, 1], got {self.bind_ratio}")
        if self.free_at_first_token and self.free_at_last_token:
            raise ValueError("a queue slot frees at the first token or at the last, not both")

    @property
    def free_at(self) -> str:
        """``first_token``, ``last_token`` or ``end`` (the setting's name)."""
        if self.free_at_first_token:
            return "first_token"
        return "last_token" if self.free_at_last_token else "end"

    @property
    def enabled(self) -> bool:
        return self.slots > 0


@dataclass(eq=False, slots=True)
class Held:
    """One waiting request; ``ticket`` is the caller's handle (a future, a callback)."""

    request: RouteRequest
    arrived_ms: float
    ticket: Any = None
    avoid: frozenset[str] = frozenset()  # workers that already failed it (retries)
    bound: frozenset[str] = frozenset()  # workers holding its longest useful prefix
    cached: dict[str, int] = field(default_factory=dict)  # units cached per worker


class HoldQueue:
    """Waiting requests in arrival order and the busy slots per worker."""

    def __init__(self, settings: HoldSettings) -> None:
        if not settings.enabled:
            raise ValueError("a hold queue needs slots >= 1")
        self.settings = settings
        self.waiting: list[Held] = []
        self.busy: dict[str, int] = {}
        self.dispatched = 0
        self.aged = 0  # dispatched after max_wait_ms, to any worker

    def __len__(self) -> int:
        return len(self.waiting)

    def push(self, held: Held) -> None:
        self.waiting.append(held)

    def remove(self, held: Held) -> bool:
        """Drop a request that stopped waiting (its client left); False if not waiting."""
        try:
            self.waiting.remove(held)
        except ValueError:
            return False
        return True

    def release(self, worker: str) -> None:
        """A request sent to ``worker`` finished (or failed): its slot is free."""
        left = self.busy.get(worker, 0) - 1
        if left > 0:
            self.busy[worker] = left
        else:
            self.busy.pop(worker, None)

    def forget(self, worker: str) -> None:
        """``worker`` left the fleet: its slots go (late releases for it change nothing)."""
        self.busy.pop(worker, None)

    def assign(
        self,
        workers: Sequence[str],
        now_ms: float,
        match: Matcher,
        place: Callable[[RouteRequest, str, float], None] | None = None,
    ) -> list[tuple[Held, str]]:
        """Give free slots of ``workers`` (the healthy ones, in order) to waiting requests.

        Returns (request, worker) in the order they were picked; their slots are taken.
        ``match(request)`` is the router index's cached units per worker; ``place(request,
        worker, now_ms)`` is called at each pick, before the next, so that it can record the pick in
        that index (the rest of a new group then binds to the same worker).
        """
        out: list[tuple[Held, str]] = []
        if not workers:
            return out
        settings, busy = self.settings, self.busy
        healthy = frozenset(workers)
        rank = {w: i for i, w in enumerate(workers)}
        while self.waiting:
            free = [w for w in workers if busy.get(w, 0) < settings.slots]
            if not free:
                break
            best: tuple[tuple[float, float, float, int], int, str] | None = None
            for i, held in enumerate(self.waiting[: settings.window]):
                aged = now_ms - held.arrived_ms >= settings.max_wait_ms
                usable = healthy - held.avoid if held.avoid else healthy
                if not held.bound or not held.bound <= usable:
                    self._bind(held, match, usable)
                if aged or not held.bound:
                    takers = [w for w in free if w in usable]
                else:
                    takers = [w for w in free if w in held.bound]
                for w in takers:
                    uncached = held.request.units - held.cached.get(w, 0)
                    if aged:  # before everything else, oldest first
                        key = (0.0, held.arrived_ms, float(uncached), rank[w])
                    else:
                        key = (1.0, float(uncached), float(busy.get(w, 0)), rank[w])
                    if best is None or key < best[0]:
                        best = (key, i, w)
            if best is None:
                break  # every request in the window waits for a busy worker
            _, i, worker = best
            held = self.waiting.pop(i)
            busy[worker] = busy.get(worker, 0) + 1
            self.dispatched += 1
            if now_ms - held.arrived_ms >= settings.max_wait_ms:
                self.aged += 1
            out.append((held, worker))
            if place is not None:
                place(held.request, worker, now_ms)
        return out

    def _bind(self, held: Held, match: Matcher, healthy: frozenset[str]) -> None:
        cached = {w: n for w, n in match(held.request).items() if w in healthy}
        held.cached = cached
        top = max(cached.values(), default=0)
        if top > 0 and top >= self.settings.bind_ratio * held.request.units:
            held.bound = frozenset(w for w, n in cached.items() if n == top)
        else:
            held.bound = frozenset()
