"""The routing core the service and the simulator share: index, in-flight counts, policy.

No I/O and no clock of its own: callers pass worker status (health, decayed queue load read
from whichever load store they use) and the current time. ``decide`` is a pure query (the
``/explain`` dry run); ``route`` decides and commits; ``complete`` feeds back the outcome.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_ext.cache.keys import Key
from router_service.routing.block_keys import CHARS_PER_BLOCK, BlockKeys
from router_service.routing.policy import RoutingPolicy
from router_service.routing.prefix_index import PrefixIndex
from router_service.routing.types import (
    Decision,
    Learned,
    Outcome,
    RouteRequest,
    WorkerSnapshot,
    WorkerStatus,
)

__all__ = ["Router"]


class Router:
    """One router replica's routing state.

    Every policy's routing is recorded in the prefix index, so switching policies at run time
    starts warm, and ``/explain`` can show what each worker is believed to cache.
    """

    def __init__(
        self,
        policy: RoutingPolicy,
        index: PrefixIndex | None = None,
        keys: BlockKeys | None = None,
    ) -> None:
        self.policy = policy
        self.index = index if index is not None else PrefixIndex()
        # With block keys the index holds chained block digests instead of prompt units, so
        # replicas can share it (router_service.index_sync); matches are block-granular.
        self.keys = keys
        self._last_key: tuple[str, Key] = ("", "")
        self.in_flight: dict[str, int] = {}
        self.pending_units: dict[str, int] = {}  # uncached units routed, not yet completed
        # decision id -> (worker, uncached units, the policy that made it)
        self._open: dict[str, tuple[str, int, RoutingPolicy]] = {}
        self._orphans: set[str] = set()  # open decisions whose worker was removed since
        self._last_match: tuple[str, dict[str, int]] = ("", {})
        self._last_trim_ms = 0.0

    def set_policy(self, policy: RoutingPolicy) -> None:
        """Swap the policy; decisions in flight complete against the policy that made them."""
        self.policy = policy

    def snapshots(
        self, request: RouteRequest, workers: Sequence[WorkerStatus]
    ) -> list[WorkerSnapshot]:
        matched = self._match(request)
        in_flight, pending = self.in_flight, self.pending_units
        return [
            WorkerSnapshot(
                url=w.url,
                healthy=w.healthy,
                reason=w.reason,
                queue_ms=w.queue_ms,
                in_flight=in_flight.get(w.url, 0),
                cached=matched.get(w.url, 0),
                index_units=self.index_units(w.url),
                pending_units=pending.get(w.url, 0),
            )
            for w in workers
        ]

    def index_key(self, request: RouteRequest) -> Key:
        """What the index stores for ``request``: its units, or its block digests."""
        if self.keys is None:
            return request.key
        last_id, key = self._last_key
        if last_id != request.request_id:
            key = self.keys.key(request.key)
            self._last_key = (request.request_id, key)
        return key

    def _match(self, request: RouteRequest) -> dict[str, int]:
        """Cached units per worker for ``request`` (remembered for the commit that follows)."""
        _, matched = self.index.match(self.index_key(request))
        if self.keys is not None:
            keys, total = self.keys, request.units
            matched = {w: keys.units(m, total) for w, m in matched.items()}
        self._last_match = (request.request_id, matched)
        return matched

    def cached_for(self, request: RouteRequest, worker: str) -> int:
        """Units of ``request`` the index believes ``worker`` caches (reuses the last match)."""
        last_id, matched = self._last_match
        if last_id != request.request_id:
            matched = self._match(request)
        return matched.get(worker, 0)

    def cached_by_worker(self, request: RouteRequest) -> dict[str, int]:
        """Units of ``request`` the index believes each worker caches (the hold queue's
        matcher); workers caching nothing are absent."""
        return self._match(request)

    def place(self, request: RouteRequest, worker: str, now_ms: float) -> None:
        """Record in the index that ``request`` goes to ``worker`` before its decision is
        committed (the hold queue picks several requests in one pass)."""
        self.index.insert(self.index_key(request), worker, now_ms)

    def index_units(self, worker: str) -> int:
        """Prompt units the index holds for ``worker`` (block-granular with block keys)."""
        units = self.index.units(worker)
        if self.keys is None:
            return units
        return units // CHARS_PER_BLOCK * self.keys.block_units

    def decide(self, request: RouteRequest, workers: Sequence[WorkerStatus]) -> Decision:
        """The decision the router would take now; changes nothing."""
        return self.policy.decide(request, self.snapshots(request, workers))

    def commit(self, request: RouteRequest, decision: Decision, now_ms: float) -> None:
        """Apply a decision: the policy's bookkeeping, the index insert, the in-flight count."""
        chosen = decision.chosen
        uncached = request.units - self.cached_for(request, chosen)
        self.policy.commit(decision)
        self.index.insert(self.index_key(request), chosen, now_ms)
        self.in_flight[chosen] = self.in_flight.get(chosen, 0) + 1
        self.pending_units[chosen] = self.pending_units.get(chosen, 0) + uncached
        self._open[decision.decision_id] = (chosen, uncached, self.policy)

    def route(
        self, request: RouteRequest, workers: Sequence[WorkerStatus], now_ms: float
    ) -> Decision:
        decision = self.decide(request, workers)
        self.commit(request, decision, now_ms)
        return decision

    def complete(self, decision: Decision, outcome: Outcome) -> Learned | None:
        """Close a routed request; a learning policy trains on its outcome."""
        if decision.decision_id in self._orphans:  # its worker is gone: nothing to update
            self._orphans.discard(decision.decision_id)
            return None
        count = self.in_flight.get(decision.chosen, 0)
        if count > 0:
            self.in_flight[decision.chosen] = count - 1
        opened = self._open.pop(decision.decision_id, None)
        if opened is None:  # never committed here: only the current policy can judge it
            if decision.policy != self.policy.name:
                return None
            return self.policy.complete(decision, outcome)
        worker, units, policy = opened
        if worker in self.pending_units:
            self.pending_units[worker] = max(0, self.pending_units[worker] - units)
        # The policy that made the decision learns from it, even if it was swapped out since
        # (a swap that keeps the residual models hands them to the new policy).
        return policy.complete(decision, outcome)

    def maybe_trim(self, now_ms: float) -> int:
        """Trim the index when the policy's trim interval has passed; returns units dropped."""
        settings = self.policy.index_settings
        if now_ms - self._last_trim_ms < settings.trim_interval_s * 1000.0:
            return 0
        self._last_trim_ms = now_ms
        cap = settings.max_units_per_worker
        return self.index.trim(cap if self.keys is None else self.keys.index_units(cap))

    def remove_worker(self, url: str) -> None:
        """Drop a worker's index entries, in-flight count and learned state.

        Its requests still in flight become orphans: when they complete they change nothing,
        so a late outcome neither trains a model for the removed worker back into existence
        nor miscounts the in-flight requests of a worker re-added under the same URL.
        """
        orphans = [d for d, (worker, _, _) in self._open.items() if worker == url]
        for decision_id in orphans:
            del self._open[decision_id]
        self._orphans.update(orphans)
        self.index.remove_worker(url)
        self.in_flight.pop(url, None)
        self.pending_units.pop(url, None)
        self.policy.forget_worker(url)
