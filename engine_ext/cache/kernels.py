"""RLT's per-eviction loops over the leaf registry: compiled when built, else numpy.

An eviction of a few thousand tokens is little work (a few hundred leaves, a few thousand
picks) spread over many small numpy calls, and a numpy call costs microseconds when the
caches are cold, as they are in a scheduler between batches: most of the eviction's time
(see docs/sglang_plugin.md, "Eviction cost"). ``_kernels`` (``_kernels.c``, built by
``pip install`` when a C compiler is at hand; ``setup.py``) runs each of these loops as one
C call that writes into arrays the caller owns (int64 unless said) and allocates nothing.
Without it, the numpy twins below do the same work, returning new arrays where the C loops
fill the caller's; ``COMPILED`` says which are in use, and the tests check that both give
the same results.

- ``first_round(mark, size, end, phase, page, need, uniforms, start, picks_per_leaf,
  binomial_per_leaf, max_rounds, step_pages, slots_out, pages_out, counts_out) -> (status,
  k, smallest, used, slots, pages)``: an eviction's common case at once. The candidates:
  the slots ``i < end`` with ``mark[i] < phase``, in order (``slots[:k]``), their sizes in
  pages (``size // page``; ``pages[:k]``) and the smallest of those (0 if none). Then,
  unless ``leaf_sampling`` goes straight to the continuous-time draw, the first round as
  ``Draws`` draws it, into ``counts_out[:k]``: ``need`` buffered picks (fewer than
  ``binomial_per_leaf`` per leaf, and no more than the buffer's length if at least
  ``picks_per_leaf``; always where ``leaf_sampling`` would draw page by page: ``need`` at
  most ``step_pages`` and the buffer's length, and a leaf likely to empty), else
  ``even_counts``; ``used`` uniforms from ``start``, if what is left of the buffer holds
  them. ``WHOLE``: no leaf emptied, the counts are the whole draw (the caller consumes
  the ``used`` uniforms); ``STEPS``: a leaf emptied in a page-by-page draw's picks (the
  count stops at that pick), which the caller runs (``steps``) from ``start``;
  ``ROUNDS``: a leaf emptied in the first of compiled rounds of counts (at least
  ``binomial_per_leaf`` picks per leaf, at most ``max_rounds`` leaves likely to empty),
  which the caller runs (``cut_rounds``, whose first round is the same counts) from
  ``start``; ``DRAW``: the caller draws, from these candidates (for these three, no
  uniform was consumed, ``used`` is 0); ``SHORT``: they hold fewer than ``need`` pages.
  The numpy twin never says ``WHOLE``, ``STEPS`` or ``ROUNDS``: the caller's own draw
  then runs, which is the same draw
  (``tests/engine_ext/test_kernels.py``).
- ``steps(uniforms, start, need, pages, k, parent_joins, taken_out) -> (taken, used,
  emptied, joined_taken)``: RLT's draw by its definition, page by page: ``k`` candidate
  leaves of ``pages[:k]`` pages (each >= 1, labels ``0 .. k - 1``), ``need`` picks, each
  ``floor(u * active)`` of the next uniform from ``start`` over the active leaves in order;
  a leaf that empties leaves the order (the rest keep theirs) and ``parent_joins(label)``
  (int or None) may add its parent, with that many pages, at the end (labels ``k`` and
  up). Stops when ``need`` pages are taken or no leaf is left. ``taken[:k]``: pages taken
  per candidate; ``used``: uniforms used (one per page); ``emptied``: labels in the order
  they emptied; ``joined_taken``: pages taken per joined parent. The twin runs the same
  picks in chunks (a bincount per chunk, cut at its first emptying).
- ``pick_counts(uniforms, start, n, leaves, counts_out) -> (counts, top)``: how many of the
  float64 ``uniforms[start:start + n]`` pick each leaf (``counts[:leaves]``), a pick being
  ``floor(u * leaves)``, and the largest count.
- ``even_counts(uniforms, start, n, leaves, counts_out) -> counts``: ``n`` picks uniform
  over ``leaves`` as counts (a multinomial draw with equal odds), from the ``leaves - 1``
  uniforms from ``start``: one binomial per leaf, each inverted from one uniform by a
  search outward from its mode (``_kernels.c`` explains it). Its twin is plain Python
  (a handful of float operations per leaf and per step of the search), step for step
  the C arithmetic, so both draw the same counts.
- ``bridge_params(start, end, size, lo, hi, t_lo, t_hi, t, n_out, p_out) -> (n, p)`` and
  ``bridge_finish(start, end, size, lo, drawn, t) -> (counts, total)``: the arithmetic
  around the binomial draw of ``leaf_sampling._bridge`` (every leaf's ring count at ``t``
  given its counts at ``t_lo`` and ``t_hi``; ``hi`` None: no upper bracket yet), before
  it (the draw's parameters, the same float64 operations) and after it (``drawn`` turned
  into counts, in place, and their sum); the draw itself stays numpy's.
- ``gap_rings(start, end, lo, hi, t_lo, t_hi, rings_out) -> (rings, total)`` and
  ``gap_first(start, end, lo, t_lo, t_hi, rings, uniforms, wanted, out) -> counts``: the
  same for ``leaf_sampling._first_rings_in_gap`` (the first ``wanted`` rings of a gap in
  which leaves empty): the rings whose times are drawn, then, given those uniforms, the
  ring counts after the ``wanted`` earliest (a quickselect in C, numpy's argpartition in
  the twin; times are continuous, so a tie at the boundary, where the two could choose
  differently, has probability zero).
- ``first_emptying(picks, n, remaining, k, counts_out) -> (position, counts)``: a cut
  round's first ``n`` picks in order (leaf indices): the position of the first one that
  takes a leaf's last page (its count reaching ``remaining``) and the picks per leaf up to
  it, in one pass that stops there; (-1, every pick's counts) if none does. The twin finds
  each leaf's ``remaining``-th pick and takes the earliest.
- ``counts_emptying(counts, remaining, k, uniforms, start, counts_out) -> (position, used,
  counts)``: ``first_emptying`` for a round drawn as counts only (``counts[:k]``, ``n`` in
  all): where, in a uniformly random order of those picks, the first leaf empties, and the
  picks per leaf up to it, drawn without the order: the span of positions that holds it is
  halved ``bit_length(n)`` times, each half's counts a multivariate hypergeometric sample
  (one draw per leaf that can empty, the others as one), then the others share what they
  took (one draw each). Each draw is inverted from the next uniform from ``start`` as
  ``even_counts``' binomials are (the probability at the mode is R's ``dhyper``: three of
  Loader's binomial terms); ``used`` says how many; (-1, 0, the counts) if no leaf can
  empty. The twin is plain Python, step for step the same arithmetic.
- ``cut_rounds(uniforms, start, need, pages, k, parent_joins, refill, taken_out) ->
  (taken, end, emptied, joined_taken)``: ``steps``' draw (the same leaves, labels, joins and
  results) by rounds, for leaves that get many picks each: a round draws the picks still
  needed as counts (``even_counts``) and, if a leaf empties among them, where the first
  does (``counts_emptying``); the picks after it are drawn again over the new set in the
  next round. ``refill()`` refills ``uniforms`` in place when fewer are left than a round
  may need (a ``Draws``' buffer), the round going on from position 0; ``end`` is the
  position after the last uniform used. The buffer must hold ``k * (bit_length(need) +
  2)`` uniforms. The twin is plain Python, the same draws.
- ``trim(size, slots, taken, k, page, off, starts_out, lengths_out) -> tokens``: for
  ``i < k``, ``size[slots[i]] -= taken[i] * page`` (the compiled loop, which writes raw
  memory, checks every slot and that no cut is negative or more than the leaf holds before
  it writes anything; the callers never ask for one, and ``check_invariants`` would see a
  negative size); with ``off`` (else ``None`` for it and both outputs), also
  the runs of arena positions cut, ``starts_out[i] = off[slots[i]] + new size`` and
  ``lengths_out[i] = taken[i] * page``.
- ``trim_gather(size, slots, taken, k, page, off, source, out, at) -> tokens``: ``trim``'s
  cuts with their runs copied at once, ``source[off[slots[i]] + new size:][:taken[i] *
  page]`` one after another into ``out`` from position ``at`` (room for them all checked
  before anything is written): a CPU arena's freed KV indices, without the runs' arrays.
- ``gather(source, starts, lengths, k, out) -> items``: the runs
  ``source[starts[i]:starts[i] + lengths[i]]``, ``i < k``, one after another into the start
  of ``out`` (integers of one item size, 4 or 8 bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = [
    "COMPILED",
    "DRAW",
    "NUMPY_LOOPS",
    "ROUNDS",
    "SHORT",
    "STEPS",
    "WHOLE",
    "bridge_finish",
    "bridge_params",
    "counts_emptying",
    "cut_rounds",
    "even_counts",
    "even_pmf",
    "first_emptying",
    "first_round",
    "gap_first",
    "gap_rings",
    "gather",
    "pick_counts",
    "picks_of",
    "run_positions",
    "steps",
    "trim",
    "trim_gather",
]

WHOLE, DRAW, SHORT, STEPS, ROUNDS = 0, 1, 2, 3, 4  # what ``first_round`` says

# The numpy ``steps``: picks per chunk at least (its cost is mostly per numpy call).
_STEP_CHUNK = 64

# ufunc reductions called directly (numpy's ``ndarray.min`` and friends go through Python)
_min, _max, _sum = np.minimum.reduce, np.maximum.reduce, np.add.reduce


def picks_of(uniforms: np.ndarray, start: int, n: int, leaves: int) -> np.ndarray:
    """The picks of ``uniforms[start:start + n]`` over ``leaves``, in order: ``floor(u *
    leaves)`` each (what ``pick_counts`` and ``first_round`` count)."""
    return (uniforms[start : start + n] * leaves).astype(np.intp)


def run_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``starts[i] .. starts[i] + lengths[i] - 1`` of every run (at least one),
    in order: ``gather``'s positions, for numpy and torch indexing; ufunc methods called
    directly (numpy's Python-level wrappers cost microseconds cold)."""
    ends = np.add.accumulate(lengths)
    positions = np.repeat(starts - (ends - lengths), lengths)
    positions += np.arange(int(ends[-1]), dtype=np.int64)
    return positions


