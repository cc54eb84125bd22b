"""Helpers on prefix keys: sliceable sequences of match units.

A key is anything that slices and compares like a sequence: a ``tuple`` of token ids, a
``list`` of them, or a ``str`` (the router matches on characters when no token ids are given).
Matching compares whole slices, which runs at C speed, instead of looping over single units
in Python, so a 10k-token prompt costs a few slice comparisons per tree node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

__all__ = ["Key", "as_key", "common_prefix_length"]

Key: TypeAlias = "tuple[int, ...] | str"


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    One slice comparison when the shorter is a prefix of the longer (the common case on a
    radix-tree path), else a binary search over slice comparisons: O(n) copying at C speed
    plus O(log n) comparisons.

    >>> common_prefix_length((1, 2, 3, 4), (1, 2, 9))
    2
    >>> common_prefix_length("system prompt", "system prompt, then question")
    13
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def as_key(units: Sequence[int] | str) -> Key:
    """Normalise token ids to a tuple (hashable, cheap to slice); strings pass through."""
    if isinstance(units, str | tuple):
        return units
    return tuple(units)
