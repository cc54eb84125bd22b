"""Recent routing decisions and their outcomes, for ``GET /explain/{decision_id}``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from router_service.routing import Decision

__all__ = ["DecisionLog"]


class DecisionLog:
    """A bounded ring buffer: the oldest decision goes when a new one would exceed capacity."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[Decision, dict[str, Any] | None, dict[str, Any]]]
        self._items = OrderedDict()

    def add(self, decision: Decision, **extra: Any) -> None:
        self._items[decision.decision_id] = (decision, None, extra)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def set_outcome(self, decision_id: str, outcome: dict[str, Any]) -> None:
        item = self._items.get(decision_id)
        if item is not None:
            self._items[decision_id] = (item[0], outcome, item[2])

    def get(self, decision_id: str) -> dict[str, Any] | None:
        item = self._items.get(decision_id)
        if item is None:
            return None
        decision, outcome, extra = item
        return {**decision.to_dict(), **extra, "outcome": outcome}

    def __len__(self) -> int:
        return len(self._items)
