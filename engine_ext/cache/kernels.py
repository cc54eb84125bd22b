"""RLT's per-eviction loops over the leaf registry: compiled when built, else numpy.

An eviction of a few thousand tokens is little work (a few hundred leaves, a few thousand
picks) spread over many small numpy calls, and a numpy call costs microseconds when the
caches are cold, as they are in a scheduler between batches: most of the eviction's time
(see docs/sglang_plugin.md, "Eviction cost"). ``_kernels`` (``_kernels.c``, built by
``pip install`` when a C compiler is at hand) runs each of these loops as one C call.
Without it, the numpy functions below do the same; ``COMPILED`` says which are in use, and
the tests check that both give the same results. Every function writes into arrays the
caller owns (int64 unless said), so neither allocates on the hot path.

- ``candidates(mark, size, end, phase, page, slots_out, pages_out) -> (k, smallest,
  total)``: the slots ``i < end`` with ``mark[i] < phase``, in order, into
  ``slots_out[:k]``, their sizes in pages (``size // page``) into ``pages_out[:k]``, and the
  smallest and the sum of those (both 0 if there are none).
- ``first_round(mark, size, end, phase, page, need, uniforms, start, picks_per_leaf,
  max_rounds, slots_out, pages_out, counts_out) -> (status, k, smallest)``: an eviction's
  common case at once. ``candidates`` into ``slots_out`` and ``pages_out``; then, where
  ``leaf_sampling`` would draw the first round as picks from ``Draws``' buffer (fewer than
  ``picks_per_leaf`` picks per leaf, not the continuous-time draw, ``need`` uniforms left
  from ``start``), their counts into ``counts_out[:k]``. ``WHOLE``: no leaf emptied, the
  counts are the whole draw (the caller consumes the uniforms); ``DRAW``: the caller
  draws, from these candidates (no uniform was consumed); ``SHORT``: they hold fewer than
  ``need`` pages. The numpy twin never says ``WHOLE``: the caller's own draw then runs,
  the same draw (``tests/engine_ext/test_kernels.py``).
- ``pick_counts(uniforms, start, n, leaves, counts_out) -> top``: ``counts_out[:leaves]``
  counts the picks ``floor(u * leaves)`` of the float64 ``uniforms[start:start + n]``;
  returns the largest count.
- ``trim(size, slots, taken, k, page, off, starts_out, lengths_out) -> tokens``: for
  ``i < k``, ``size[slots[i]] -= taken[i] * page`` (checked first: a cut of at most the
  leaf's size, in whole pages); with ``off`` (else ``None`` for it and both outputs), also
  the runs of arena positions cut, ``starts_out[i] = off[slots[i]] + new size`` and
  ``lengths_out[i] = taken[i] * page``.
- ``gather(source, starts, lengths, k, out) -> items``: the runs
  ``source[starts[i]:starts[i] + lengths[i]]``, ``i < k``, one after another into the start
  of ``out`` (integers of one item size, 4 or 8 bytes).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "COMPILED",
    "DRAW",
    "SHORT",
    "WHOLE",
    "candidates",
    "first_round",
    "gather",
    "pick_counts",
    "trim",
]

WHOLE, DRAW, SHORT = 0, 1, 2  # what ``first_round`` says


def numpy_candidates(
    mark: np.ndarray,
    size: np.ndarray,
    end: int,
    phase: int,
    page: int,
    slots_out: np.ndarray,
    pages_out: np.ndarray,
) -> tuple[int, int, int]:
    slots = (mark[:end] < phase).nonzero()[0]
    k = len(slots)
    if not k:
        return 0, 0, 0
    pages = size[slots] // page if page > 1 else size[slots]
    slots_out[:k] = slots
    pages_out[:k] = pages
    return k, int(np.minimum.reduce(pages)), int(np.add.reduce(pages))


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
    max_rounds: int,
    slots_out: np.ndarray,
    pages_out: np.ndarray,
    counts_out: np.ndarray,
) -> tuple[int, int, int]:
    k, smallest, total = numpy_candidates(mark, size, end, phase, page, slots_out, pages_out)
    return (SHORT if total < need else DRAW), k, smallest


def numpy_pick_counts(
    uniforms: np.ndarray, start: int, n: int, leaves: int, counts_out: np.ndarray
) -> int:
    if leaves < 1 or leaves > len(counts_out):
        raise ValueError(f"leaves: {leaves} is not in 1..len(counts_out)")
    if start < 0 or n < 0 or start + n > len(uniforms):
        raise ValueError(f"start, n: {start}, {n} are outside the uniforms")
    picks = (uniforms[start : start + n] * leaves).astype(np.intp)
    counts_out[:leaves] = np.bincount(picks, minlength=leaves)
    return int(np.maximum.reduce(counts_out[:leaves]))


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
    slots, cut = slots[:k], taken[:k] * page
    keep = size[slots] - cut
    if k and (int(np.minimum.reduce(keep)) < 0 or int(np.minimum.reduce(cut)) < 0):
        raise ValueError("taken: a cut is negative or more than its leaf holds")
    size[slots] = keep
    if off is not None:
        assert starts_out is not None
        assert lengths_out is not None
        starts_out[:k] = off[slots] + keep
        lengths_out[:k] = cut
    return int(np.add.reduce(cut))


def numpy_gather(
    source: np.ndarray, starts: np.ndarray, lengths: np.ndarray, k: int, out: np.ndarray
) -> int:
    starts, lengths = starts[:k], lengths[:k]
    n = int(np.add.reduce(lengths)) if k else 0
    if n:
        ends = np.add.accumulate(lengths)
        positions = np.repeat(starts - (ends - lengths), lengths)
        positions += np.arange(n, dtype=np.int64)
        out[:n] = source[positions]
    return n


try:
    from engine_ext.cache._kernels import (
        candidates,
        first_round,
        gather,
        pick_counts,
        trim,
    )

    COMPILED = True
except ImportError:  # no C compiler at install time: the same loops in numpy
    candidates, first_round, pick_counts, trim, gather = (
        numpy_candidates,
        numpy_first_round,
        numpy_pick_counts,
        numpy_trim,
        numpy_gather,
    )
    COMPILED = False
