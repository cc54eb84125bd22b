"""RLT's per-eviction loops, compiled (``_kernels.c``, built by ``pip install`` where a C
compiler is at hand; ``setup.py``), and whether they are: ``COMPILED``.

Where they are not built, ``rlt.RLTEviction`` runs the reference loop (``rlt_reference``), and
only ``gather`` is needed, in numpy here. The loops (int64 arrays unless said; each writes into
arrays the caller owns):

- ``candidates(mark, size, end, phase, page, slots_out, pages_out) -> (k, pages)``: the slots
  ``i < end`` with ``mark[i] < phase`` (the unmarked, unlocked leaves), in order, into
  ``slots_out[:k]``, their whole pages (``size // page``) into ``pages_out[:k]``, and the sum
  of those.
- ``steps(uniforms, pages, k, parent_joins, taken_out) -> (emptied, joined_taken)``: the
  reference loop's draw over ``k`` candidates of ``pages[:k]`` pages (labels ``0 .. k - 1``),
  one pick per float64 uniform, ``floor(u * active)`` over the active leaves in order; a leaf
  that empties leaves the order (the rest keep theirs) and ``parent_joins(label)`` (int or
  None) may add its parent, with that many pages, at the end (labels ``k`` and up).
  ``taken_out[:k]``: pages taken per candidate; ``emptied``: labels in the order they
  emptied; ``joined_taken``: pages taken per joined parent.
- ``trim(size, slots, taken, k, page, off, starts_out, lengths_out) -> tokens``: for
  ``i < k``, ``size[slots[i]] -= taken[i] * page``, every cut checked (no negative cut, none
  past the leaf's size) before anything is written; with ``off`` (else ``None`` for it and
  both outputs), also the runs of arena positions cut, ``starts_out[i] = off[slots[i]] + new
  size`` and ``lengths_out[i] = taken[i] * page``.
- ``trim_gather(size, slots, taken, k, page, off, source, out, at) -> tokens``: ``trim``'s
  cuts with their runs copied at once, ``source[off[slots[i]] + new size:][:taken[i] * page]``
  one after another into ``out`` from position ``at`` (room for them all checked first): a
  CPU arena's freed KV indices, without the runs' arrays.
- ``gather(source, starts, lengths, k, out) -> items``: the runs ``source[starts[i]:starts[i]
  + lengths[i]]``, ``i < k``, one after another into the start of ``out`` (integers of one
  item size, 4 or 8 bytes).
"""

from __future__ import annotations

import numpy as np

__all__ = ["COMPILED", "candidates", "gather", "run_positions", "steps", "trim", "trim_gather"]


def run_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions ``starts[i] .. starts[i] + lengths[i] - 1`` of every run (at least one),
    in order: ``gather``'s positions, for numpy and torch indexing; ufunc methods called
    directly (numpy's Python-level wrappers cost microseconds cold)."""
    ends = np.add.accumulate(lengths)
    positions = np.repeat(starts - (ends - lengths), lengths)
    positions += np.arange(int(ends[-1]), dtype=np.int64)
    return positions


def _numpy_gather(
    source: np.ndarray, starts: np.ndarray, lengths: np.ndarray, k: int, out: np.ndarray
) -> int:
    starts, lengths = starts[:k], lengths[:k]
    n = int(lengths.sum()) if k else 0
    if n:
        out[:n] = source[run_positions(starts, lengths)]
    return n


try:
    from engine_ext.cache._kernels import candidates, gather, steps, trim, trim_gather
except ImportError:  # no C compiler at install time: RLT runs its reference loop
    COMPILED = False
    gather = _numpy_gather
else:
    COMPILED = True
