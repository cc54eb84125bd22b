"""Helpers on prefix keys: sliceable sequences of match units.

A key is anything that slices and compares like a sequence: a ``tuple`` of token ids, a
``list`` of them, or a ``str`` (the router matches on characters when no token ids are given).
Matching compares whole slices, which runs at C speed, instead of looping over single units
in Python, so a 10k-token prompt costs a few slice comparisons per tree node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import numpy as np

__all__ = ["MAX_TOKEN_ID", "Key", "as_key", "common_prefix_length", "ids_to_key", "key_to_ids"]

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


# Token ids as the characters of a ``str``: compact (4 bytes a token instead of a 36-byte int
# object), hashable, and sliced and compared at C speed. Code points in the UTF-16 surrogate
# block are skipped so that every key encodes.
_SURROGATE_START, _SURROGATE_SIZE = 0xD800, 0x800
MAX_TOKEN_ID = 0x10FFFF - _SURROGATE_SIZE


def ids_to_key(ids: Iterable[int]) -> str:
    """Token ids -> key string, one character per token.

    >>> key_to_ids(ids_to_key([1, 55296, 128255]))
    [1, 55296, 128255]
    """
    arr = np.fromiter(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
    arr = np.where(arr >= _SURROGATE_START, arr + _SURROGATE_SIZE, arr).astype("<u4")
    return arr.tobytes().decode("utf-32-le")


def key_to_ids(key: str) -> list[int]:
    """Key string -> token ids (inverse of ``ids_to_key``)."""
    arr = np.frombuffer(key.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    ids: list[int] = np.where(arr >= _SURROGATE_START, arr - _SURROGATE_SIZE, arr).tolist()
    return ids
