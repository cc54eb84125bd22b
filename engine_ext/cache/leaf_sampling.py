"""Batched draw of RLT's per-token eviction: exact distribution, cost per leaf, not per token.

The definition (docs/design.md) evicts one page at a time from a leaf chosen uniformly among the
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
   consecutive events, or the bracket holds few rings (a few thousand);
3. given the counts at both ends of the bracket, every leaf's rings inside it are independent
   and uniform on its part of it (but the last ring of a leaf that empties there, which sits
   at its emptying time): with no emptying inside, the first ``q`` of them are a multivariate
   hypergeometric sample; otherwise their times are drawn and the first ``q`` taken.

When few leaves can empty (``need`` small against the leaves' sizes, the common case: a
scheduler evicting for one request), cheaper exact rounds come first: until a leaf empties the
picks are i.i.d. uniform over a fixed set, so they can be drawn at once, a round per emptying
(``draw_leaf_counts`` explains the two kinds). And when a leaf is likely to empty among a
few thousand pages (a cache that RLT has run for a while: its trims leave many short
leaves), the definition itself is cheapest, compiled: one buffered uniform per page, one
Python call per leaf that empties (``steps``, ``kernels.steps``).

Cost: a few vectorised draws plus one step per leaf that empties, against one draw per page
for the literal loop. The core (``draw_leaf_counts``) works on arrays of leaf sizes and
returns an array of pages per leaf, so both caches (the reference one and the SGLang plugin)
apply a batch of trims in one vectorised step on their leaf registry (``leaf_registry``).
``tests/engine_ext/test_leaf_sampling.py`` checks the distribution against the literal loop.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from engine_ext.cache import kernels

__all__ = ["FEW_LEAVES", "Draws", "draw_first_counts", "draw_first_round", "draw_leaf_counts"]

# ``parent_joins(label)``: called when the leaf ``label`` empties; returns the pages of its
# parent if the parent becomes a candidate then (it gets the next free label), else None.
ParentJoins = Callable[[int], "int | None"]
# A round's picks: (counts per leaf, the picks in order: an array, a function that returns
# them, or None when they were drawn as counts only and their order is still to be drawn).
Drawn = tuple[np.ndarray, "np.ndarray | Callable[[], np.ndarray] | None"]

# Rounds before the continuous-time draw takes over: a round costs a few vectorised calls and
# ends at (at most) one emptying, so rounds pay off only while few leaves can empty.
_MAX_ROUNDS = 8
# Many picks per leaf: from here ``_choose`` considers multinomial rounds, and a round's
# picks may come as counts only (where a leaf empties among them drawn only if one does,
# ``_counts_emptying``): a plain numpy
# generator then draws one multinomial (O(leaves)) instead of the picks (O(picks)); a
# ``Draws`` counts its buffered picks, or draws binomials (``_BINOMIAL_PICKS_PER_LEAF``).
_MULTINOMIAL_PICKS_PER_LEAF = 8
# From this many picks per leaf (or beyond its buffer, with ``_MULTINOMIAL_PICKS_PER_LEAF``)
# a ``Draws`` draws a round's counts as one binomial per leaf (``Draws.even_counts``) instead
# of counting buffered picks: compiled, a pick costs ~1.2 ns and a leaf's binomial ~60-80
# ns, so they cost the same around 64 picks per leaf. The numpy fallback's binomials are
# plain Python, ~5 us a leaf, which a higher threshold keeps to few leaves.
_BINOMIAL_PICKS_PER_LEAF = 128
# Up to this many leaves, callers gather candidates and start the draw with Python lists
# (``draw_first_round``): numpy's per-call cost outweighs its vector speed on so few. Not with
# the compiled loops (``kernels``), which cost less than the lists at any size.
FEW_LEAVES = -1 if kernels.COMPILED else 32
# Joining parents' Gamma clocks: drawn this many at a time per size after the first
# (``_GammaDraws``).
_GAMMA_BATCH = 16
# The continuous-time walk stops once the expected rings pass need + SD * sqrt(need) + RINGS.
_STOP_MARGIN_SD = 4.0
_STOP_MARGIN_RINGS = 8.0
# Bisection over the emptyings stops once the bracket holds this many rings or fewer; they
# are then ordered by time directly (``_first_rings_in_gap``).
_SORT_GAP_RINGS = 4096
# ``Draws`` serves picks from this many pre-drawn uniforms (256 KiB), refilled when used up.
_PICK_BUFFER = 1 << 15
# Up to this many pages (and no more than a ``Draws``' buffer), a draw in which a leaf is
# likely to empty runs page by page (``steps``): compiled, ~3-5 ns a page plus one Python call
# per leaf that empties, against ~20-50 us of numpy calls per emptying for the rounds.
_STEP_PAGES = 1 << 14
METHODS = ("multinomial", "cut", "continuous", "steps", "rounds")

# ufunc reductions called directly: ``ndarray.min()`` and friends go through a Python-level
# wrapper in numpy, which an eviction pays cold (a few microseconds each).
_min, _max, _sum, _any = np.minimum.reduce, np.maximum.reduce, np.add.reduce, np.logical_or.reduce


class Draws(np.random.Generator):
    """The generator of RLT's draws: a numpy ``Generator`` (PCG64, seeded) that also serves
    picks uniform over ``leaves`` from a buffer of uniforms drawn ahead, in bulk.

    A scheduler's eviction wants its picks now; drawing them then is a cold call into
    numpy's bounded-integer sampler, the dearest step of a small eviction (~80 us of a
    ~250 us, 1k-token eviction of a 264-leaf tree, timed cold). From the buffer, the picks
    are a slice, a multiply and a cast. The uniforms are i.i.d. and used once each, in
    order, so the picks are i.i.d.: pick = floor(u * leaves), ``u`` a 53-bit uniform on
    [0, 1), which is below ``leaves`` for every ``u`` (the product of the largest ``u``,
    1 - 2**-53, and an integer below 2**53 rounds to less than that integer); each leaf's
    probability is 1/leaves to within 2**-53 * leaves. Refilling costs one
    ``random(_PICK_BUFFER)`` call (~75 us warm) per 32,768 picks, 2-5 ns a pick, in the
    eviction that runs the buffer dry; the first fill happens at construction.
    """

    def __init__(self, seed: int, buffer: int = _PICK_BUFFER) -> None:
        super().__init__(np.random.PCG64(seed))
        self._buffer = buffer
        self._uniforms = self.random(buffer)
        self._used = 0

    def picks(self, leaves: int, n: int) -> np.ndarray:
        """``n`` independent picks, each uniform over ``range(leaves)``."""
        if n > self._buffer:
            return self.integers(0, leaves, size=n)
        uniforms, start = self._take(n)
        return kernels.picks_of(uniforms, start, n, leaves)

    def pick_counts(self, leaves: int, n: int) -> tuple[np.ndarray, int, Callable[[], np.ndarray]]:
        """``picks(leaves, n)`` as counts per leaf (one compiled loop, ``kernels``), with the
        largest count and a function that returns the picks themselves, in order (the same
        uniforms: needed only when a leaf empties). ``n`` at most the buffer's size."""
        uniforms, start = self._take(n)
        out = np.empty(leaves, dtype=np.int64) if kernels.COMPILED else None
        counts, top = kernels.pick_counts(uniforms, start, n, leaves, out)
        return counts, top, partial(kernels.picks_of, uniforms, start, n, leaves)

    def even_counts(self, n: int, leaves: int) -> np.ndarray:
        """``n`` picks uniform over ``leaves`` as counts: a multinomial draw with equal
        odds, one binomial per leaf, each from one buffered uniform (``leaves - 1`` in
        all; ``kernels.even_counts``). Its cost grows with the leaves and the square root
        of the picks per leaf, not with ``n``; numpy's ``multinomial`` draws the same
        distribution from other random numbers."""
        used = leaves - 1
        if used > self._buffer:
            uniforms, start = self.random(used), 0
        else:
            uniforms, start = self._take(used)
        out = np.empty(leaves, dtype=np.int64) if kernels.COMPILED else None
        counts: np.ndarray = kernels.even_counts(uniforms, start, n, leaves, out)
        return counts

    def window(self, n: int) -> tuple[np.ndarray, int]:
        """``ahead()``, refilled first if fewer than ``n`` uniforms are left (``n`` at most
        the buffer's size): a draw that uses up to ``n`` of them in place, then consumes
        what it used."""
        if self._used + n > self._buffer:
            self._refill()
        return self._uniforms, self._used

    def ahead(self) -> tuple[np.ndarray, int]:
        """The buffer and where its unused uniforms start (``kernels.first_round`` reads
        them in place; ``consume`` then moves past what it used)."""
        return self._uniforms, self._used

    def consume(self, n: int) -> None:
        self._used += n

    def seek(self, end: int) -> None:
        """The buffer's uniforms before ``end`` are used (a draw that read them in place,
        refilling the buffer as it went: ``_rounds``)."""
        self._used = end

    def _take(self, n: int) -> tuple[np.ndarray, int]:
        """The next ``n`` uniforms: the buffer (refilled first if it has fewer left) and
        where they start in it."""
        if self._used + n > self._buffer:
            self._refill()
        start = self._used
        self._used = start + n
        return self._uniforms, start

    def _refill(self) -> None:
        """New uniforms, drawn over the used buffer in place: the same values as a fresh
        ``random(buffer)``, without allocating 256 KiB (timed inside a churned cache's
        eviction, a fresh array's first writes cost as much again as the draw). Every
        reader of the buffer is done with it by then: the picks a round may still need
        (``pick_counts``' function) are read before the generator draws again."""
        self.random(out=self._uniforms)
        self._used = 0

    def __reduce__(self) -> tuple[Callable[..., Draws], tuple[Any, ...]]:  # type: ignore[override]
        # numpy's own reduce would rebuild a plain Generator, without the buffer.
        state = (self.bit_generator.state, self._buffer, self._uniforms.copy(), self._used)
        return _rebuild_draws, state


