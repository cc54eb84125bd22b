"""Recent routing decisions and their outcomes, for ``GET /explain/{decision_id}``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from router_service.routing import Decision, RouteRequest

__all__ = ["DecisionFeed", "DecisionLog"]


class DecisionFeed(Protocol):
    """Who hears of each decision and outcome as it happens (``router_service.ui``)."""

    def decided(
        self, decision: Decision, extra: dict[str, Any], route: RouteRequest | None
    ) -> None: ...

    def finished(self, decision_id: str, outcome: dict[str, Any]) -> None: ...


class DecisionLog:
    """A bounded ring buffer: the oldest decision goes when a new one would exceed capacity."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[Decision, dict[str, Any] | None, dict[str, Any]]]
        self._items = OrderedDict()
        self.feed: DecisionFeed | None = None

    def add(self, decision: Decision, route: RouteRequest | None = None, **extra: Any) -> None:
        """Record a decision; ``route`` (the request) goes to the feed only, never stored."""
        self._items[decision.decision_id] = (decision, None, extra)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        if self.feed is not None:
            self.feed.decided(decision, extra, route)

    def set_outcome(self, decision_id: str, outcome: dict[str, Any]) -> None:
        item = self._items.get(decision_id)
        if item is not None:
            self._items[decision_id] = (item[0], outcome, item[2])
        if self.feed is not None:
            self.feed.finished(decision_id, outcome)

    def get(self, decision_id: str) -> dict[str, Any] | None:
        item = self._items.get(decision_id)
        if item is None:
            return None
        decision, outcome, extra = item
        return {**decision.to_dict(), **extra, "outcome": outcome}

    def __len__(self) -> int:
        return len(self._items)
