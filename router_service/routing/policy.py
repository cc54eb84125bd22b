"""The one routing-policy interface, its registry, and helpers every policy shares."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

from models import ModelSlot
from router_service.routing.types import (
    Candidate,
    Decision,
    Learned,
    NoEligibleWorker,
    Outcome,
    RouteRequest,
    WorkerSnapshot,
)

__all__ = [
    "PAPER_INDEX",
    "SGLANG_INDEX",
    "IndexSettings",
    "RoutingPolicy",
    "eligible",
    "ineligible_candidate",
    "make_policy",
    "number",
    "policy_names",
    "register_policy",
]


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """How the router trims its approximate prefix index (per worker, LRU, on a timer)."""

    trim_interval_s: float
    max_units_per_worker: int


# sglang-router 0.3.2 CLI defaults (`launch_router --help`: --eviction-interval-secs 60,
# --max-tree-size 67108864). The paper quotes 120 s; the released package says 60.
SGLANG_INDEX = IndexSettings(trim_interval_s=60.0, max_units_per_worker=2**26)
# The paper's router (sgl-router of SGLang 0.4.6: eviction_interval 60, max_tree_size 2**24).
PAPER_INDEX = IndexSettings(trim_interval_s=60.0, max_units_per_worker=2**24)


class RoutingPolicy(Protocol):
    """Every policy has this shape; a new input is a new snapshot field, never a new signature.

    ``decide`` is a pure query (``/explain`` dry runs call it); ``commit`` applies the
    policy's own bookkeeping once the decision is really taken; ``complete`` feeds back the
    outcome and returns what a learning policy learned.
    """

    name: str
    index_settings: IndexSettings

    @property
    def models(self) -> ModelSlot | None:
        """The residual models of a learning policy, else None."""

    def decide(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> Decision: ...

    def commit(self, decision: Decision) -> None: ...

    def complete(self, decision: Decision, outcome: Outcome) -> Learned | None: ...

    def forget_worker(self, url: str) -> None:
        """The worker left the fleet: drop any state kept for it."""


PolicyFactory = Callable[..., RoutingPolicy]
_REGISTRY: dict[str, PolicyFactory] = {}
_ENTRY_POINT_GROUP = "kvroute.policies"


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Add a policy; ``factory(rng=random.Random, **params)`` builds it."""
    if not name or not name.strip():
        raise ValueError("policy name must not be blank")
    if name in _REGISTRY:
        raise ValueError(f"policy {name!r} is already registered")
    _REGISTRY[name] = factory


def _ensure_loaded() -> None:
    if _REGISTRY:
        return
    from router_service.routing.policies import register_builtins

    register_builtins()
    for ep in entry_points(group=_ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            register_policy(ep.name, ep.load())


def policy_names() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def make_policy(name: str, rng: random.Random | None = None, **params: Any) -> RoutingPolicy:
    """Build a registered policy; unknown names and parameters fail with what is accepted."""
    _ensure_loaded()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    try:
        return factory(rng=rng if rng is not None else random.Random(0), **params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from None


def eligible(workers: Sequence[WorkerSnapshot]) -> list[WorkerSnapshot]:
    """Healthy workers, in order; raises NoEligibleWorker when there are none."""
    ok = [w for w in workers if w.healthy]
    if not ok:
        if not workers:
            raise NoEligibleWorker("no workers are registered")
        reasons = "; ".join(f"{w.url}: {w.reason or 'unhealthy'}" for w in workers)
        raise NoEligibleWorker(f"no healthy worker ({reasons})")
    return ok


def number(name: str, value: object) -> float:
    """A numeric policy parameter; anything else (a string from JSON, null) is refused here,
    naming it, rather than failing on every later request.

    >>> number("alpha", 2)
    2.0
    >>> number("alpha", "2")
    Traceback (most recent call last):
    ValueError: alpha must be a number, got '2'
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def ineligible_candidate(worker: WorkerSnapshot) -> Candidate:
    return Candidate(worker=worker.url, eligible=False, reason=worker.reason or "unhealthy")