def _rebuild_draws(state: dict[str, Any], buffer: int, uniforms: np.ndarray, used: int) -> Draws:
    """A copy or unpickling of a ``Draws``: the same stream from where it was."""
    draws = Draws(0, buffer)
    draws.bit_generator.state = state
    draws._uniforms, draws._used = uniforms, used
    return draws


def draw_leaf_counts(
    pages: np.ndarray,
    need: int,
    gen: np.random.Generator,
    parent_joins: ParentJoins,
    *,
    max_rounds: int = _MAX_ROUNDS,
    method: str | None = None,
    first: Drawn | None = None,
    smallest: int | None = None,
) -> tuple[np.ndarray, list[int]]:
    """The draw on arrays: (pages taken per label, labels that emptied, in order).

    Leaf ``i`` of ``pages`` (each >= 1, in a deterministic order) has label ``i``; a parent
    that joins gets the next label (``len(pages)``, then up), so the returned counts have one
    entry per candidate and then one per parent that joined. A label in the emptied list lost
    all its pages; children come before their parents.

    Until a leaf empties the candidate set is fixed and the picks are i.i.d. uniform over it.
    Two kinds of round use that, each exact, and the continuous-time draw finishes whatever
    they leave (the process is Markov, so switching is exact):

    - ``multinomial``: ``m`` = the smallest leaf's remaining pages; ``m`` picks are one
      multinomial draw (a leaf that the last pick empties leaves before the next round).
      O(leaves) per round: for a few big leaves;
    - ``cut``: all remaining picks in one draw, kept up to the first pick that empties a
      leaf; the picks after it are discarded and drawn again over the new set (they are
      independent of the past). O(picks) per round, or O(leaves) when the picks are drawn as
      counts (many picks per leaf; where the first leaf empties among them is then drawn
      from the counts, O(log picks) per leaf that can empty: ``_counts_emptying``): for many
      leaves of which few can empty (a scheduler evicting for one request, the common case).

    - ``steps``: the definition, one buffered uniform per page (``Draws`` only, at most
      ``_STEP_PAGES`` pages): O(pages), ~3-5 ns each compiled, plus a Python call per
      emptying: for a draw in which leaves are likely to empty among a few thousand pages.
    - ``rounds``: cut rounds drawn as counts, their loop compiled (``kernels.cut_rounds``),
      a Python call per emptying: O(leaves + log(pages) per leaf that can empty) a round,
      for the same draws when each leaf gets many picks and few are likely to empty (long
      documents, one trimmed short).

    Unless ``method`` forces one (tests), the draw starts with a cut round, which in the
    common case (no leaf empties) is the whole draw; the method for the rest is chosen from
    the sizes before any draw, which keeps it exact. ``first`` is that round's picks if the
    caller drew them already (``(counts, None)``: a multinomial draw of ``need`` picks);
    ``smallest`` is ``min(pages)`` if the caller has it.
    """
    pages = np.asarray(pages, dtype=np.int64)
    if need <= 0 or len(pages) == 0:
        return np.zeros(len(pages), dtype=np.int64), []
    if smallest is None:
        smallest = int(_min(pages))
    chosen = method or _choose(pages, need, max_rounds, smallest, _stepwise(gen, need))
    if chosen not in METHODS:
        raise ValueError(f"unknown method {chosen!r}; known: {', '.join(METHODS)}")
    if chosen == "steps":
        return _steps(pages, need, gen, parent_joins)
    if chosen == "rounds":
        return _rounds(pages, need, gen, parent_joins)
    if first is None and method is None and chosen != "continuous":
        first = _draw_picks(gen, len(pages), need)
        if _nobody_empties(first[0], pages, need, smallest):
            return first[0], []  # these picks are the whole draw
    state = _Rounds(pages, need, gen, parent_joins)
    if first is not None:
        state.cut_round(first)
    if chosen == "multinomial":
        while state.need > 0 and len(state.active):
            m = min(state.need, int(_min(state.remaining)))
            if state.need > m * max_rounds:
                break
            state.multinomial_round(m)
    elif chosen == "cut":
        for _ in range(max_rounds):
            if state.need <= 0 or not len(state.active):
                break
            state.cut_round()
    return state.finish()