def numpy_first_round(
    mark: np.ndarray,
    size: np.ndarray,
    end: int,
    phase: int,
    page: int,
    need: int,
    uniforms: np.ndarray,
    start: int,
    picks_per_leaf: int,
    binomial_per_leaf: int,
    max_rounds: int,
    step_pages: int,
    slots_out: np.ndarray,
    pages_out: np.ndarray,
    counts_out: np.ndarray,
) -> tuple[int, int, int, int, np.ndarray, np.ndarray]:
    slots = (mark[:end] < phase).nonzero()[0]
    k = len(slots)
    pages = size[slots] // page if page > 1 else size[slots]
    if not k:
        return (SHORT if need > 0 else DRAW), 0, 0, 0, slots, pages
    smallest = int(_min(pages))
    short = k * smallest < need and int(_sum(pages)) < need
    return (SHORT if short else DRAW), k, smallest, 0, slots, pages


def numpy_steps(
    uniforms: np.ndarray,
    start: int,
    need: int,
    pages: np.ndarray,
    k: int,
    parent_joins: Callable[[int], int | None],
    taken_out: np.ndarray | None,
) -> tuple[np.ndarray, int, list[int], list[int]]:
    if not 0 <= k <= len(pages) or need < 0 or start < 0 or start + need > len(uniforms):
        raise ValueError(f"start, need, k: {start}, {need}, {k} are outside the arrays")
    active = np.arange(k, dtype=np.int64)
    remaining = np.array(pages[:k], dtype=np.int64)
    if k and int(_min(remaining)) < 1:
        raise ValueError("pages: every candidate must hold a page")
    picked = np.zeros(k, dtype=np.int64)
    emptied: list[int] = []
    emptied_taken: list[int] = []
    next_label, pos, left = k, start, need
    while left > 0 and len(active):
        n = len(active)
        chunk = min(left, max(_STEP_CHUNK, 2 * n * int(_min(remaining))))
        picks = picks_of(uniforms, pos, chunk, n)
        counts = np.bincount(picks, minlength=n)
        full = np.flatnonzero(counts >= remaining)
        if full.size:  # cut the chunk at its first emptying
            chunk = 1 + min(int(np.flatnonzero(picks == i)[remaining[i] - 1]) for i in full)
            counts = np.bincount(picks[:chunk], minlength=n)
        picked += counts
        remaining -= counts
        pos += chunk
        left -= chunk
        if not full.size:
            continue
        i = int(picks[chunk - 1])
        label = int(active[i])
        emptied.append(label)
        emptied_taken.append(int(picked[i]))
        active, remaining = np.delete(active, i), np.delete(remaining, i)
        picked = np.delete(picked, i)
        joined = parent_joins(label)
        if joined is not None and joined > 0:
            active = np.append(active, next_label)
            remaining = np.append(remaining, joined)
            picked = np.append(picked, 0)
            next_label += 1
    out = np.zeros(next_label, dtype=np.int64)
    out[emptied] = emptied_taken
    out[active] += picked
    return out[:k], pos - start, emptied, out[k:].tolist()


