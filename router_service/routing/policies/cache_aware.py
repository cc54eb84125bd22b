"""``cache_aware``: SGLang's router policy, the paper's main baseline (docs/design.md).

If the fleet is imbalanced (``max_load - min_load > balance_abs_threshold`` and
``max_load > balance_rel_threshold * min_load``, load = requests in flight) the least loaded
worker wins. Otherwise, with ``match_rate = matched / total``, the worker owning the deepest
match wins if ``match_rate > cache_threshold``; else, in the paper's SGLang 0.4.6 router, the
worker with the smallest tree, and in today's sglang-router (0.3.x) the least loaded worker
(observed against 0.3.2 running on emulated workers, and so documented by its successor SMG).

Units. ``matched`` and ``total`` count the request's prefix-match units (``RouteRequest.key``):
characters when the request carries text, token ids when it carries ``input_ids``. The paper's
baseline, sgl-router of SGLang 0.4.6, only ever saw text (its benchmark client sends text) and
decided on ``matched_chars / total_chars > 0.5``; so the ``paper`` preset is the paper's
baseline when the router is sent text: ``kvroute sim --prompt-format text`` and ``kvroute
bench --prompt-format text`` give every token its characters (``sim.text``). Sent token ids,
the same preset matches tokens instead, and on GSP (a shared prefix of half the tokens plus a
separator) every prompt that meets its group passes 0.5, where in characters about half fail
(each question is fresh text of its own length): ``tests/sim/test_text.py``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from models import ModelSlot
from router_service.routing.policy import (
    PAPER_INDEX,
    SGLANG_INDEX,
    IndexSettings,
    eligible,
    ineligible_candidate,
    number,
)
from router_service.routing.types import (
    Candidate,
    Decision,
    Learned,
    Outcome,
    RouteRequest,
    WorkerSnapshot,
)

__all__ = ["CACHE_AWARE_PRESETS", "CacheAwarePolicy", "CacheAwareSettings"]


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float
    index: IndexSettings
    low_match: str  # "least_load" (sglang-router 0.3.x) or "smallest_tree" (0.4.6)


CACHE_AWARE_PRESETS = {
    # sglang-router 0.3.x CLI defaults.
    "sglang": CacheAwareSettings(0.3, 64, 1.5, SGLANG_INDEX, "least_load"),
    # The paper's baseline: sgl-router of SGLang 0.4.6 (launch_router.py RouterArgs defaults).
    "paper": CacheAwareSettings(0.5, 32, 1.0001, PAPER_INDEX, "smallest_tree"),
}


class CacheAwarePolicy:
    """SGLang's cache-aware routing over the router's approximate prefix index."""

    name = "cache_aware"
    models = None

    def adopt_models(self, slot: ModelSlot) -> None:
        pass  # nothing learned here

    def __init__(
        self,
        rng: random.Random,
        preset: str = "sglang",
        cache_threshold: float | None = None,
        balance_abs_threshold: int | None = None,
        balance_rel_threshold: float | None = None,
    ) -> None:
        try:
            base = CACHE_AWARE_PRESETS[preset]
        except KeyError:
            raise ValueError(
                f"unknown cache_aware preset {preset!r}; known: {', '.join(CACHE_AWARE_PRESETS)}"
            ) from None
        self.preset = preset
        self.cache_threshold = (
            base.cache_threshold
            if cache_threshold is None
            else number("cache_threshold", cache_threshold)
        )
        self.balance_abs_threshold = (
            base.balance_abs_threshold
            if balance_abs_threshold is None
            else number("balance_abs_threshold", balance_abs_threshold)
        )
        self.balance_rel_threshold = (
            base.balance_rel_threshold
            if balance_rel_threshold is None
            else number("balance_rel_threshold", balance_rel_threshold)
        )
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        self.index_settings = base.index
        self.low_match = base.low_match

    def decide(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> Decision:
        pool = eligible(workers)
        loads = [w.in_flight for w in pool]
        max_load, min_load = max(loads), min(loads)
        if (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        ):
            chosen, branch = pool[loads.index(min_load)], "balance"
        else:
            matched = max(w.cached for w in pool)
            rate = matched / request.units if request.units else 0.0
            if rate > self.cache_threshold:
                chosen = next(w for w in pool if w.cached == matched)
                branch = "cache"
            elif self.low_match == "least_load":
                chosen, branch = pool[loads.index(min_load)], "least_load"
            else:
                smallest = min(w.index_units for w in pool)
                chosen = next(w for w in pool if w.index_units == smallest)
                branch = "smallest_tree"
        candidates = tuple(
            Candidate(
                worker=w.url,
                eligible=True,
                cached=w.cached,
                uncached=request.units - w.cached,
                in_flight=w.in_flight,
            )
            if w.healthy
            else ineligible_candidate(w)
            for w in workers
        )
        return Decision(
            request.request_id, self.name, chosen.url, candidates, request.units, branch=branch
        )

    def commit(self, decision: Decision) -> None:
        pass

    def complete(self, decision: Decision, outcome: Outcome) -> Learned | None:
        return None

    def forget_worker(self, url: str) -> None:
        pass