def _choose(
    remaining: np.ndarray | Sequence[int],
    need: int,
    max_rounds: int,
    smallest: int | None = None,
    stepwise: bool = False,
) -> str:
    """The cheapest exact path: where a leaf is likely to empty, compiled rounds of counts
    if the leaves get ``_BINOMIAL_PICKS_PER_LEAF`` picks each or more and few are likely to
    empty (``rounds``: a leaf's pages cost one binomial a round, not a step each; any
    generator), else page by page among a few thousand pages (``stepwise``: the generator
    can, ``_stepwise``); else rounds while few leaves can empty, else continuous time.

    Takes an array or, for a handful of leaves, a list (the same rule without numpy calls,
    so that both make the same choice and hence the same draws); ``smallest`` is its
    minimum if the caller has it. ``_kernels.c``'s ``first_round`` applies the same rule
    (and ``_draw_picks``' for the first round) and must change with them: a test compares
    them."""
    leaves = len(remaining)
    if smallest is None:
        smallest = min(remaining) if isinstance(remaining, list) else int(np.min(remaining))
    if need <= smallest:
        return "cut"  # no leaf can empty: one round is the whole draw
    likely = smallest <= _likely_bound(need, leaves)
    if (
        likely
        and need >= leaves * _BINOMIAL_PICKS_PER_LEAF
        and _likely_emptyings(remaining, need) <= max_rounds
    ):
        return "rounds"
    if stepwise and likely:
        return "steps"
    if need <= smallest * max_rounds and leaves * _MULTINOMIAL_PICKS_PER_LEAF <= need:
        return "multinomial"
    if not likely:
        return "cut"  # no leaf is likely to empty (``_likely_emptyings`` would count 0)
    if _likely_emptyings(remaining, need) <= max_rounds:
        return "cut"
    return "continuous"


