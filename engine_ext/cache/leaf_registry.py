"""The cache's leaves as parallel arrays, so an eviction can read and trim them all at once.

Both policies start an eviction from the set of unlocked leaves, and RLT (docs/design.md) spreads
a small eviction over nearly all of them: evicting 1k tokens from a 100k-token tree of
~260 leaves takes ~4 tokens off each. Doing that node by node (a Python loop that slices
every leaf's key) costs far more than leaf-LRU, which drops ~4 whole leaves. The registry
keeps, per leaf, its size in tokens and one number that says both whether it is locked and
its RLT mark phase (``mark``: the phase for an unlocked leaf, ``LOCKED`` for a locked leaf or
a hole, so RLT's candidates are the slots with ``mark < phase``), in numpy arrays indexed by
a slot; a batch of trims is then one vectorised subtraction.

Deferred trims: ``size`` is always the leaf's true size, but a trimmed leaf keeps its old,
longer ``key`` until something reads it (``RadixCache.settle`` slices it to ``size``: the
tree walk, locking, invariant checks); a trimmed leaf is often trimmed again or deleted
before it is read, so many slices never happen.

Slots are handed out in the order nodes become leaves and compacted (order kept) when half
are holes, so iterating slots gives the leaves in the order they became leaves: the
deterministic candidate order the policies (and the SGLang plugin, which orders its own
leaves the same way) rely on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine_ext.cache.node import RadixNode

__all__ = ["LOCKED", "LeafRegistry"]

_INITIAL_SLOTS = 64
LOCKED = 2**62  # ``mark`` of a locked leaf or a hole: above every phase
_FEW_TO_VECTORISE = 16


class LeafRegistry:
    """Leaves in slots ``0 .. end-1`` (holes are ``None``), with their state in arrays."""

    # The per-slot arrays and the value of a hole: ``size`` in tokens (<= len(key)) and
    # ``mark``; a subclass may add its own (the SGLang plugin's arena offsets).
    ARRAYS: tuple[tuple[str, int], ...] = (("size", 0), ("mark", LOCKED))

    size: np.ndarray
    mark: np.ndarray
    # Working arrays of an eviction, as long as the slots (RLT's candidates, their pages and
    # the pages taken from each: ``kernels.candidates`` and ``kernels.steps`` fill them):
    # allocated with the slots, so that an eviction allocates nothing.
    scratch: tuple[np.ndarray, np.ndarray, np.ndarray]

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget every leaf (the cache was flushed; the old nodes are dropped with it)."""
        self.nodes: list[RadixNode | None] = []
        for name, fill in self.ARRAYS:
            setattr(self, name, np.full(_INITIAL_SLOTS, fill, dtype=np.int64))
        self.scratch = _scratch(_INITIAL_SLOTS)
        self.live = 0

    def __len__(self) -> int:
        return self.live

    @property
    def end(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[RadixNode]:
        """The leaves, in the order they became leaves."""
        return (node for node in self.nodes if node is not None)

    def add(self, node: RadixNode) -> None:
        """``node`` became a leaf; its key is settled."""
        slot = len(self.nodes)
        if slot == len(self.size):
            self._grow()
        self.nodes.append(node)
        self.size[slot] = len(node.key)
        self.mark[slot] = LOCKED if node.lock_ref else node.mark_phase
        node.slot = slot
        self.live += 1

    def remove(self, node: RadixNode, *, compact: bool = True) -> None:
        """``node`` is no longer a leaf (deleted, or it got a child: settle it first).
        ``compact=False`` leaves the holes for a batch to close once (``compact``)."""
        slot = node.slot
        self.nodes[slot] = None
        self.mark[slot] = LOCKED  # a hole is never a candidate; its size is stale
        node.slot = -1
        self.live -= 1
        if compact:
            self.compact()

    def remove_many(self, nodes: list[RadixNode]) -> int:
        """``remove(node, compact=False)`` for each of ``nodes`` (leaves, distinct), with
        one vectorised read and write for all of them; returns their total size."""
        slots = [node.slot for node in nodes]
        holes = self.nodes
        for node, slot in zip(nodes, slots, strict=True):
            holes[slot] = None
            node.slot = -1
        self.live -= len(slots)
        if len(slots) < _FEW_TO_VECTORISE:  # a numpy call costs more than a few items
            size, mark = self.size, self.mark
            total = 0
            for slot in slots:
                total += int(size[slot])
                mark[slot] = LOCKED
            return total
        index = np.asarray(slots, dtype=np.int64)
        self.mark[index] = LOCKED
        return int(self.size[index].sum())

    def compact(self) -> None:
        """Close the holes if they are more than half of the slots."""
        end = len(self.nodes)
        if end > _INITIAL_SLOTS and self.live * 2 < end:
            self._compact()

    def _grow(self) -> None:
        n = len(self.size) * 2
        for name, fill in self.ARRAYS:
            old = getattr(self, name)
            new = np.full(n, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        self.scratch = _scratch(n)

    def _compact(self) -> None:
        """Close the holes, keeping the order; every live node gets its new slot."""
        end = len(self.nodes)
        keep = np.flatnonzero(np.fromiter((n is not None for n in self.nodes), bool, end))
        self.nodes = [self.nodes[i] for i in keep.tolist()]
        for slot, node in enumerate(self.nodes):
            node.slot = slot  # type: ignore[union-attr]
        live = len(keep)
        for name, fill in self.ARRAYS:
            arr = getattr(self, name)
            arr[:live] = arr[keep]
            arr[live:end] = fill


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