def numpy_pick_counts(
    uniforms: np.ndarray, start: int, n: int, leaves: int, counts_out: np.ndarray | None
) -> tuple[np.ndarray, int]:
    if leaves < 1 or start < 0 or n < 0 or start + n > len(uniforms):
        raise ValueError(f"start, n, leaves: {start}, {n}, {leaves} are outside the uniforms")
    counts = np.bincount(picks_of(uniforms, start, n, leaves), minlength=leaves)
    return counts, (int(_max(counts)) if n else 0)


# ``even_counts``' arithmetic (``_kernels.c``: the same constants and operations, in order)
_LN_2PI = 1.8378770664093456
# log(n!) - log(sqrt(2 pi n) (n / e)^n) for n < 16, exact to double precision
_STIRLERR_SMALL = (
    0.0, 0.08106146679532726, 0.0413406959554093, 0.02767792568499834,
    0.020790672103765093, 0.016644691189821193, 0.013876128823070748,
    0.01189670994589177, 0.010411265261972096, 0.009255462182712733,
    0.00833056343336287, 0.007573675487951841, 0.00694284010720953,
    0.006408994188004207, 0.0059513701127588475, 0.005554733551962801,
)  # fmt: skip
_S0, _S1, _S2 = 0.083333333333333333, 0.0027777777777777778, 0.00079365079365079365
_S3, _S4 = 0.00059523809523809524, 0.00084175084175084175