class _Rounds:
    """The state of one draw: active labels, their remaining and taken pages."""

    def __init__(
        self, pages: np.ndarray, need: int, gen: np.random.Generator, parent_joins: ParentJoins
    ) -> None:
        self.need = need
        self.gen = gen
        self.parent_joins = parent_joins
        self.next_label = len(pages)  # a parent that joins gets this label
        self.emptied: list[int] = []
        self.emptied_taken: list[int] = []
        self.active = np.arange(len(pages), dtype=np.int64)
        self.remaining = pages.copy()
        self.picked = np.zeros_like(self.remaining)  # pages taken so far per active leaf

    def join(self, label: int) -> tuple[int, int] | None:
        """``label`` emptied: (the parent's label, its pages) if it joins."""
        pages = self.parent_joins(label)
        if pages is None or pages <= 0:
            return None
        self.next_label += 1
        return self.next_label - 1, pages

    def _take(self, counts: np.ndarray, picks: int) -> None:
        self.picked += counts
        self.remaining -= counts
        self.need -= picks

    def _empty(self, i: int) -> None:
        """Active leaf ``i`` has no page left: it leaves, and its parent may join."""
        label = int(self.active[i])
        self.emptied.append(label)
        self.emptied_taken.append(int(self.picked[i]))
        self.active = np.delete(self.active, i)
        self.remaining = np.delete(self.remaining, i)
        self.picked = np.delete(self.picked, i)
        joined = self.join(label)
        if joined is not None:
            self.active = np.append(self.active, joined[0])
            self.remaining = np.append(self.remaining, joined[1])
            self.picked = np.append(self.picked, 0)

    def multinomial_round(self, m: int) -> None:
        self._take(_draw_picks(self.gen, len(self.active), m)[0], m)
        if _min(self.remaining) == 0:  # at most one leaf: it took all m picks of this round
            self._empty(int(np.argmin(self.remaining)))

    def cut_round(self, drawn: Drawn | None = None) -> None:
        """One cut round, on ``drawn`` (``_draw_picks`` for the current state) if given."""
        k, remaining, need = len(self.active), self.remaining, self.need
        counts, picks = drawn if drawn is not None else _draw_picks(self.gen, k, need)
        if not _any(counts >= remaining):  # nobody empties: every pick stands
            self._take(counts, need)
            return
        # The pick that empties a leaf first ends the round, and the picks per leaf up to
        # it are what the round takes.
        if picks is None:  # drawn as counts: where it lies in their (uniform) order
            cut, taken = _counts_emptying(self.gen, counts, remaining, k)
        else:  # one pass over the picks, up to it (``kernels.first_emptying``)
            if callable(picks):  # counted from ``Draws``' buffer: the same picks, in order
                picks = picks()
            out = np.empty_like(counts)
            cut, taken = kernels.first_emptying(picks, len(picks), remaining, k, out)
        assert cut >= 0  # a leaf's count reached what it holds
        self._take(taken, cut + 1)
        self._empty(int(np.argmin(self.remaining)))  # the only leaf with no page left

    def finish(self) -> tuple[np.ndarray, list[int]]:
        """The continuous-time draw for what is left, then the counts per label."""
        emptied, emptied_taken = self.emptied, self.emptied_taken
        active, picked = self.active, self.picked
        late: tuple[list[int], np.ndarray] | None = None
        if self.need > 0 and len(active):
            labels, counts, gone = _continuous_draw(
                active.tolist(),
                self.remaining.tolist(),
                self.need,
                self.gen,
                self.parent_joins,
                self.next_label,
            )
            emptied = emptied + gone
            late = (labels, counts)
            self.next_label += len(labels) - len(active)  # the parents that joined there
        out = np.zeros(self.next_label, dtype=np.int64)
        out[np.asarray(self.emptied, dtype=np.int64)] = emptied_taken
        out[active] += picked
        if late is not None:
            out[np.asarray(late[0], dtype=np.int64)] += late[1]
        return out, emptied


def draw_first_round(
    pages: list[int], need: int, gen: np.random.Generator
) -> tuple[str | None, Drawn | None, list[int] | None]:
    """For ``pages`` (a short list): the method ``draw_leaf_counts`` would choose (None if
    there is nothing to draw); the first cut round it would draw, or None if it would not
    start with one; and, if no leaf emptied in that round, the pages taken per leaf as a
    list: the whole draw. Otherwise the caller passes the method and the round on
    (``method=``, ``first=``) and the draw goes on from it, with the same random draws as
    if ``draw_leaf_counts`` had made them. ``draw_first_counts`` is the same on arrays."""
    if need <= 0 or not pages:
        return None, None, None
    chosen = _choose(pages, need, _MAX_ROUNDS, None, _stepwise(gen, need))
    if chosen == "continuous":
        return chosen, None, None
    if chosen in ("steps", "rounds"):
        start = _first_steps if chosen == "steps" else _first_rounds
        counts = start(gen, pages, need, min(pages))
        return chosen, None, None if counts is None else counts.tolist()
    first = _draw_picks(gen, len(pages), need)
    taken = first[0].tolist()
    if all(c < p for c, p in zip(taken, pages, strict=True)):
        return chosen, first, taken
    return chosen, first, None


