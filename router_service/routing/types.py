"""Values the routing core takes and returns: requests, worker snapshots, decisions, outcomes.

All frozen and slotted; a Decision explains itself (``to_dict`` is the ``/explain`` JSON,
docs/explain.md). Fields a policy does not use are ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_ext.cache.keys import Key

__all__ = [
    "Candidate",
    "Decision",
    "Learned",
    "ModelInfo",
    "NoEligibleWorker",
    "Outcome",
    "RouteRequest",
    "WorkerSnapshot",
    "WorkerStatus",
]


# Characters per token of English text with Llama-style tokenizers (about 4): how the router
# counts tokens of a text prompt it has not tokenized.
CHARS_PER_TOKEN = 4.0


class NoEligibleWorker(RuntimeError):
    """No worker can take the request (all unhealthy or none registered)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows of a request before sending it.

    ``key`` holds the prefix-match units: token ids when the request carries ``input_ids``
    (or the router tokenized it, ``--tokenizer``), else the prompt's characters (for chat, the
    JSON of ``messages``), as SGLang's router does; ``tokens`` says which, and only token ids
    can be matched against the workers' KV events. ``prompt_tokens`` is the prompt length in
    tokens when known (features); ``request_id`` is also the decision id.
    """

    request_id: str
    key: Key
    prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    tokens: bool = False

    @property
    def units(self) -> int:
        return len(self.key)

    @property
    def tokens_per_unit(self) -> float:
        """Tokens per routing unit: 1 for token ids; for text, ``1 / CHARS_PER_TOKEN`` unless
        the prompt's token count is known."""
        if self.prompt_tokens is not None and self.units:
            return self.prompt_tokens / self.units
        return 1.0 / CHARS_PER_TOKEN


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """What the shell (or simulator) knows of a worker: health and decayed queue load."""

    url: str
    healthy: bool = True
    reason: str | None = None
    queue_ms: float = 0.0
    # Load in the worker that this router did not send (other replicas, direct clients), as
    # the worker's own metrics last said (``router_service.worker_metrics``).
    other_requests: float = 0.0
    other_kv_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """Everything a policy may read about one worker at decision time."""

    url: str
    healthy: bool
    reason: str | None
    queue_ms: float
    in_flight: int
    cached: int
    index_units: int
    pending_units: int = 0
    # The router's ledger of its requests in flight on the worker (``Router``): prompt tokens
    # not yet prefilled (no first token seen), and the KV tokens the requests hold or will
    # hold (prompt + expected output).
    prefill_tokens: float = 0.0
    prefill_pairs: float = 0.0  # their attention work (``ledger.attention_pairs``)
    prefilling: int = 0  # requests among ``in_flight`` whose first token is not seen yet
    kv_tokens: float = 0.0
    # The prefill the worker did lately, per millisecond of its time (``Ledger.recent_prefill``:
    # routed to it, less what is still queued): tokens and their attention pairs.
    recent_prefill_tokens: float = 0.0
    recent_prefill_pairs: float = 0.0
    output_tokens: float = 0.0  # what the router expects this request to generate
    other_requests: float = 0.0  # ``WorkerStatus``'s: load this router did not send
    other_kv_tokens: float = 0.0
    # What the index itself believes cached, before ``cached`` discounted it by what survives
    # (``Router``, ``routing.survival``); None: not given (``cached`` is the belief).
    index_cached: int | None = None
    # Of what the worker prefilled lately, the share it had cached before and evicted
    # (``CacheSurvival.refetch_share``): what a copy stored there is expected to cost again.
    refetch_share: float = 0.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker's line in a decision's breakdown (``candidates`` in docs/explain.md)."""

    worker: str
    eligible: bool
    reason: str | None = None
    cached: int | None = None
    uncached: int | None = None
    base_ms: float | None = None
    queue_ms: float | None = None
    residual_ms: float | None = None
    predicted_ms: float | None = None
    in_flight: int | None = None
    impact_ms: float | None = None  # lbgr: what the request would cost the worker's others
    evict_ms: float | None = None  # lbgr: of impact_ms, the refetch of what its copy evicts
    stall_ms: float | None = None  # lbgr: of queue_ms, its decode stalled by others' prefill
    cost_ms: float | None = None  # lbgr: what the argmin ranks (predicted + impact)
    index_cached: int | None = None  # lbgr: the index's belief before the survival discount

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "cached": self.cached,
            "uncached": self.uncached,
            "base_ms": self.base_ms,
            "queue_ms": self.queue_ms,
            "residual_ms": self.residual_ms,
            "predicted_ms": self.predicted_ms,
            "in_flight": self.in_flight,
            "impact_ms": self.impact_ms,
            "evict_ms": self.evict_ms,
            "stall_ms": self.stall_ms,
            "cost_ms": self.cost_ms,
            "index_cached": self.index_cached,
            "eligible": self.eligible,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class ModelInfo:
    kind: str
    version: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "version": self.version}


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker plus the per-worker breakdown that led to it."""

    decision_id: str
    policy: str
    chosen: str
    candidates: tuple[Candidate, ...]
    units: int
    reserve_ms: float | None = None
    model: ModelInfo | None = None
    branch: str | None = None  # which rule decided (cache_aware: balance / cache / smallest)
    features: dict[str, float] | None = field(default=None, compare=False)
    # Where each worker's ``cached`` came from, when not the approximate index: "events", or
    # why a worker with a KV-event stream fell back (``Router``); absent: "approximate".
    cache_sources: dict[str, str] | None = field(default=None, compare=False)
    # The policy's own note for learning at completion (lbgr: its estimate for the chosen
    # worker as a function of the output length); never shown.
    reestimate: object | None = field(default=None, compare=False)

    def candidate(self, worker: str) -> Candidate:
        for cand in self.candidates:
            if cand.worker == worker:
                return cand
        raise KeyError(worker)

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision_id": self.decision_id,
            "policy": self.policy,
            "chosen": self.chosen,
            "branch": self.branch,
            "units": self.units,
            "reserve_ms": self.reserve_ms,
            "model": self.model.to_dict() if self.model else None,
            "candidates": [self._candidate_dict(c) for c in self.candidates],
        }

    def _candidate_dict(self, cand: Candidate) -> dict[str, Any]:
        shown = cand.to_dict()
        source = (self.cache_sources or {}).get(cand.worker)
        shown["cache_source"] = "events" if source == "events" else "approximate"
        shown["cache_fallback"] = None if source in (None, "events") else source
        return shown


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a routed request ended; latencies are end-to-end and time to first token."""

    ok: bool
    latency_ms: float | None = None
    ttft_ms: float | None = None
    status: str = "ok"
    output_tokens: int | None = None  # tokens generated, when the answer says
    cached_tokens: int | None = None  # prompt tokens the worker found cached, when it says
    prompt_tokens: int | None = None  # the prompt's tokens, as the worker counted them


@dataclass(frozen=True, slots=True)
class Learned:
    """What a learning policy trained on: the residual target and its prediction error."""

    residual_target_ms: float
    model_error_ms: float
    # The estimate the target is measured from (lbgr: base + alpha * queue, remade with the
    # output tokens the answer reports); None when the policy does not say.
    estimate_ms: float | None = None
