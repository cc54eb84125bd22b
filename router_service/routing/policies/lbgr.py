"""``lbgr``: the paper's learning-based greedy routing (DESIGN 3.1).

For every healthy worker: ``base = max(1, a + b_c * cached/1000 + b_u * uncached/1000)`` ms,
``pred = max(1, base + alpha * queue + residual)``; the argmin wins, and a worker must beat
the incumbent by more than ``margin_ms`` to take over (ties keep the first). The chosen
worker's load is reserved by ``base``. On completion the worker's residual model learns
``max(1, latency - (base + alpha * queue_at_route))``. Defaults are the paper code's
(``sgl-router/src/router.rs``: a = 0, b_c = 0, b_u = 1000, alpha = 1).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from models import ModelSlot, ModelSpec
from router_service.routing.features import residual_features
from router_service.routing.policy import PAPER_INDEX, eligible, ineligible_candidate, number
from router_service.routing.types import (
    Candidate,
    Decision,
    Learned,
    ModelInfo,
    Outcome,
    RouteRequest,
    WorkerSnapshot,
)

__all__ = ["LBGRPolicy"]

_NO_FEATURES: dict[str, float] = {}


class LBGRPolicy:
    """Greedy on predicted end-to-end latency, with one residual model per worker."""

    name = "lbgr"
    index_settings = PAPER_INDEX

    def __init__(
        self,
        rng: random.Random,
        model: str | Mapping[str, Any] | ModelSpec = "ewmean",
        a_ms: float = 0.0,
        b_cached_ms: float = 0.0,
        b_uncached_ms: float = 1000.0,
        alpha: float = 1.0,
        margin_ms: float = 1.0,
        sharing: str = "per_worker",
    ) -> None:
        self.a_ms = number("a_ms", a_ms)
        self.b_cached_ms = number("b_cached_ms", b_cached_ms)
        self.b_uncached_ms = number("b_uncached_ms", b_uncached_ms)
        self.alpha = number("alpha", alpha)
        self.margin_ms = number("margin_ms", margin_ms)
        self.models = ModelSlot(model, sharing=sharing)

    def base_ms(self, cached: int, uncached: int) -> float:
        return max(
            1.0,
            self.a_ms + self.b_cached_ms * cached / 1000.0 + self.b_uncached_ms * uncached / 1000.0,
        )

    def decide(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> Decision:
        eligible(workers)
        total = request.units
        best: Candidate | None = None
        best_features: dict[str, float] | None = None
        candidates: list[Candidate] = []
        models = self.models
        with_features = models.needs_features  # ewmean/none ignore them: skip the dicts
        for w in workers:
            if not w.healthy:
                candidates.append(ineligible_candidate(w))
                continue
            base = self.base_ms(w.cached, total - w.cached)
            estimate = base + self.alpha * w.queue_ms
            features = residual_features(request, w, estimate) if with_features else _NO_FEATURES
            residual = models.predict(w.url, features)
            predicted = max(1.0, estimate + residual)
            cand = Candidate(
                worker=w.url,
                eligible=True,
                cached=w.cached,
                uncached=total - w.cached,
                base_ms=base,
                queue_ms=w.queue_ms,
                residual_ms=residual,
                predicted_ms=predicted,
                in_flight=w.in_flight,
            )
            candidates.append(cand)
            if best is None or predicted < best.predicted_ms - self.margin_ms:  # type: ignore[operator]
                best, best_features = cand, features
        assert best is not None  # eligible() raised otherwise
        return Decision(
            request.request_id,
            self.name,
            best.worker,
            tuple(candidates),
            total,
            reserve_ms=best.base_ms,
            model=ModelInfo(self.models.kind_for(best.worker), self.models.version),
            branch="argmin",
            features=best_features,
        )

    def commit(self, decision: Decision) -> None:
        pass

    def complete(self, decision: Decision, outcome: Outcome) -> Learned | None:
        if not outcome.ok or outcome.latency_ms is None:
            return None
        cand = decision.candidate(decision.chosen)
        assert cand.base_ms is not None
        assert cand.queue_ms is not None
        target = max(1.0, outcome.latency_ms - (cand.base_ms + self.alpha * cand.queue_ms))
        error = self.models.learn(decision.chosen, decision.features or {}, target)
        return Learned(residual_target_ms=target, model_error_ms=error)

    def forget_worker(self, url: str) -> None:
        self.models.forget_worker(url)