def draw_first_counts(
    pages: np.ndarray, need: int, gen: np.random.Generator, smallest: int
) -> tuple[str, Drawn | None, np.ndarray | None]:
    """``draw_first_round`` for an array of pages (``smallest`` its minimum), with the
    counts as an array when no leaf emptied: the caller then sets nothing up for emptyings,
    the common case."""
    chosen = _choose(pages, need, _MAX_ROUNDS, smallest, _stepwise(gen, need))
    if need <= 0 or chosen == "continuous":
        return chosen, None, None
    if chosen == "steps":
        return chosen, None, _first_steps(gen, pages, need, smallest)
    if chosen == "rounds":
        return chosen, None, _first_rounds(gen, pages, need, smallest)
    first = _draw_picks(gen, len(pages), need)
    whole = first[0] if _nobody_empties(first[0], pages, need, smallest) else None
    return chosen, first, whole


def _stepwise(gen: np.random.Generator, need: int) -> bool:
    """Can a draw of ``need`` pages run step by step (``steps``): a ``Draws`` whose buffer
    holds a uniform per page."""
    return isinstance(gen, Draws) and need <= _STEP_PAGES and need <= gen._buffer


def _first_steps(
    gen: np.random.Generator, pages: np.ndarray | list[int], need: int, smallest: int
) -> np.ndarray | None:
    """The start of ``steps`` as a first round: the picks of the next ``need`` buffered
    uniforms, counted. If they empty no leaf they are the whole draw, consumed, and their
    counts are returned; else None, with nothing consumed: ``steps`` then runs from the
    same uniforms (so the first leaf to empty is the one these picks empty first). ``gen``
    is a ``Draws`` (``_stepwise``)."""
    assert isinstance(gen, Draws)
    uniforms, start = gen.window(need)
    out = np.empty(len(pages), dtype=np.int64) if kernels.COMPILED else None
    counts: np.ndarray
    counts, top = kernels.pick_counts(uniforms, start, need, len(pages), out)
    if _nobody_empties(counts, pages, need, smallest, top):
        gen.consume(need)
        return counts
    return None


def _steps(
    pages: np.ndarray, need: int, gen: np.random.Generator, parent_joins: ParentJoins
) -> tuple[np.ndarray, list[int]]:
    """The ``steps`` draw: the definition, page by page (``kernels.steps``), from a
    ``Draws``' buffer (any other generator, or a draw past the buffer, draws its uniforms
    at once). Returns ``draw_leaf_counts``' (counts per label, labels emptied in order)."""
    k = len(pages)
    if isinstance(gen, Draws) and need <= gen._buffer:
        draws: Draws | None = gen
        uniforms, start = gen.window(need)
    else:
        draws, uniforms, start = None, gen.random(need), 0
    out = np.empty(k, dtype=np.int64) if kernels.COMPILED else None
    taken, used, emptied, joined = kernels.steps(uniforms, start, need, pages, k, parent_joins, out)
    if draws is not None:
        draws.consume(used)
    if joined:
        taken = np.concatenate((taken, np.asarray(joined, dtype=np.int64)))
    return taken, emptied


def _first_rounds(
    gen: np.random.Generator, pages: np.ndarray | list[int], need: int, smallest: int
) -> np.ndarray | None:
    """The start of ``rounds`` as a first round: its counts (``even_counts``, from the
    next ``len(pages) - 1`` buffered uniforms). If they empty no leaf they are the whole
    draw, consumed, and returned; else None, with nothing consumed: ``rounds`` then draws
    the same counts first. Any other generator has no buffer to read ahead: None, nothing
    drawn (``rounds`` draws it all from a buffer of its own)."""
    if not isinstance(gen, Draws):
        return None
    k = len(pages)
    uniforms, start = gen.window(k - 1)
    out = np.empty(k, dtype=np.int64) if kernels.COMPILED else None
    counts: np.ndarray = kernels.even_counts(uniforms, start, need, k, out)
    if _nobody_empties(counts, pages, need, smallest):
        gen.consume(k - 1)
        return counts
    return None


def _rounds(
    pages: np.ndarray, need: int, gen: np.random.Generator, parent_joins: ParentJoins
) -> tuple[np.ndarray, list[int]]:
    """The ``rounds`` draw (``kernels.cut_rounds``: ``steps``' draw by rounds of counts,
    each cut at its first emptying) from a ``Draws``' buffer, refilled in place as the
    rounds need; any other generator (or a buffer too small for a round) fills a buffer of
    its own. Returns ``draw_leaf_counts``' (counts per label, labels emptied in order)."""
    k = len(pages)
    room = max(k * (need.bit_length() + 2), 1)  # the most one round may use
    draws = gen if isinstance(gen, Draws) and room <= gen._buffer else None
    if draws is not None:
        uniforms, start = draws.ahead()
        refill: Callable[[], object] = draws._refill
    else:
        uniforms, start = gen.random(room), 0
        refill = partial(gen.random, out=uniforms)
    out = np.empty(k, dtype=np.int64) if kernels.COMPILED else None
    taken, end, emptied, joined = kernels.cut_rounds(
        uniforms, start, need, pages, k, parent_joins, refill, out
    )
    if draws is not None:
        draws.seek(end)
    if joined:
        taken = np.concatenate((taken, np.asarray(joined, dtype=np.int64)))
    return taken, emptied


