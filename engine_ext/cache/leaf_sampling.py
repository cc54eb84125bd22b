"""Batched draw of RLT's per-token eviction: exact distribution, cost per leaf, not per token.

The definition (DESIGN 3.3) evicts one page at a time from a leaf chosen uniformly among the
candidate leaves; a leaf that empties leaves the set and its parent may join. Drawing that
literally costs one random draw per page. We draw the same distribution in continuous time
(Poissonization): give every candidate leaf an independent rate-1 Poisson clock that starts
when it joins; each ring drops one page. Because exponential clocks are memoryless and share
one rate, the next ring belongs to a uniformly chosen active leaf, so the sequence of rings is
exactly the per-page process. A leaf of ``c`` pages empties at its ``c``-th ring, a
Gamma(c, 1) time after it joins, and given that time its earlier rings are i.i.d. uniform
before it. So:

1. draw every leaf's emptying time (one vectorised call) and walk the emptyings in time order,
   letting parents join, until the emptied pages alone reach the target: the target ring lies
   before that event;
2. bisect over those event times, sampling every leaf's ring count with binomial bridges that
   stay consistent with the counts already drawn, until the target ring lies between two
   consecutive events;
3. inside that gap every ring is uniform and independent, so the first ``q`` of them are a
   multivariate hypergeometric sample.

When few leaves can empty (``need`` small against the leaves' sizes, the common case: a
scheduler evicting for one request), cheaper exact rounds come first: until a leaf empties the
picks are i.i.d. uniform over a fixed set, so they can be drawn at once, a round per emptying
(``draw_leaf_evictions`` explains the two kinds).

Cost: a few vectorised draws plus one step per leaf that empties, against one draw per page
for the literal loop. ``tests/engine_ext/test_leaf_sampling.py`` checks the distribution
against the literal loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np

__all__ = ["draw_leaf_evictions"]

N = TypeVar("N", bound=Hashable)


# Rounds before the continuous-time draw takes over: a round costs a few vectorised calls and
# ends at (at most) one emptying, so rounds pay off only while few leaves can empty.
_MAX_ROUNDS = 8
METHODS = ("multinomial", "cut", "continuous")


def draw_leaf_evictions(
    candidates: Sequence[tuple[N, int]],
    need: int,
    gen: np.random.Generator,
    parent_joins: Callable[[N], tuple[N, int] | None],
    *,
    max_rounds: int = _MAX_ROUNDS,
    method: str | None = None,
) -> list[tuple[N, int]]:
    """Pages to drop per leaf after ``need`` uniform leaf picks (or all pages, if fewer).

    ``candidates`` are (leaf, pages >= 1) in a deterministic order; ``parent_joins(leaf)`` is
    called when ``leaf`` empties and returns (parent, pages) if the parent becomes a candidate
    then. Returns (leaf, pages) with emptied leaves first, in the order they empty (children
    before their parents), then the partly trimmed ones.

    Until a leaf empties the candidate set is fixed and the picks are i.i.d. uniform over it.
    Two kinds of round use that, each exact, and the continuous-time draw finishes whatever
    they leave (the process is Markov, so switching is exact):

    - ``multinomial``: ``m`` = the smallest leaf's remaining pages; ``m`` picks are one
      multinomial draw (a leaf that the last pick empties leaves before the next round).
      O(leaves) per round: for a few big leaves;
    - ``cut``: all remaining picks in one draw (``integers`` + ``bincount``), kept up to the
      first pick that empties a leaf; the picks after it are discarded and drawn again over
      the new set (they are independent of the past). O(picks) per round: for many leaves of
      which few can empty (a scheduler evicting for one request, the common case).

    ``method`` forces one (tests); by default it is chosen from the sizes, which is exact
    because the choice depends on no random draw.
    """
    if need <= 0 or not candidates:
        return []
    state = _Rounds(candidates, need, gen, parent_joins)
    chosen = method or _choose(state.remaining, need, max_rounds)
    if chosen not in METHODS:
        raise ValueError(f"unknown method {chosen!r}; known: {', '.join(METHODS)}")
    if chosen == "multinomial":
        while state.need > 0 and state.active:
            m = min(state.need, int(state.remaining.min()))
            if state.need > m * max_rounds:
                break
            state.multinomial_round(m)
    elif chosen == "cut":
        for _ in range(max_rounds):
            if state.need <= 0 or not state.active:
                break
            state.cut_round()
    return state.finish()


def _choose(remaining: np.ndarray, need: int, max_rounds: int) -> str:
    """The cheapest exact path: a multinomial round costs ~O(leaves), a cut round O(need)."""
    leaves = len(remaining)
    if need <= int(remaining.min()) * max_rounds and leaves * 8 <= need:
        return "multinomial"
    if _likely_emptyings(remaining, need) <= max_rounds:
        return "cut"
    return "continuous"


class _Rounds(Generic[N]):
    """The state of one draw: active leaves, their remaining and taken pages."""

    def __init__(
        self,
        candidates: Sequence[tuple[N, int]],
        need: int,
        gen: np.random.Generator,
        parent_joins: Callable[[N], tuple[N, int] | None],
    ) -> None:
        self.need = need
        self.gen = gen
        self.parent_joins = parent_joins
        self.taken: dict[N, int] = {}
        self.emptied: list[N] = []
        self.active = [node for node, _ in candidates]
        self.remaining = np.asarray([pages for _, pages in candidates], dtype=np.int64)
        self.picked = np.zeros_like(self.remaining)  # pages taken so far per active leaf

    def _take(self, counts: np.ndarray, picks: int) -> None:
        self.picked += counts
        self.remaining -= counts
        self.need -= picks

    def _empty(self, i: int) -> None:
        """Active leaf ``i`` has no page left: it leaves, and its parent may join."""
        leaf = self.active.pop(i)
        self.taken[leaf] = int(self.picked[i])
        self.remaining = np.delete(self.remaining, i)
        self.picked = np.delete(self.picked, i)
        self.emptied.append(leaf)
        joined = self.parent_joins(leaf)
        if joined is not None and joined[1] > 0:
            self.active.append(joined[0])
            self.remaining = np.append(self.remaining, joined[1])
            self.picked = np.append(self.picked, 0)

    def multinomial_round(self, m: int) -> None:
        k = len(self.active)
        self._take(self.gen.multinomial(m, np.full(k, 1.0 / k)), m)
        if self.remaining.min() == 0:  # at most one leaf: it took all m picks of this round
            self._empty(int(np.argmin(self.remaining)))

    def cut_round(self) -> None:
        k, remaining = len(self.active), self.remaining
        picks = self.gen.integers(0, k, size=self.need)
        counts = np.bincount(picks, minlength=k)
        full = np.flatnonzero(counts >= remaining)
        if full.size == 0:  # nobody empties: every pick stands
            self._take(counts, self.need)
            return
        # The pick that empties a leaf first: for each leaf that would, the position of its
        # remaining-th pick; the earliest of those ends the round.
        cut = min(int(np.flatnonzero(picks == i)[remaining[i] - 1]) for i in full.tolist())
        self._take(np.bincount(picks[: cut + 1], minlength=k), cut + 1)
        self._empty(int(picks[cut]))

    def finish(self) -> list[tuple[N, int]]:
        """The continuous-time draw for what is left, then the plan."""
        taken, emptied = self.taken, self.emptied
        for node, count in zip(self.active, self.picked.tolist(), strict=True):
            if count:
                taken[node] = count
        if self.need > 0 and self.active:
            rest = list(zip(self.active, self.remaining.tolist(), strict=True))
            gone_later, partial = _continuous_draw(rest, self.need, self.gen, self.parent_joins)
            for node, count in gone_later + partial:
                taken[node] = taken.get(node, 0) + count
            emptied.extend(node for node, _ in gone_later)
        done = set(emptied)
        return [(node, taken[node]) for node in emptied] + [
            (node, count) for node, count in taken.items() if node not in done
        ]


def _likely_emptyings(remaining: np.ndarray, need: int) -> int:
    """Leaves whose size is within ~3 standard deviations of their expected share of picks
    (``need / leaves`` each, binomial): a cheap bound on how many rounds would be needed."""
    mean = need / len(remaining)
    return int(np.count_nonzero(remaining <= mean + 3.0 * np.sqrt(mean) + 1.0))


def _continuous_draw(
    candidates: Sequence[tuple[N, int]],
    need: int,
    gen: np.random.Generator,
    parent_joins: Callable[[N], tuple[N, int] | None],
) -> tuple[list[tuple[N, int]], list[tuple[N, int]]]:
    """Steps 1-3 of the module docstring: (emptied leaves in order, partly trimmed leaves)."""
    nodes = [node for node, _ in candidates]
    size_list = [pages for _, pages in candidates]
    k = len(nodes)
    end_initial = gen.standard_gamma(np.asarray(size_list, dtype=np.float64))
    order = np.argsort(end_initial, kind="stable").tolist()
    end_list = end_initial.tolist()
    start_list = [0.0] * k
    joined: list[tuple[float, int]] = []  # heap of parents that joined later

    emptied_pages, pos = 0, 0
    events: list[int] = []  # leaf index of each emptying, in time order
    while emptied_pages < need:
        if joined and (pos >= k or joined[0][0] < end_list[order[pos]]):
            idx = heapq.heappop(joined)[1]
        elif pos < k:
            idx = order[pos]
            pos += 1
        else:
            break
        emptied_pages += size_list[idx]
        events.append(idx)
        parent = parent_joins(nodes[idx])
        if parent is not None and parent[1] > 0:
            at = end_list[idx]
            nodes.append(parent[0])
            size_list.append(parent[1])
            start_list.append(at)
            end_list.append(at + float(gen.standard_gamma(parent[1])))
            heapq.heappush(joined, (end_list[-1], len(nodes) - 1))
    still_active = pos < k or bool(joined)
    if emptied_pages < need or (emptied_pages == need and not still_active):
        return [(nodes[i], size_list[i]) for i in events], []  # fewer pages than asked: all go

    counts = _counts_at_target(
        np.asarray(start_list),
        np.asarray(end_list),
        np.asarray(size_list, dtype=np.int64),
        [end_list[i] for i in events],
        events,
        need,
        gen,
    )
    gone = [(nodes[i], size_list[i]) for i in events if counts[i] == size_list[i]]
    partial = [
        (nodes[i], int(counts[i]))
        for i in np.flatnonzero((counts > 0) & (counts < size_list)).tolist()
    ]
    return gone, partial


def _counts_at_target(
    start: np.ndarray,
    end: np.ndarray,
    size: np.ndarray,
    event_times: list[float],
    event_leaf: list[int],
    need: int,
    gen: np.random.Generator,
) -> np.ndarray:
    """Ring counts per leaf just after the ``need``-th ring overall (steps 2 and 3)."""
    t_lo, t_hi = 0.0, event_times[-1]
    lo_counts = np.zeros_like(size)
    hi_counts = _bridge(start, end, size, 0.0, np.inf, lo_counts, None, t_hi, gen)

    lo_i, hi_i = -1, len(event_times) - 1
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        t = event_times[mid]
        mid_counts = _bridge(start, end, size, t_lo, t_hi, lo_counts, hi_counts, t, gen)
        if int(mid_counts.sum()) >= need:
            hi_i, t_hi, hi_counts = mid, t, mid_counts
        else:
            lo_i, t_lo, lo_counts = mid, t, mid_counts

    wanted = need - int(lo_counts.sum())
    in_gap = hi_counts - lo_counts
    if wanted == int(in_gap.sum()):
        return hi_counts
    # The ring at t_hi (the emptying of event_leaf[hi_i]) is the gap's last; the first
    # `wanted` of the other, uniformly ordered, rings are a hypergeometric sample.
    in_gap[event_leaf[hi_i]] -= 1
    return lo_counts + gen.multivariate_hypergeometric(in_gap, wanted)


def _bridge(
    start: np.ndarray,
    end: np.ndarray,
    size: np.ndarray,
    t_lo: float,
    t_hi: float,
    lo_counts: np.ndarray,
    hi_counts: np.ndarray | None,
    t: float,
    gen: np.random.Generator,
) -> np.ndarray:
    """Sample every leaf's ring count at ``t`` given its counts at ``t_lo`` and ``t_hi``.

    A leaf alive at ``t`` has its not-yet-placed rings uniform on (max(start, t_lo),
    min(end, t_hi)); its final ring sits at ``end``. With no upper bracket yet
    (``hi_counts`` None) the rings between ``t_lo`` and ``end`` are all of them but the last.
    """
    lower = np.maximum(start, t_lo)
    upper = np.minimum(end, t_hi)
    inside = (start < t) & (end > t)
    if hi_counts is None:
        between = size - 1 - lo_counts
    else:
        between = hi_counts - lo_counts - (end <= t_hi)
    span = np.where(inside, upper - lower, 1.0)
    p = np.where(inside, (t - lower) / span, 0.0)
    drawn = lo_counts + gen.binomial(np.where(inside, between, 0), p)
    return np.where(end <= t, size, np.where(start >= t, 0, drawn))