def _stirlerr(n: int) -> float:
    if n < 16:
        return _STIRLERR_SMALL[n]
    x = float(n)
    nn = x * x
    if n > 500:
        return (_S0 - _S1 / nn) / x
    if n > 80:
        return (_S0 - (_S1 - _S2 / nn) / nn) / x
    if n > 35:
        return (_S0 - (_S1 - (_S2 - _S3 / nn) / nn) / nn) / x
    return (_S0 - (_S1 - (_S2 - (_S3 - _S4 / nn) / nn) / nn) / nn) / x


def _bd0(x: float, mu: float) -> float:
    d = x - mu
    if abs(d) < 0.1 * (x + mu):
        v = d / (x + mu)
        s = d * v
        ej = 2.0 * x * v
        vv = v * v
        for j in range(1, 1000):
            ej = ej * vv
            s1 = s + ej / float(2 * j + 1)
            if s1 == s:
                return s1
            s = s1
        return s
    return x * math.log(x / mu) + mu - x


def even_pmf(x: int, n: int, r: int) -> float:
    """P(Bin(n, 1/r) = x), Loader's saddle-point form (``_kernels.c``), r >= 2."""
    p = 1.0 / float(r)
    q = 1.0 - p
    if x == 0:
        return math.exp(float(n) * math.log1p(-p))
    if x == n:
        return math.exp(float(n) * math.log(p))
    lc = (
        _stirlerr(n)
        - _stirlerr(x)
        - _stirlerr(n - x)
        - _bd0(float(x), float(n) * p)
        - _bd0(float(n - x), float(n) * q)
    )
    lf = _LN_2PI + math.log(float(x)) + math.log1p(-float(x) / float(n))
    return math.exp(lc - 0.5 * lf)