def _nobody_empties(
    counts: np.ndarray,
    pages: np.ndarray | list[int],
    need: int,
    smallest: int,
    top: int | None = None,
) -> bool:
    """Did a first round's ``counts`` leave every leaf a page? Checked on the largest count
    first (``top``, if the caller has it): one call where every leaf holds more than any
    leaf got, the common case."""
    if need < smallest:
        return True
    if top is None:
        top = int(_max(counts))
    return top < smallest or bool((counts < np.asarray(pages)).all())


def _draw_picks(gen: np.random.Generator, leaves: int, need: int) -> Drawn:
    """``need`` picks uniform over ``leaves``: (counts per leaf, the picks in order, or None
    when they were drawn as counts only). A ``Draws`` serves the picks from its buffer,
    counted in one compiled loop, with a function that gives them in order if a leaf
    empties, or with very many picks per leaf (``_BINOMIAL_PICKS_PER_LEAF``, or many and
    more than its buffer holds) draws the counts themselves (``Draws.even_counts``); any
    other generator draws the picks, or with many per leaf a multinomial."""
    many = need >= _MULTINOMIAL_PICKS_PER_LEAF * leaves
    if isinstance(gen, Draws):
        if need >= _BINOMIAL_PICKS_PER_LEAF * leaves or (many and need > gen._buffer):
            return gen.even_counts(need, leaves), None
        if need <= gen._buffer:
            counts, _, picks_in_order = gen.pick_counts(leaves, need)
            return counts, picks_in_order
    elif many:
        # Probabilities as a list: numpy converts it inside the call, which costs less cold
        # than a separate ``np.full`` (the same float64 values, so the same draw).
        return gen.multinomial(need, [1.0 / leaves] * leaves), None
    picks = gen.integers(0, leaves, size=need)
    return np.bincount(picks, minlength=leaves), picks


def _counts_emptying(
    gen: np.random.Generator, counts: np.ndarray, remaining: np.ndarray, k: int
) -> tuple[int, np.ndarray]:
    """For a round drawn as counts (some leaf's reaching what it holds): the position of the
    pick that empties the first leaf in the picks' order, which given the counts is a
    uniformly random arrangement, and the picks per leaf up to it (``kernels.
    counts_emptying``: a few hypergeometric draws per leaf that can empty, O(log picks)
    each, instead of a permutation of the picks). Its uniforms come from a ``Draws``'
    buffer (those it used consumed), else from ``gen.random``."""
    reach = int(np.count_nonzero(counts >= remaining))
    bound = reach * int(_sum(counts)).bit_length() + k
    out = np.empty(k, dtype=np.int64) if kernels.COMPILED else None
    if isinstance(gen, Draws) and bound <= gen._buffer:
        uniforms, start = gen.window(bound)
        cut, used, taken = kernels.counts_emptying(counts, remaining, k, uniforms, start, out)
        gen.consume(used)
    else:
        uniforms = gen.random(bound)
        cut, used, taken = kernels.counts_emptying(counts, remaining, k, uniforms, 0, out)
    return cut, taken


def _likely_bound(need: int, leaves: int) -> float:
    """Pages within ~3 standard deviations of a leaf's expected share of ``need`` picks."""
    mean = need / leaves
    return mean + 3.0 * math.sqrt(mean) + 1.0


def _likely_emptyings(remaining: np.ndarray | Sequence[int], need: int) -> int:
    """Leaves whose size is within ~3 standard deviations of their expected share of picks
    (``need / leaves`` each, binomial): a cheap bound on how many rounds would be needed."""
    bound = _likely_bound(need, len(remaining))
    if isinstance(remaining, list):
        return sum(1 for pages in remaining if pages <= bound)
    return int(np.count_nonzero(np.asarray(remaining) <= bound))


