"""Offline limits on a workload's hit rate: what no routing or eviction policy can beat.

Both figures take the requests in arrival order and count cached tokens as SGLang and the
simulator do: a request whose L-token prompt has its longest cached prefix of m tokens
counts ``min(m, L - 1)`` (the last prompt token is always recomputed), and a finished
request leaves its prompt and all but the last of its output tokens in the tree.

``ceiling()``: **unlimited capacity, one tree**. A prompt token counts when an earlier
request's prompt + output already covered its whole prefix. This is an upper bound on the
hit rate of any fleet, routing policy, eviction policy and capacity, for any run in which
each worker admits its requests in arrival order (one FCFS queue per worker, no closed-loop
reordering): a worker's tree only ever holds prefixes of what requests admitted earlier on
that worker inserted, a subset of what the single unlimited tree holds.

``bound(C)``: **one worker with C tokens**, an upper bound (not an achievable optimum) for
every eviction policy, online or offline, LRU and RLT included. It solves a relaxation
exactly: the cache may hold *any* set of at most C previously seen tokens between two
requests (no prefix closure, no room needed for the running request's own tokens or
reservations, no locks), and a request counts every token of ``prompt[:-1]`` it finds there
(not only a contiguous prefix). A real run's cache state before each request is such a set
and its count is no larger, so the relaxation's optimum bounds it. Each token's life splits
into intervals between consecutive uses; keeping it over an interval is worth one hit if the
interval ends in a counted use (``prompt[:-1]`` of the next request using it). Choosing the
most intervals with at most C held at any time is the maximum C-colourable subgraph of an
interval graph, which Belady's rule with bypass solves optimally (keep the tokens whose next
counted use is soonest; a token whose next use does not count is not worth keeping). Tokens
that always travel together (one edge of the compressed trie of all prompts, split at every
prompt, ``prompt[:-1]`` and inserted-sequence end) share their intervals, so the rule runs on
those runs of tokens and may keep part of one.

>>> from sim.tokens import ids_to_key
>>> from sim.workloads import RequestList, WorkloadRequest
>>> p = ids_to_key(range(1, 11))
>>> w = RequestList("hand", [WorkloadRequest(f"r{i}", i, p, 1) for i in range(3)])
>>> limits = OfflineLimits(w)
>>> limits.ceiling().cached_tokens, limits.bound(4).cached_tokens
(18, 8)
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from engine_ext.cache import RadixCache, RadixNode
from sim.engine import generated_tokens
from sim.workloads.base import Workload

__all__ = ["HitLimit", "OfflineLimits"]

_NEVER = math.inf


@dataclass(frozen=True, slots=True)
class HitLimit:
    """Cached / prompt tokens under one of the limits; ``capacity_tokens`` None = unlimited."""

    prompt_tokens: int
    cached_tokens: int
    capacity_tokens: int | None
    reusable_tokens: int | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class OfflineLimits:
    """The workload's token-run trie and access lists, built once for every limit asked."""

    def __init__(self, workload: Workload) -> None:
        items = sorted(workload, key=lambda r: r.arrival_ms)  # stable: ties keep their order
        self.prompt_tokens = sum(len(r.prompt) for r in items)
        tree = RadixCache(2**62, "lru")
        keyed = []
        for r in items:
            path = r.prompt + generated_tokens(r.output, r.max_new_tokens - 1)
            keyed.append((r.prompt[:-1], path))
            for key in (r.prompt[:-1], r.prompt, path):
                tree.insert(key)  # splits the trie at every boundary that matters
        index: dict[RadixNode, int] = {}
        self.sizes: list[int] = []
        self.requests: list[tuple[list[int], list[int]]] = []  # (counted runs, other runs)
        for counted_key, path in keyed:
            counted_end = tree.match_prefix(counted_key).node
            node = tree.match_prefix(path).node
            chain: list[int] = []
            counted = -1
            while node is not tree.root:
                if node is counted_end:
                    counted = len(chain)
                if node not in index:
                    index[node] = len(self.sizes)
                    self.sizes.append(len(node.key))
                chain.append(index[node])
                node = node.parent  # type: ignore[assignment]
            chain.reverse()
            split = 0 if counted < 0 else len(chain) - counted
            self.requests.append((chain[:split], chain[split:]))
        self.uses: list[list[tuple[int, bool]]] = [[] for _ in self.sizes]
        for t, (counted_runs, other_runs) in enumerate(self.requests):
            for i in counted_runs:
                self.uses[i].append((t, True))
            for i in other_runs:
                self.uses[i].append((t, False))

    def ceiling(self) -> HitLimit:
        """Unlimited capacity: every counted run seen before is a hit."""
        seen = [False] * len(self.sizes)
        reused = [False] * len(self.sizes)
        cached = 0
        for counted_runs, other_runs in self.requests:
            for i in counted_runs:
                if seen[i]:
                    cached += self.sizes[i]
                    reused[i] = True
            for i in counted_runs:
                seen[i] = True
            for i in other_runs:
                seen[i] = True
        reusable = sum(s for s, r in zip(self.sizes, reused, strict=True) if r)
        return HitLimit(self.prompt_tokens, cached, None, reusable)

    def bound(self, capacity_tokens: int) -> HitLimit:
        """Belady with bypass on the relaxation described in the module docstring."""
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        sizes, uses = self.sizes, self.uses
        held = [0] * len(sizes)
        next_use = [_NEVER] * len(sizes)
        position = [-1] * len(sizes)
        heap: list[tuple[float, int]] = []  # (-next counted use, run): furthest first
        total = cached = 0
        for counted_runs, other_runs in self.requests:
            for i in counted_runs:
                cached += held[i]
            for i in (*counted_runs, *other_runs):
                p = position[i] = position[i] + 1
                following = uses[i][p + 1] if p + 1 < len(uses[i]) else None
                when = following[0] if following is not None and following[1] else _NEVER
                next_use[i] = when
                total -= held[i]
                held[i] = 0 if when == _NEVER else sizes[i]
                total += held[i]
                if held[i]:
                    heapq.heappush(heap, (-when, i))
            while total > capacity_tokens:
                when, i = heap[0]
                if held[i] == 0 or -when != next_use[i]:
                    heapq.heappop(heap)  # stale: evicted already, or used since
                    continue
                drop = min(held[i], total - capacity_tokens)
                held[i] -= drop
                total -= drop
                if held[i] == 0:
                    heapq.heappop(heap)
        return HitLimit(self.prompt_tokens, cached, capacity_tokens)
