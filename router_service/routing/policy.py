"""The one routing-policy interface, its registry, and helpers every policy shares."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvroute.registry import Registry
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
    "REGISTRY",
    "SGLANG_INDEX",
    "IndexSettings",
    "RoutingPolicy",
    "eligible",
    "ineligible_candidate",
    "make_policy",
    "number",
    "policy_factory",
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

    def adopt_models(self, slot: ModelSlot) -> None:
        """Route with ``slot``'s residual models from now on (a snapshot restored, or the
        models a swapped-out policy learned); a policy without models ignores it."""


PolicyFactory = Callable[..., RoutingPolicy]


def _builtins(registry: Registry[PolicyFactory]) -> None:
    from router_service.routing.policies import register_builtins

    register_builtins(registry)


REGISTRY: Registry[PolicyFactory] = Registry("policy", "kvroute.policies", _builtins)


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Add a policy; ``factory(rng=random.Random, **params)`` builds it. A factory may say
    ``configurable_model = True``: it takes the router's configured residual ``model`` and
    ``sharing`` (``--model``, ``KVROUTE_MODEL``)."""
    REGISTRY.register(name, factory)


def policy_names() -> list[str]:
    return REGISTRY.names()


def policy_factory(name: str) -> PolicyFactory:
    return REGISTRY.get(name)


def make_policy(name: str, rng: random.Random | None = None, **params: Any) -> RoutingPolicy:
    """Build a registered policy; unknown names and parameters fail with what is accepted."""
    factory = REGISTRY.get(name)
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