def _continuous_draw(
    labels: list[int],
    size_list: list[int],
    need: int,
    gen: np.random.Generator,
    parent_joins: ParentJoins,
    next_label: int,
) -> tuple[list[int], np.ndarray, list[int]]:
    """Steps 1-3 of the module docstring over the leaves ``labels`` (``size_list`` pages
    left each): (every label involved, pages taken per label, labels emptied in order).
    Parents that join get labels ``next_label`` and up.

    The walk over the emptyings stops early: rings arrive at rate (active leaves), so once
    the time integral of the active count passes ``need`` by a margin, the target ring very
    likely lies before that moment; the ring counts sampled there (one bridge) confirm it and
    bound the bisection, so the walk visits only the emptyings before the target (not all
    those before the emptied pages alone reach ``need``). If the sample falls short (rare),
    the walk goes on from there with that sample as the lower bound.
    """
    k = len(labels)
    end_initial = gen.standard_gamma(np.asarray(size_list, dtype=np.float64))
    order_array = np.argsort(end_initial, kind="stable")
    order = order_array.tolist()
    sorted_end = end_initial[order_array].tolist()  # the initial leaves' ends, in order
    end_list = end_initial.tolist()
    start_list = [0.0] * k
    joined: list[tuple[float, int]] = []  # heap of parents that joined later

    stop_area = need + _STOP_MARGIN_SD * math.sqrt(need) + _STOP_MARGIN_RINGS
    area, t_prev, active = 0.0, 0.0, k
    checking = True
    t_lo, lo_counts, first_after_lo = 0.0, None, 0  # lower bracket: time, counts, event index
    emptied_pages, pos = 0, 0
    events: list[int] = []  # leaf index of each emptying, in time order
    areas: list[float] = []  # while checking: the area at each emptying,
    actives: list[int] = []  # and the active leaves just after it
    gamma, heappush, heappop = _GammaDraws(gen), heapq.heappush, heapq.heappop
    while emptied_pages < need:
        if joined and (pos >= k or joined[0][0] < sorted_end[pos]):
            from_heap, t_next = True, joined[0][0]
        elif pos < k:
            from_heap, t_next = False, sorted_end[pos]
        else:
            break
        if checking:
            grown = area + active * (t_next - t_prev)
            if grown >= stop_area:
                t_stop = t_prev + (stop_area - area) / active
                arrays = _arrays(start_list, end_list, size_list)
                zeros = np.zeros(len(size_list), dtype=np.int64)
                at_stop = _bridge(*arrays, 0.0, np.inf, zeros, None, t_stop, gen)
                if int(_sum(at_stop)) >= need:  # the target lies before t_stop
                    times = [end_list[i] for i in events]
                    t_low = _time_at_area(need - (stop_area - need), times, areas, actives, k)
                    counts = _counts_below(
                        arrays, times, events, need, gen, zeros, t_stop, at_stop, t_low
                    )
                    return labels, counts, [labels[i] for i in events if counts[i] == size_list[i]]
                checking = False  # rare: walk on, from this sample
                t_lo, lo_counts, first_after_lo = t_stop, at_stop, len(events)
            else:
                area, t_prev = grown, t_next
        if from_heap:
            idx = heappop(joined)[1]
        else:
            idx = order[pos]
            pos += 1
        emptied_pages += size_list[idx]
        events.append(idx)
        parent_pages = parent_joins(labels[idx])
        if parent_pages is None or parent_pages <= 0:
            active -= 1
        else:
            end = t_next + gamma(parent_pages)
            heappush(joined, (end, len(labels)))
            labels.append(next_label)
            next_label += 1
            size_list.append(parent_pages)
            start_list.append(t_next)
            end_list.append(end)
        if checking:
            areas.append(area)
            actives.append(active)
    still_active = pos < k or bool(joined)
    size = np.asarray(size_list, dtype=np.int64)
    if emptied_pages < need or (emptied_pages == need and not still_active):
        counts = np.zeros_like(size)  # fewer pages than asked: all of the emptied go
        counts[events] = size[events]
        return labels, counts, [labels[i] for i in events]

    arrays = _arrays(start_list, end_list, size_list)
    lo = np.zeros_like(size)
    if lo_counts is not None:
        lo[: len(lo_counts)] = lo_counts  # parents that joined later had no ring before
    t_hi = end_list[events[-1]]
    hi = _bridge(*arrays, t_lo, np.inf, lo, None, t_hi, gen)
    inner = events[first_after_lo:-1]
    counts = _counts_at_target(
        *arrays, [end_list[i] for i in inner], inner, need, gen, t_lo, lo, t_hi, hi, events[-1]
    )
    gone = [labels[i] for i in events if counts[i] == size_list[i]]
    return labels, counts, gone


class _GammaDraws:
    """Independent Gamma(c, 1) draws for the clocks of the parents that join. The first
    parent of a size ``c`` gets a scalar draw; from the second on, they come
    ``_GAMMA_BATCH`` at a time, a batch costing about one scalar call (~1.6 us). Parents of
    equal size are common (a chat's reply chains: a few sizes of turn), so most joins there
    pop a value drawn before: ~12% off a 50k-token eviction of the chat tree. The values are
    i.i.d. whatever order they are used in, so the walk stays exact; leftovers are dropped."""

    __slots__ = ("gen", "ready")

    def __init__(self, gen: np.random.Generator) -> None:
        self.gen = gen
        self.ready: dict[int, list[float]] = {}

    def __call__(self, pages: int) -> float:
        ready = self.ready.get(pages)
        if ready:
            return ready.pop()
        if ready is None:  # the first parent of this size: one scalar draw
            self.ready[pages] = []
            return float(self.gen.standard_gamma(pages))
        ready.extend(self.gen.standard_gamma(pages, _GAMMA_BATCH).tolist())
        return ready.pop()


def _time_at_area(
    target: float, times: list[float], areas: list[float], actives: list[int], leaves: int
) -> float | None:
    """When the walk's area (active leaves x time) reached ``target``, strictly between two
    emptyings; None if that is not a usable time (at or before 0, or on an emptying)."""
    if target <= 0:
        return None
    i = bisect.bisect_right(areas, target) - 1  # the last emptying at or below the target
    if i < 0:
        return target / leaves
    if actives[i] == 0 or areas[i] == target:
        return None
    return times[i] + (target - areas[i]) / actives[i]


def _counts_below(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
    times: list[float],
    events: list[int],
    need: int,
    gen: np.random.Generator,
    zeros: np.ndarray,
    t_stop: float,
    at_stop: np.ndarray,
    t_low: float | None,
) -> np.ndarray:
    """``_counts_at_target`` for a target known to lie before ``t_stop`` (a time that is no
    emptying). The expected rings at ``t_low`` are as far below ``need`` as ``t_stop``'s are
    above, so one bridge sample there usually brackets the target between ``t_low`` and
    ``t_stop``, with few emptyings left to bisect over; if it does not, the bisection runs
    below ``t_low`` instead. Either way it is a sample of the same bridge, so exact."""
    if t_low is None:
        return _counts_at_target(
            *arrays, times, events, need, gen, 0.0, zeros, t_stop, at_stop, None
        )
    at_low = _bridge(*arrays, 0.0, t_stop, zeros, at_stop, t_low, gen)
    split = bisect.bisect_right(times, t_low)
    if int(_sum(at_low)) < need:
        return _counts_at_target(
            *arrays, times[split:], events[split:], need, gen, t_low, at_low, t_stop, at_stop, None
        )
    return _counts_at_target(
        *arrays, times[:split], events[:split], need, gen, 0.0, zeros, t_low, at_low, None
    )


