"""Load-only policies: ``random``, ``round_robin`` and ``power_of_two``."""

from __future__ import annotations

import random
from collections.abc import Sequence

from models import ModelSlot
from router_service.routing.policy import SGLANG_INDEX, eligible, ineligible_candidate
from router_service.routing.types import (
    Candidate,
    Decision,
    Learned,
    Outcome,
    RouteRequest,
    WorkerSnapshot,
)

__all__ = ["PowerOfTwoPolicy", "RandomPolicy", "RoundRobinPolicy"]


def _plain(workers: Sequence[WorkerSnapshot], *, with_load: bool = False) -> tuple[Candidate, ...]:
    return tuple(
        Candidate(worker=w.url, eligible=True, in_flight=w.in_flight if with_load else None)
        if w.healthy
        else ineligible_candidate(w)
        for w in workers
    )


class _Stateless:
    index_settings = SGLANG_INDEX
    models = None

    def adopt_models(self, slot: ModelSlot) -> None:
        pass  # nothing learned here

    def commit(self, decision: Decision) -> None:
        pass

    def complete(self, decision: Decision, outcome: Outcome) -> Learned | None:
        return None

    def forget_worker(self, url: str) -> None:
        pass


def _request_rng(seed: int, request: RouteRequest) -> random.Random:
    """A generator derived from the policy seed and the request id.

    Keeps ``decide`` free of side effects (``/explain`` is a dry run) while staying
    reproducible: the same seed and request ids give the same choices.
    """
    return random.Random(f"{seed}/{request.request_id}")


class RandomPolicy(_Stateless):
    """Uniform over healthy workers."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self.seed = rng.getrandbits(64)

    def decide(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> Decision:
        pool = eligible(workers)
        chosen = pool[_request_rng(self.seed, request).randrange(len(pool))]
        return Decision(request.request_id, self.name, chosen.url, _plain(workers), request.units)


class RoundRobinPolicy(_Stateless):
    """Cycle through healthy workers; the counter advances only on commit."""

    name = "round_robin"

    def __init__(self, rng: random.Random) -> None:
        self.counter = 0

    def decide(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> Decision:
        pool = eligible(workers)
        chosen = pool[self.counter % len(pool)]
        return Decision(request.request_id, self.name, chosen.url, _plain(workers), request.units)

    def commit(self, decision: Decision) -> None:
        self.counter += 1


class PowerOfTwoPolicy(_Stateless):
    """Two random healthy workers; keep the one with fewer requests in flight (ties: first)."""

    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self.seed = rng.getrandbits(64)

    def decide(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> Decision:
        pool = eligible(workers)
        if len(pool) == 1:
            chosen = pool[0]
        else:
            a, b = _request_rng(self.seed, request).sample(range(len(pool)), 2)
            first, second = pool[min(a, b)], pool[max(a, b)]
            chosen = second if second.in_flight < first.in_flight else first
        return Decision(
            request.request_id,
            self.name,
            chosen.url,
            _plain(workers, with_load=True),
            request.units,
            branch="two_choices",
        )
