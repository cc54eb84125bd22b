"""The routing core the service and the simulator share: index, in-flight counts, policy.

No I/O and no clock of its own: callers pass worker status (health, decayed queue load read
from whichever load store they use) and the current time. ``decide`` is a pure query (the
``/explain`` dry run); ``route`` decides and commits; ``complete`` feeds back the outcome.

With ``blocks`` (the workers' KV events, ``routing.block_sets``) a worker whose events are
live is matched on the pages it really holds, the request's token ids hashed as the engine
hashes them; any other worker, or a request without token ids, on the approximate index.
Each decision says which source each candidate's ``cached`` came from (``cache_sources``).

For a policy that says ``learns_cache`` (``lbgr``), the approximate index is discounted by
what the workers' answers say survives (``routing.survival``): a prefix the index says it
sent a worker long ago counts as cached only in the share such prefixes were really found.
Every answer that says how many prompt tokens the worker found cached teaches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine_ext.cache.keys import Key
from router_service.routing.block_keys import CHARS_PER_BLOCK, BlockKeys
from router_service.routing.block_sets import BlockSets
from router_service.routing.ledger import Ledger
from router_service.routing.policy import RoutingPolicy
from router_service.routing.prefix_index import PrefixIndex
from router_service.routing.survival import CacheSurvival, Segment
from router_service.routing.types import (
    Decision,
    Learned,
    Outcome,
    RouteRequest,
    WorkerSnapshot,
    WorkerStatus,
)

__all__ = ["Router"]


@dataclass(slots=True)
class _Stores:
    """A request sent with token ids to a worker with events: what it should store there.
    Its answer shows the pages stored; their events were due from its first token."""

    worker: str
    uncached: int  # the router's prediction, until the answer says
    sent_ms: float
    first_token_ms: float | None = None


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
        blocks: BlockSets | None = None,
        survival: CacheSurvival | None = None,
        time_scale: float = 1.0,
    ) -> None:
        self.policy = policy
        self.index = index if index is not None else PrefixIndex()
        self.blocks = blocks  # the workers' KV events (exact), for workers that have them
        # With block keys the index holds chained block digests instead of prompt units, so
        # replicas can share it (router_service.index_sync); matches are block-granular.
        self.keys = keys
        self._last_key: tuple[str, Key] = ("", "")
        # Requests in flight: counts, prefill backlog, KV held; and the prefill done lately, in
        # the workers' time (``time_scale``: emulated workers that run faster than the clock).
        self.ledger = Ledger(time_scale=time_scale)
        self._policy_of: dict[str, RoutingPolicy] = {}  # open decision id -> its policy
        self._orphans: set[str] = set()  # open decisions whose worker was removed since
        self._last_match: tuple[str, dict[str, int]] = ("", {})
        self._last_index: dict[str, int] = {}  # of the last match: the index's own belief
        self._last_segments: dict[str, list[Segment]] = {}  # of the last match, when discounted
        # What survives in the workers' caches, by age of the index's belief, and what they
        # prefill again. Per open decision of a cache-learning policy, to learn from its
        # answer: the segments its worker was matched on (none with exact KV events), the
        # index's own belief there (approximate, even where events made the match exact),
        # the request's units and its tokens per unit.
        self.survival = survival if survival is not None else CacheSurvival()
        self._matched_on: dict[str, tuple[list[Segment], int, int, float]] = {}
        self._last_approx: dict[str, int] = {}  # of the last match: the index's belief
        self.clock_ms = 0.0  # the latest time a caller passed (decisions without one use it)
        self._last_sources: dict[str, str] = {}  # of the last match: worker -> source
        # Per open decision sent with token ids to a worker with events (``_stored``).
        self._stores: dict[str, _Stores] = {}
        self._last_trim_ms = 0.0

    def set_policy(self, policy: RoutingPolicy) -> None:
        """Swap the policy; decisions in flight complete against the policy that made them."""
        self.policy = policy

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests routed and not completed, per worker."""
        return self.ledger.in_flight

    @property
    def pending_units(self) -> dict[str, int]:
        """Uncached units routed and not completed, per worker."""
        return self.ledger.pending_units

    def snapshots(
        self, request: RouteRequest, workers: Sequence[WorkerStatus]
    ) -> list[WorkerSnapshot]:
        matched = self._match(request)
        believed = self._last_index
        ledger = self.ledger
        in_flight, pending = ledger.in_flight, ledger.pending_units
        prefill, pairs, kv = ledger.prefill_tokens, ledger.prefill_pairs, ledger.kv_tokens
        output = ledger.outputs.expected(request.max_new_tokens)
        survival = self.survival
        now = self.clock_ms
        recent = {w.url: ledger.recent_prefill(w.url, now) for w in workers}
        return [
            WorkerSnapshot(
                url=w.url,
                healthy=w.healthy,
                reason=w.reason,
                queue_ms=w.queue_ms,
                in_flight=in_flight.get(w.url, 0),
                cached=matched.get(w.url, 0),
                index_cached=believed.get(w.url, 0),
                index_units=self.index_units(w.url),
                pending_units=pending.get(w.url, 0),
                prefill_tokens=prefill.get(w.url, 0.0),
                prefill_pairs=pairs.get(w.url, 0.0),
                prefilling=ledger.prefilling.get(w.url, 0),
                kv_tokens=kv.get(w.url, 0.0),
                recent_prefill_tokens=recent[w.url][0],
                recent_prefill_pairs=recent[w.url][1],
                output_tokens=output,
                other_requests=w.other_requests,
                other_kv_tokens=w.other_kv_tokens,
                refetch_share=survival.refetch_share(w.url),
            )
            for w in workers
        ]

    def expected_output_tokens(self, request: RouteRequest) -> float:
        """What the router expects ``request`` to generate (learned from completions)."""
        return self.ledger.outputs.expected(request.max_new_tokens)

    def index_key(self, request: RouteRequest) -> Key:
        """What the index stores for ``request``: its units, or its block digests."""
        if self.keys is None:
            return request.key
        last_id, key = self._last_key
        if last_id != request.request_id:
            key = self.keys.key(request.key)
            self._last_key = (request.request_id, key)
        return key

    @property
    def learns_cache(self) -> bool:
        """Whether the policy routes on the index discounted by ``survival``."""
        return bool(getattr(self.policy, "learns_cache", False))

    def _match(self, request: RouteRequest) -> dict[str, int]:
        """Cached units per worker for ``request`` (remembered for the commit that follows)."""
        key, total, keys = self.index_key(request), request.units, self.keys
        segments: dict[str, list[Segment]] = {}
        if self.learns_cache:
            for worker, runs in self.index.match_segments(key, self.clock_ms).items():
                if keys is not None:  # digest characters to prompt units (whole blocks)
                    runs = [(keys.units(a, total), keys.units(b, total), age) for a, b, age in runs]
                    runs = [run for run in runs if run[1] > run[0]]
                if runs:
                    segments[worker] = runs
            believed = {w: runs[-1][1] for w, runs in segments.items()}
            expected = self.survival.expected
            whole_from = getattr(self.policy, "whole_survival", None)
            matched = {
                w: min(believed[w], int(expected(w, runs, whole_from) + 0.5))
                for w, runs in segments.items()
            }
        else:
            _, matched = self.index.match(key)
            if keys is not None:
                matched = {w: keys.units(m, total) for w, m in matched.items()}
            believed = dict(matched)
        self._last_approx = believed
        blocks = self.blocks
        if blocks is not None and blocks.workers:
            sources: dict[str, str]
            if request.tokens:
                exact, sources = blocks.match(request.request_id, request.key, blocks.workers)
                believed = dict(believed)  # the approximate belief stays _last_approx
                for worker, tokens in exact.items():
                    matched[worker] = believed[worker] = min(tokens, request.units)
                    sources[worker] = "events"
                    segments.pop(worker, None)  # exact: nothing to learn about the index
            else:
                why = "the request has no token ids (text routed without --tokenizer)"
                sources = dict.fromkeys(blocks.workers, why)
            self._last_sources = sources
        self._last_match = (request.request_id, matched)
        self._last_index, self._last_segments = believed, segments
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

    def decide(
        self, request: RouteRequest, workers: Sequence[WorkerStatus], now_ms: float | None = None
    ) -> Decision:
        """The decision the router would take now (``now_ms``, else the latest time a caller
        passed: the age of the index's beliefs); changes nothing but that clock."""
        if now_ms is not None and now_ms > self.clock_ms:
            self.clock_ms = now_ms
        decision = self.policy.decide(request, self.snapshots(request, workers))
        if self.blocks is not None and self.blocks.workers:
            decision = replace(decision, cache_sources=dict(self._last_sources))
        return decision

    def commit(self, request: RouteRequest, decision: Decision, now_ms: float) -> None:
        """Apply a decision: the policy's bookkeeping, the index insert, the in-flight count."""
        chosen = decision.chosen
        if now_ms > self.clock_ms:
            self.clock_ms = now_ms
        cached = self.cached_for(request, chosen)
        uncached = request.units - cached
        if self.learns_cache:  # learn from its answer what survived and what came back
            self._matched_on[decision.decision_id] = (
                self._last_segments.get(chosen, []),
                self._last_approx.get(chosen, 0),
                request.units,
                request.tokens_per_unit,
            )
        if self.blocks is not None and request.tokens:
            # It stores pages if it prefills one or more: their events are due once its
            # answer shows the prefill done (first_token, complete). Until it ends, its pages
            # count as the worker's (it stores them as it prefills).
            self._stores[decision.decision_id] = _Stores(chosen, uncached, now_ms)
            cached_tokens = int(cached * request.tokens_per_unit)
            self.blocks.open(decision.decision_id, chosen, request.key, cached_tokens)
        self.policy.commit(decision)
        self.index.insert(self.index_key(request), chosen, now_ms)
        self.ledger.open(
            decision.decision_id,
            chosen,
            uncached=uncached,
            prompt_tokens=request.units * request.tokens_per_unit,
            max_new_tokens=request.max_new_tokens,
            tokens_per_unit=request.tokens_per_unit,
            now_ms=now_ms,
        )
        self._policy_of[decision.decision_id] = self.policy

    def route(
        self, request: RouteRequest, workers: Sequence[WorkerStatus], now_ms: float
    ) -> Decision:
        decision = self.decide(request, workers, now_ms)
        self.commit(request, decision, now_ms)
        return decision

    def first_token(self, decision_id: str, now_ms: float | None = None) -> None:
        """The worker sent the request's first token (at ``now_ms``, else the latest time a
        caller passed): its prefill is done, and the events of the pages it stored were due
        from then (checked when it completes, with what its answer says it stored)."""
        self.ledger.first_token(decision_id)
        store = self._stores.get(decision_id)
        if store is not None and store.first_token_ms is None:
            store.first_token_ms = self.clock_ms if now_ms is None else now_ms

    def _stored(self, decision_id: str, outcome: Outcome, now_ms: float | None) -> None:
        """Expect the events of what a successful answer stored: the prompt tokens it did
        not find cached (its ``cached_tokens``), else what the router predicted uncached."""
        store = self._stores.pop(decision_id, None)
        if store is None or self.blocks is None or not outcome.ok:
            return
        uncached = store.uncached
        if outcome.cached_tokens is not None and outcome.prompt_tokens is not None:
            uncached = outcome.prompt_tokens - outcome.cached_tokens
        since = store.first_token_ms if store.first_token_ms is not None else now_ms
        since = self.clock_ms if since is None else since
        self.blocks.expect(store.worker, uncached, since, store.sent_ms)

    def complete(
        self, decision: Decision, outcome: Outcome, now_ms: float | None = None
    ) -> Learned | None:
        """Close a routed request (answered at ``now_ms``, else the latest time a caller
        passed); a learning policy trains on its outcome."""
        self._stored(decision.decision_id, outcome, now_ms)
        if self.blocks is not None:
            self.blocks.close(decision.decision_id)
        matched_on = self._matched_on.pop(decision.decision_id, None)
        if decision.decision_id in self._orphans:  # its worker is gone: nothing to update
            self._orphans.discard(decision.decision_id)
            return None
        self.ledger.close(decision.decision_id, outcome.output_tokens)
        if matched_on is not None and outcome.ok and outcome.cached_tokens is not None:
            segments, believed, units, guess = matched_on
            # In the request's units: by the prompt's own token count when the answer gives
            # it (a text prompt's characters per token are only a guess), else the guess.
            prompt = outcome.prompt_tokens
            per_unit = (prompt / units if prompt and units else None) or guess
            found = outcome.cached_tokens / per_unit
            if segments:
                self.survival.observe(decision.chosen, segments, found, per_unit)
            self.survival.observe_prefill(decision.chosen, believed, found, units, per_unit)
        policy = self._policy_of.pop(decision.decision_id, None)
        if policy is None:  # never committed here: only the current policy can judge it
            if decision.policy != self.policy.name:
                return None
            return self.policy.complete(decision, outcome)
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
        orphans = self.ledger.drop_worker(url)
        for decision_id in orphans:
            self._policy_of.pop(decision_id, None)
            self._stores.pop(decision_id, None)
        self._orphans.update(orphans)
        self.index.remove_worker(url)
        self.survival.forget_worker(url)
        self.policy.forget_worker(url)