def _arrays(
    start_list: list[float], end_list: list[float], size_list: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.asarray(start_list),
        np.asarray(end_list),
        np.asarray(size_list, dtype=np.int64),
    )


def _counts_at_target(
    start: np.ndarray,
    end: np.ndarray,
    size: np.ndarray,
    event_times: list[float],
    event_leaf: list[int],
    need: int,
    gen: np.random.Generator,
    t_lo: float,
    lo_counts: np.ndarray,
    t_hi: float,
    hi_counts: np.ndarray,
    hi_ring: int | None,
) -> np.ndarray:
    """Ring counts per leaf just after the ``need``-th ring overall (steps 2 and 3).

    The counts at ``t_lo`` (fewer than ``need`` rings) and ``t_hi`` (at least ``need``)
    bracket the target; ``event_times`` are the emptyings strictly between them (leaf
    ``event_leaf[i]`` rings last at ``event_times[i]``); ``hi_ring`` is the leaf whose last
    ring falls exactly at ``t_hi``, or None when ``t_hi`` is not an emptying.
    """
    lo_i, hi_i = -1, len(event_times)
    lo_sum, hi_sum = int(_sum(lo_counts)), int(_sum(hi_counts))
    while hi_i - lo_i > 1 and hi_sum - lo_sum > _SORT_GAP_RINGS:
        mid = (lo_i + hi_i) // 2
        t = event_times[mid]
        mid_counts = _bridge(start, end, size, t_lo, t_hi, lo_counts, hi_counts, t, gen)
        mid_sum = int(_sum(mid_counts))
        if mid_sum >= need:
            hi_i, t_hi, hi_counts, hi_ring, hi_sum = mid, t, mid_counts, event_leaf[mid], mid_sum
        else:
            lo_i, t_lo, lo_counts, lo_sum = mid, t, mid_counts, mid_sum

    wanted = need - lo_sum
    if wanted == hi_sum - lo_sum:
        return hi_counts
    if hi_i - lo_i > 1:  # leaves empty inside the gap: order its few rings by time
        return _first_rings_in_gap(start, end, t_lo, lo_counts, t_hi, hi_counts, wanted, gen)
    in_gap = hi_counts - lo_counts
    # No leaf empties inside the gap, so its rings are uniformly ordered, except a ring at
    # t_hi itself (an emptying), which is the gap's last: the first `wanted` of the others
    # are a hypergeometric sample.
    if hi_ring is not None:
        in_gap[hi_ring] -= 1
    return lo_counts + gen.multivariate_hypergeometric(in_gap, wanted)


def _first_rings_in_gap(
    start: np.ndarray,
    end: np.ndarray,
    t_lo: float,
    lo_counts: np.ndarray,
    t_hi: float,
    hi_counts: np.ndarray,
    wanted: int,
    gen: np.random.Generator,
) -> np.ndarray:
    """Ring counts per leaf after the first ``wanted`` rings between ``t_lo`` and ``t_hi``,
    given the counts at both ends: step 3 for a gap in which leaves empty.

    Given both counts, a leaf's rings in the gap are independent uniform times on its part
    of the gap (``max(start, t_lo)`` to ``min(end, t_hi)``), except the last ring of a leaf
    that empties inside, which sits at its ``end``. Drawing those times and taking the first
    ``wanted`` replaces the bisection over the emptyings (a bridge sample each) once the gap
    holds few rings (``_SORT_GAP_RINGS``).
    """
    # Compiled loops (``kernels``) around the one draw, numpy's: the rings whose times are
    # drawn (a leaf's final ring, if in the gap, sits at its ``end``), then the times, the
    # ``wanted`` earliest and the counts.
    n = len(lo_counts)
    compiled = kernels.COMPILED
    rings, drawn = kernels.gap_rings(
        start, end, lo_counts, hi_counts, t_lo, t_hi, np.empty(n, np.int64) if compiled else None
    )
    uniforms = gen.random(drawn)
    out = np.empty(n, np.int64) if compiled else None
    counts: np.ndarray = kernels.gap_first(
        start, end, lo_counts, t_lo, t_hi, rings, uniforms, wanted, out
    )
    return counts


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
    # The arithmetic around the draw is one compiled loop each (``kernels``); the draw is
    # numpy's binomial, on the same parameters either way.
    outs = (
        (np.empty(len(size), np.int64), np.empty(len(size))) if kernels.COMPILED else (None, None)
    )
    n, p = kernels.bridge_params(start, end, size, lo_counts, hi_counts, t_lo, t_hi, t, *outs)
    drawn = gen.binomial(n, p)
    counts: np.ndarray
    counts, _ = kernels.bridge_finish(start, end, size, lo_counts, drawn, t)
    return counts
