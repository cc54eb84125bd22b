"""``lbgr``: learning-based greedy routing on predicted end-to-end latency.

For every healthy worker the policy predicts the request's latency there as an estimate plus
a residual that a model learns online (one model per worker); the argmin wins. Costs within
``margin_ms`` of the lowest are a tie, broken at random (``ties``, the default ``"random"``):
idle workers tie exactly, and a tie kept by the first worker in the list sent it every new
prefix while the fleet was idle, until its cache overflowed (``docs/routing.md``, *Ties*).
``lbgr_paper`` keeps the paper's rule (``"first"``): a worker must beat the incumbent, the
first in the list, by more than ``margin_ms`` to take over.

Two estimates (``estimate``):

- ``"service"`` (the default): a service model of the worker's batch, fed by the router's
  ledger of its requests in flight (``router_service.routing.ledger``). With ``u`` the
  request's uncached prompt tokens on the worker (after ``c`` cached), ``n`` its prompt
  tokens, ``o`` the output it is expected to generate, and for the worker ``Q`` the prompt
  tokens still to prefill ahead of it (``Q2`` their attention pairs), ``K`` the KV tokens its
  requests hold or will hold and ``B`` their number (both with the load the worker's metrics
  show beyond this router's, ``router_service.worker_metrics``)::

      stall   = rho / (1 - rho) * o * (D_0 + D_kv * (n + K + o/2) + D_seq * (B + 1))
                                                                          (stall_ms)
      wait    = P * Q + A * Q2 + o * (D_kv * K + D_seq * B) + stall          (queue_ms)
      own     = P * u + A * u (c + u/2) + o * (D_0 + D_kv * (n + o/2) + D_seq)   (base_ms)
      predict = own + alpha * wait + residual                             (predicted_ms)
      evict   = evict * R * P * (h - c)                                   (evict_ms)
      impact  = impact * (P * u + A * u (c + u/2)) * (B + N) + evict      (impact_ms)
      cost    = predict + impact                                          (cost_ms)

  i.e. time to first token (the prefills ahead, then its own, linear layers and attention)
  plus ``o`` decode steps whose length grows with the batch's KV and size, stretched by the
  prefills that arrive meanwhile (SGLang runs prefill first): ``rho`` is the share of the
  worker's time its prefill took lately (the ledger's ``recent_prefill``, at most 0.9),
  ``stall`` weighs it (1; 0 turns it off). The argmin ranks
  ``cost``: the predicted latency plus what the request's prefill costs others (``impact``).
  Prefill runs first, so it stalls the ``B`` requests in the worker, and the requests that
  arrive while the worker works it off, counted as ``N``, the fleet's mean requests per
  worker: few at low load, many near saturation. Greedy on its own latency alone, a request
  takes a cache miss on an idler worker whenever the miss is cheaper *for it*; near
  saturation that extra work is what queues everyone else, and the fleet's hit rate and
  capacity fall (``docs/design.md``, *Routing*). What a request inserts also evicts as much
  from a full cache, wherever it goes; what differs between workers is the copy: ``h - c``
  tokens of its prefix that another worker holds (``h``, the deepest match in the fleet) and
  this one would store twice. ``R``, the worker's ``refetch_share`` (``routing.survival``),
  is the share of what it prefilled lately that it had held before and evicted, so the copy
  is expected to cost ``R`` of its prefill again later. ``evict`` weighs it (20): ``R`` is
  the share of all of a worker's prefill, but a copy costs more than an average insert, as it
  splits its prefix's requests between two workers, each copy is refreshed less often, and
  both are evicted sooner (measured: ``docs/routing.md``, *What a copy evicts*). A cache
  with room, or whose evicted entries never come back, learns ``R`` = 0. It keeps one copy
  of a prefix in the fleet where copies would push out prefixes still asked for. A long answer
  weighs the decode load of each worker; a short one (the paper's GSP, 4 tokens) weighs cache hits
  and the prefill backlog. The constants are a prior (SGLang serving Llama-3.1-8B on an L40:
  ``sim/profiles.py``); the default residual ``ratio`` learns each worker's latency as a multiple
  of the estimate, so a faster or slower worker scales its prediction without changing the
  ranking's shape.
- ``"paper"``: the paper's (``lbgr_paper``): ``base = max(1, a + b_c * cached / 1000 +
  b_u * uncached / 1000)`` ms, ``pred = max(1, base + alpha * queue + residual)``, where
  ``queue`` is the decayed load (31/32 per 20 ms) of the base reserved by each routed request.
  Defaults are the paper code's (``sgl-router/src/router.rs``: a = 0, b_c = 0, b_u = 1000,
  alpha = 1), with ``ewmean`` at the forgetting factor it passes (0.992, ``lib.rs``).

The default also routes on the prefix index discounted by what the workers' answers say
survives (``learn_cache``, ``router_service.routing.survival``); ``lbgr_paper`` on the index
as it is.

Either way the chosen worker's decayed load is reserved by ``base`` (shared with other
replicas through Redis), and on completion the worker's residual model learns
``max(1, latency - (base + alpha * queue))``, or the residual unfloored for a signed model
(``ratio``, which can then learn that a worker is faster than the estimate). The service
estimate is first made again with the output the answer reports instead of the expected
``o``, and with the prefill of what the worker reports it found cached instead of what the
index believed: a client that sends no ``max_new_tokens`` leaves the router only the mean
answer, a copy of a prefix may be evicted before the request is admitted, and the model must
learn the worker's speed, not what that mean or the index missed. ``docs/design.md`` says
why the default changed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from models import ModelSlot, ModelSpec
from router_service.routing.features import residual_features
from router_service.routing.ledger import attention_pairs
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

__all__ = ["ESTIMATES", "PAPER_MODEL", "TIES", "LBGRPolicy", "lbgr_paper"]

_NO_FEATURES: dict[str, float] = {}
ESTIMATES = ("service", "paper")
TIES = ("random", "first")
MAX_STALL = 9.0  # a decode stalled by prefill at most 10x as long (rho 0.9)
# The paper's residual: RLS on a bias with lambda = 0.992 and P0 = 1e6, as lib.rs passes them.
PAPER_MODEL = {"kind": "ewmean", "params": {"forgetting": 0.992, "p0": 1e6}}


@dataclass(frozen=True, slots=True)
class _InOutput:
    """The service estimate (``base + alpha * queue``) as a function of the output length
    ``o``: ``fixed + per_token * o + squared * o**2`` (at least 1 ms, as ``base``). ``fixed``
    holds the request's own prefill as priced at routing (``prefill_ms``); ``at`` puts
    another in its place when given one (what the worker really found cached)."""

    fixed: float
    per_token: float
    squared: float
    prefill_ms: float = 0.0

    def at(self, output_tokens: float, prefill_ms: float | None = None) -> float:
        o = max(0.0, output_tokens)
        fixed = self.fixed if prefill_ms is None else self.fixed - self.prefill_ms + prefill_ms
        return max(1.0, fixed + self.per_token * o + self.squared * o * o)


class LBGRPolicy:
    """Greedy on predicted end-to-end latency, with one residual model per worker."""

    name = "lbgr"
    index_settings = PAPER_INDEX
    configurable_model = True  # takes the router's --model / KVROUTE_MODEL

    def __init__(
        self,
        rng: random.Random,
        model: str | Mapping[str, Any] | ModelSpec = "ratio",
        estimate: str = "service",
        a_ms: float = 0.0,
        b_cached_ms: float = 0.0,
        b_uncached_ms: float = 1000.0,
        alpha: float = 1.0,
        prefill_ms_per_token: float = 0.114,
        attention_ms_per_pair: float = 5.5e-6,
        decode_step_ms: float = 25.5,
        decode_ms_per_kv_token: float = 0.0002,
        decode_ms_per_seq: float = 0.04,
        impact: float = 1.0,
        stall: float = 1.0,
        evict: float = 20.0,
        margin_ms: float = 1.0,
        sharing: str = "per_worker",
        learn_cache: bool = True,
        whole_survival: float = 0.2,
        ties: str = "random",
    ) -> None:
        if estimate not in ESTIMATES:
            raise ValueError(f"unknown estimate {estimate!r}; known: {', '.join(ESTIMATES)}")
        if ties not in TIES:
            raise ValueError(f"unknown ties {ties!r}; known: {', '.join(TIES)}")
        self.rng = rng
        self.ties = ties
        self.estimate = estimate
        self.a_ms = number("a_ms", a_ms)
        self.b_cached_ms = number("b_cached_ms", b_cached_ms)
        self.b_uncached_ms = number("b_uncached_ms", b_uncached_ms)
        self.alpha = number("alpha", alpha)
        self.prefill_ms_per_token = number("prefill_ms_per_token", prefill_ms_per_token)
        self.attention_ms_per_pair = number("attention_ms_per_pair", attention_ms_per_pair)
        self.decode_step_ms = number("decode_step_ms", decode_step_ms)
        self.decode_ms_per_kv_token = number("decode_ms_per_kv_token", decode_ms_per_kv_token)
        self.decode_ms_per_seq = number("decode_ms_per_seq", decode_ms_per_seq)
        self.margin_ms = number("margin_ms", margin_ms)
        self.impact = number("impact", impact)
        self.stall = number("stall", stall)
        if self.stall < 0:
            raise ValueError(f"stall must be >= 0, got {stall!r}")
        self.evict = number("evict", evict)
        if estimate == "service":
            for name in (
                "prefill_ms_per_token",
                "attention_ms_per_pair",
                "decode_step_ms",
                "decode_ms_per_kv_token",
                "decode_ms_per_seq",
            ):
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} must be >= 0")
        if not isinstance(learn_cache, bool):
            raise ValueError(f"learn_cache must be true or false, got {learn_cache!r}")
        # Route on the index discounted by what the workers' answers say survives (Router):
        # a belief that survives at least ``whole_survival`` of the time counts whole.
        self.learns_cache = learn_cache
        self.whole_survival = number("whole_survival", whole_survival)
        if not 0.0 <= self.whole_survival <= 1.0:
            raise ValueError(f"whole_survival must be in [0, 1], got {whole_survival!r}")
        self.models = ModelSlot(model, sharing=sharing)

    def base_ms(self, cached: int, uncached: int) -> float:
        """The paper's base: ms for ``cached`` and ``uncached`` units."""
        return max(
            1.0,
            self.a_ms + self.b_cached_ms * cached / 1000.0 + self.b_uncached_ms * uncached / 1000.0,
        )

    def _prefill_ms(self, cached: float, uncached: float) -> float:
        """A request's own prefill of ``uncached`` tokens after ``cached`` ones."""
        return self.prefill_ms_per_token * uncached + self.attention_ms_per_pair * attention_pairs(
            cached, uncached
        )

    def _estimate(
        self, request: RouteRequest, w: WorkerSnapshot, fleet: float = 0.0, held: int = 0
    ) -> tuple[float, float, float, float, float, _InOutput | None]:
        """(base_ms, queue_ms, impact_ms, evict_ms, stall_ms, the estimate as a function of
        the output length) of ``request`` on worker ``w``; the last is None for the paper's
        estimate."""
        total = request.units
        if self.estimate == "paper":
            return self.base_ms(w.cached, total - w.cached), w.queue_ms, 0.0, 0.0, 0.0, None
        per_unit = request.tokens_per_unit
        cached, uncached = w.cached * per_unit, (total - w.cached) * per_unit
        output = w.output_tokens
        prefill, attention = self.prefill_ms_per_token, self.attention_ms_per_pair
        kv, seq = self.decode_ms_per_kv_token, self.decode_ms_per_seq
        own_prefill = self._prefill_ms(cached, uncached)
        own_step = self.decode_step_ms + kv * total * per_unit + seq  # + kv * o / 2
        own = own_prefill + output * (own_step + kv * output / 2.0)
        batch = w.in_flight + w.other_requests
        wait_prefill = prefill * w.prefill_tokens + attention * w.prefill_pairs
        wait_step = kv * (w.kv_tokens + w.other_kv_tokens) + seq * batch
        # The prefills that arrive while it decodes stall its decode steps (prefill first).
        # If prefill keeps taking the share rho of the worker's time it took lately (the
        # ledger's recent_prefill), a decode takes 1 / (1 - rho) as long (at most 10x).
        rho = prefill * w.recent_prefill_tokens + attention * w.recent_prefill_pairs
        stall = self.stall * min(MAX_STALL, rho / (1.0 - rho) if rho < 1.0 else MAX_STALL)
        decode_step = own_step + wait_step
        stalled = stall * output * (decode_step + kv * output / 2.0)
        wait = wait_prefill + output * wait_step + stalled
        # What the request costs the others: its prefill stalls every request in the worker
        # (SGLang runs prefill first), and the requests that arrive while the worker works it
        # off, counted as the fleet's mean requests per worker (few at low load, many near
        # saturation: M/M/1's mean number in system, rho / (1 - rho)).
        # And what its copy of a prefix another worker holds evicts here: the share of it
        # that comes back is prefilled again.
        copied = max(0, held - w.cached) * per_unit
        evict = self.evict * w.refetch_share * prefill * copied
        impact = self.impact * own_prefill * (batch + fleet) + evict
        shape = _InOutput(
            own_prefill + self.alpha * wait_prefill,
            own_step + self.alpha * (wait_step + stall * decode_step),
            kv / 2.0 * (1.0 + self.alpha * stall),
            own_prefill,
        )
        return max(1.0, own), wait, impact, evict, stalled, shape

    def decide(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> Decision:
        eligible(workers)
        total = request.units
        best: Candidate | None = None
        best_features: dict[str, float] | None = None
        best_shape: _InOutput | None = None
        candidates: list[Candidate] = []
        scored: list[tuple[float, Candidate, dict[str, float], _InOutput | None]] = []
        models = self.models
        with_features = models.needs_features  # ewmean/none ignore them: skip the dicts
        loads = [w.in_flight + w.other_requests for w in workers if w.healthy]
        fleet = sum(loads) / len(loads) if loads else 0.0
        held = max((w.cached for w in workers if w.healthy), default=0)
        for w in workers:
            if not w.healthy:
                candidates.append(ineligible_candidate(w))
                continue
            base, queue, impact, evict, stalled, shape = self._estimate(request, w, fleet, held)
            estimate = base + self.alpha * queue
            features = residual_features(request, w, estimate) if with_features else _NO_FEATURES
            residual = models.predict(w.url, features)
            predicted = max(1.0, estimate + residual)
            cost = predicted + impact
            cand = Candidate(
                worker=w.url,
                eligible=True,
                cached=w.cached,
                uncached=total - w.cached,
                base_ms=base,
                queue_ms=queue,
                residual_ms=residual,
                predicted_ms=predicted,
                in_flight=w.in_flight,
                impact_ms=impact,
                evict_ms=evict,
                stall_ms=stalled,
                cost_ms=cost,
                index_cached=w.index_cached,
            )
            candidates.append(cand)
            scored.append((cost, cand, features, shape))
        if self.ties == "first":  # the incumbent keeps it unless beaten by more than the margin
            for cost, cand, features, shape in scored:
                if best is None or cost < best.cost_ms - self.margin_ms:  # type: ignore[operator]
                    best, best_features, best_shape = cand, features, shape
        else:  # within the margin of the lowest cost is a tie, broken at random
            low = min(cost for cost, _, _, _ in scored)
            tied = [s for s in scored if s[0] <= low + self.margin_ms]
            _, best, best_features, best_shape = (
                tied[0] if len(tied) == 1 else tied[self.rng.randrange(len(tied))]
            )
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
            reestimate=best_shape,
        )

    def commit(self, decision: Decision) -> None:
        pass

    def complete(self, decision: Decision, outcome: Outcome) -> Learned | None:
        if not outcome.ok or outcome.latency_ms is None:
            return None
        cand = decision.candidate(decision.chosen)
        assert cand.base_ms is not None
        assert cand.queue_ms is not None
        estimate = cand.base_ms + self.alpha * cand.queue_ms
        features = decision.features or {}
        shape = decision.reestimate
        if isinstance(shape, _InOutput) and outcome.output_tokens is not None:
            # The estimate again with the output the request really generated, and the
            # prefill of what the worker really found cached: the model learns what the
            # worker's speed adds, not what the output estimate or the index missed.
            found, prompt = outcome.cached_tokens, outcome.prompt_tokens
            prefill = None
            if found is not None and prompt is not None:
                prefill = self._prefill_ms(found, max(0, prompt - found))
            estimate = shape.at(outcome.output_tokens, prefill)
            if "estimate_ms" in features:
                features = {**features, "estimate_ms": estimate}
        target = outcome.latency_ms - estimate
        if not self.models.signed_for(decision.chosen):
            target = max(1.0, target)  # the paper's floor
        error = self.models.learn(decision.chosen, features, target)
        return Learned(residual_target_ms=target, model_error_ms=error, estimate_ms=estimate)

    def forget_worker(self, url: str) -> None:
        self.models.forget_worker(url)

    def adopt_models(self, slot: ModelSlot) -> None:
        self.models = slot


def lbgr_paper(rng: random.Random, **params: Any) -> LBGRPolicy:
    """The paper's LBGR exactly: its estimate, constants and residual (``lbgr_paper``)."""
    params.setdefault("model", PAPER_MODEL)
    params.setdefault("estimate", "paper")
    params.setdefault("learn_cache", False)  # the paper's index: what it sent, undiscounted
    params.setdefault("ties", "first")  # the incumbent, the first in the list, keeps a tie
    policy = LBGRPolicy(rng, **params)
    policy.name = "lbgr_paper"
    return policy