def _even_binomial(n: int, r: int, u: float) -> int:
    if n == 0:
        return 0
    m = min((n + 1) // r, n)
    f = even_pmf(m, n, r)
    cum = f_hi = f_lo = f
    if u < cum:
        return m
    hi = lo = m
    rm1 = r - 1
    # Python's int / int is the correctly rounded quotient, as C's division of the same
    # integers converted exactly (all below 2**53): the same ratios as ``_kernels.c``.
    while True:
        up = hi < n and f_hi > 0.0
        down = lo > 0 and f_lo > 0.0
        if not up and not down:
            return m
        if up:
            f_hi *= (n - hi) / ((hi + 1) * rm1)
            hi += 1
            cum += f_hi
            if u < cum:
                return hi
        if down:
            f_lo *= lo * rm1 / (n - lo + 1)
            lo -= 1
            cum += f_lo
            if u < cum:
                return lo


def numpy_even_counts(
    uniforms: np.ndarray, start: int, n: int, leaves: int, counts_out: np.ndarray | None
) -> np.ndarray:
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if leaves < 1 or start < 0 or start + leaves - 1 > len(uniforms):
        raise ValueError(f"start, leaves: {start}, {leaves} are outside the uniforms")
    counts = np.empty(leaves, dtype=np.int64)
    left = n
    for j, u in enumerate(uniforms[start : start + leaves - 1].tolist()):
        if not 0.0 <= u < 1.0:
            raise ValueError(f"uniforms[{start + j}] is not in [0, 1)")
        x = _even_binomial(left, leaves - j, u)
        counts[j] = x
        left -= x
    counts[leaves - 1] = left
    return counts


def numpy_bridge_params(
    start: np.ndarray,
    end: np.ndarray,
    size: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray | None,
    t_lo: float,
    t_hi: float,
    t: float,
    n_out: np.ndarray | None,
    p_out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    lower = np.maximum(start, t_lo)
    upper = np.minimum(end, t_hi)
    inside = (start < t) & (end > t)
    between = size - 1 - lo if hi is None else hi - lo - (end <= t_hi)
    span = np.where(inside, upper - lower, 1.0)
    return np.where(inside, between, 0), np.where(inside, (t - lower) / span, 0.0)


def numpy_bridge_finish(
    start: np.ndarray,
    end: np.ndarray,
    size: np.ndarray,
    lo: np.ndarray,
    drawn: np.ndarray,
    t: float,
) -> tuple[np.ndarray, int]:
    counts = np.where(end <= t, size, np.where(start >= t, 0, lo + drawn))
    return counts, int(_sum(counts))


def numpy_gap_rings(
    start: np.ndarray,
    end: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    t_lo: float,
    t_hi: float,
    rings_out: np.ndarray | None,
) -> tuple[np.ndarray, int]:
    rings = hi - lo - ((end > t_lo) & (end <= t_hi))
    return rings, int(_sum(rings))


def numpy_gap_first(
    start: np.ndarray,
    end: np.ndarray,
    lo: np.ndarray,
    t_lo: float,
    t_hi: float,
    rings: np.ndarray,
    uniforms: np.ndarray,
    wanted: int,
    out: np.ndarray | None,
) -> np.ndarray:
    lower = np.maximum(start, t_lo)
    span = np.minimum(end, t_hi) - lower
    labels = np.repeat(np.arange(len(lo)), rings)
    times = lower[labels] + span[labels] * uniforms
    finals = np.flatnonzero((end > t_lo) & (end <= t_hi))
    labels = np.concatenate((labels, finals))
    times = np.concatenate((times, end[finals]))
    first = labels[np.argpartition(times, wanted - 1)[:wanted]]
    counts: np.ndarray = lo + np.bincount(first, minlength=len(lo))
    return counts


def numpy_first_emptying(
    picks: np.ndarray, n: int, remaining: np.ndarray, k: int, counts_out: np.ndarray | None
) -> tuple[int, np.ndarray]:
    picks, remaining = picks[:n], remaining[:k]
    counts = np.bincount(picks, minlength=k)
    full = np.flatnonzero(counts >= remaining)
    if full.size == 0:
        return -1, counts
    # For each leaf that empties, the position of its remaining-th pick; the earliest wins.
    at = min(int(np.flatnonzero(picks == i)[remaining[i] - 1]) for i in full.tolist())
    return at, np.bincount(picks[: at + 1], minlength=k)


def _binom_pmf(x: int, n: int, p: float, q: float) -> float:
    """P(Bin(n, p) = x), 0 < p < 1, q = 1 - p: R's ``dbinom_raw`` (``_kernels.c``)."""
    if x == 0:
        if n == 0:
            return 1.0
        return math.exp(
            -_bd0(float(n), float(n) * q) - float(n) * p if p < 0.1 else float(n) * math.log(q)
        )
    if x == n:
        return math.exp(
            -_bd0(float(n), float(n) * p) - float(n) * q if q < 0.1 else float(n) * math.log(p)
        )
    lc = (
        _stirlerr(n)
        - _stirlerr(x)
        - _stirlerr(n - x)
        - _bd0(float(x), float(n) * p)
        - _bd0(float(n - x), float(n) * q)
    )
    lf = _LN_2PI + math.log(float(x)) + math.log1p(-float(x) / float(n))
    return math.exp(lc - 0.5 * lf)


def _hypergeometric(good: int, bad: int, sample: int, u: float) -> int:
    """Good items in a random ``sample`` of ``good + bad``, inverted from ``u`` outward
    from the mode (``_kernels.c``, the same operations)."""
    total = good + bad
    lo, hi = max(sample - bad, 0), min(sample, good)
    if lo >= hi:
        return lo
    m = min(max((sample + 1) * (good + 1) // (total + 2), lo), hi)
    p, q = sample / total, (total - sample) / total
    f = (
        _binom_pmf(m, good, p, q)
        * _binom_pmf(sample - m, bad, p, q)
        / _binom_pmf(sample, total, p, q)
    )
    cum = f_up = f_down = f
    if u < cum:
        return m
    up = down = m
    while True:
        go_up = up < hi and f_up > 0.0
        go_down = down > lo and f_down > 0.0
        if not go_up and not go_down:
            return m
        if go_up:
            f_up *= ((good - up) * (sample - up)) / ((up + 1) * (bad - sample + up + 1))
            up += 1
            cum += f_up
            if u < cum:
                return up
        if go_down:
            f_down *= (down * (bad - sample + down)) / ((good - down + 1) * (sample - down + 1))
            down -= 1
            cum += f_down
            if u < cum:
                return down


def _emptying_draw(
    have: list[int], rest: list[int], uniform: Callable[[], float]
) -> tuple[int, list[int]]:
    """``counts_emptying``'s draw on lists (``uniform()`` gives the next uniform): the
    position and the picks per leaf up to it, or (-1, the counts)."""
    k = len(have)
    reach = [i for i in range(k) if have[i] >= rest[i]]
    if not reach:
        return -1, list(have)
    others = sum(c for c, r in zip(have, rest, strict=True) if c < r)
    span = [have[i] for i in reach]
    due = [rest[i] for i in reach]
    before = [0] * len(reach)
    length, before_others, position = sum(have), 0, 0
    while length > 1:
        first = length // 2
        pool, take, half = length, first, []
        for j in range(len(reach)):
            x = _hypergeometric(span[j], pool - span[j], take, uniform())
            half.append(x)
            pool -= span[j]
            take -= x
        if any(x >= d for x, d in zip(half, due, strict=True)):
            span, length = half, first
        else:
            span = [s - x for s, x in zip(span, half, strict=True)]
            due = [d - x for d, x in zip(due, half, strict=True)]
            before = [b + x for b, x in zip(before, half, strict=True)]
            before_others += take
            position += first
            length -= first
    out = [0] * k
    for j, i in enumerate(reach):
        out[i] = before[j] + (span[j] == 1 and due[j] == 1)
    pool, take = others, before_others
    lower = [i for i in range(k) if have[i] < rest[i]]
    for i in lower[:-1]:
        x = _hypergeometric(have[i], pool - have[i], take, uniform())
        out[i] = x
        pool -= have[i]
        take -= x
    if lower:
        out[lower[-1]] = take
    return position, out


def _uniforms_from(uniforms: np.ndarray, start: int) -> tuple[Callable[[], float], list[int]]:
    """``uniform()``: the next of ``uniforms[start:]``, checked as ``_kernels.c``'s
    ``next_uniform`` checks it; ``used[0]``: how many it gave."""
    used = [0]
    end = len(uniforms)

    def uniform() -> float:
        at = start + used[0]
        if at >= end:
            raise ValueError(f"uniforms: fewer than needed from start {start} ({end - start})")
        used[0] += 1
        u = float(uniforms[at])
        if not 0.0 <= u < 1.0:
            raise ValueError(f"uniforms[{at}] is not in [0, 1)")
        return u

    return uniform, used


def numpy_counts_emptying(
    counts: np.ndarray,
    remaining: np.ndarray,
    k: int,
    uniforms: np.ndarray,
    start: int,
    counts_out: np.ndarray | None,
) -> tuple[int, int, np.ndarray]:
    if not 1 <= k <= min(len(counts), len(remaining)):
        raise ValueError(f"k: {k} is not in 1..len(counts), len(remaining)")
    if not 0 <= start <= len(uniforms):
        raise ValueError(f"start: {start} is outside the uniforms")
    have, rest = counts[:k].tolist(), remaining[:k].tolist()
    for i, (c, r) in enumerate(zip(have, rest, strict=True)):
        if r < 1 or c < 0:
            raise ValueError(
                f"counts[{i}], remaining[{i}] = {c}, {r}: need counts >= 0 and remaining >= 1"
            )
    uniform, used = _uniforms_from(uniforms, start)
    at, out = _emptying_draw(have, rest, uniform)
    return at, (used[0] if at >= 0 else 0), np.asarray(out, dtype=np.int64)


def numpy_cut_rounds(
    uniforms: np.ndarray,
    start: int,
    need: int,
    pages: np.ndarray,
    k: int,
    parent_joins: Callable[[int], int | None],
    refill: Callable[[], object],
    taken_out: np.ndarray | None,
) -> tuple[np.ndarray, int, list[int], list[int]]:
    length = len(uniforms)
    if not 0 <= k <= len(pages):
        raise ValueError(f"k: {k} is outside the arrays")
    if need < 0 or not 0 <= start <= length:
        raise ValueError(f"start, need: {start}, {need}: need >= 0, start in the uniforms")
    if k * (need.bit_length() + 2) > length:
        raise ValueError(
            f"uniforms: {length} hold fewer than a round may need ({k * (need.bit_length() + 2)})"
        )
    left = [int(p) for p in pages[:k]]
    for i, p in enumerate(left):
        if p < 1:
            raise ValueError(f"pages[{i}] = {p}: every candidate must hold a page")
    labels, picked = list(range(k)), [0] * k
    totals = [0] * k
    joined: list[int] = []
    emptied: list[int] = []
    pos, left_need = start, need
    while left_need > 0 and labels:
        active = len(labels)
        if pos + active - 1 > length:
            refill()
            pos = 0
        counts = numpy_even_counts(uniforms, pos, left_need, active, None).tolist()
        pos += active - 1
        reach = sum(c >= r for c, r in zip(counts, left, strict=True))
        if not reach:  # nobody empties: every pick stands
            picked = [p + c for p, c in zip(picked, counts, strict=True)]
            break
        if pos + reach * left_need.bit_length() + active > length:
            refill()
            pos = 0
        uniform, used = _uniforms_from(uniforms, pos)
        at, upto = _emptying_draw(counts, left, uniform)
        assert at >= 0
        pos += used[0]
        left_need -= at + 1
        left = [r - x for r, x in zip(left, upto, strict=True)]
        picked = [p + x for p, x in zip(picked, upto, strict=True)]
        gone = max(i for i in range(active) if left[i] == 0)
        label = labels.pop(gone)
        left.pop(gone)
        taken = picked.pop(gone)
        if label < k:
            totals[label] = taken
        else:
            joined[label - k] = taken
        emptied.append(label)
        parent = parent_joins(label)
        if parent is not None and parent > 0:
            labels.append(k + len(joined))
            joined.append(0)
            left.append(parent)
            picked.append(0)
    for label, taken in zip(labels, picked, strict=True):
        if label < k:
            totals[label] = taken
        else:
            joined[label - k] = taken
    return np.asarray(totals, dtype=np.int64), pos, emptied, joined


def numpy_trim(
    size: np.ndarray,
    slots: np.ndarray,
    taken: np.ndarray,
    k: int,
    page: int,
    off: np.ndarray | None,
    starts_out: np.ndarray | None,
    lengths_out: np.ndarray | None,
) -> int:
    if len(slots) != k:
        slots = slots[:k]
    if len(taken) != k:
        taken = taken[:k]
    cut = taken * page if page > 1 else taken
    keep = size[slots] - cut
    size[slots] = keep
    if off is not None:
        assert starts_out is not None
        assert lengths_out is not None
        starts_out[:k] = off[slots] + keep
        lengths_out[:k] = cut
    return int(_sum(cut)) if k else 0


def numpy_trim_gather(
    size: np.ndarray,
    slots: np.ndarray,
    taken: np.ndarray,
    k: int,
    page: int,
    off: np.ndarray,
    source: np.ndarray,
    out: np.ndarray,
    at: int,
) -> int:
    cut = int(_sum(taken[:k])) * page if k else 0
    if cut > len(out) - at:  # before anything is written, as the compiled loop
        raise ValueError(f"out: {cut} tokens cut, room for {len(out) - at} after at")
    starts, lengths = np.empty(k, np.int64), np.empty(k, np.int64)
    numpy_trim(size, slots, taken, k, page, off, starts, lengths)
    if cut:
        out[at : at + cut] = source[run_positions(starts, lengths)]
    return cut


def numpy_gather(
    source: np.ndarray, starts: np.ndarray, lengths: np.ndarray, k: int, out: np.ndarray
) -> int:
    starts, lengths = starts[:k], lengths[:k]
    n = int(_sum(lengths)) if k else 0
    if n:
        out[:n] = source[run_positions(starts, lengths)]
    return n


# Every loop's numpy twin, by the loop's name: the fallback below, and what tests put in
# place of the compiled loops to run the numpy path.
NUMPY_LOOPS = {
    "first_round": numpy_first_round,
    "pick_counts": numpy_pick_counts,
    "steps": numpy_steps,
    "even_counts": numpy_even_counts,
    "bridge_params": numpy_bridge_params,
    "bridge_finish": numpy_bridge_finish,
    "gap_rings": numpy_gap_rings,
    "gap_first": numpy_gap_first,
    "first_emptying": numpy_first_emptying,
    "counts_emptying": numpy_counts_emptying,
    "cut_rounds": numpy_cut_rounds,
    "trim": numpy_trim,
    "trim_gather": numpy_trim_gather,
    "gather": numpy_gather,
}

try:
    from engine_ext.cache._kernels import (
        bridge_finish,
        bridge_params,
        counts_emptying,
        cut_rounds,
        even_counts,
        first_emptying,
        first_round,
        gap_first,
        gap_rings,
        gather,
        pick_counts,
        steps,
        trim,
        trim_gather,
    )

    COMPILED = True
except ImportError:  # no C compiler at install time: the same loops in numpy
    globals().update(NUMPY_LOOPS)
    COMPILED = False
