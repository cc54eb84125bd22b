"""RLT: the paper's randomized leaf-token eviction with marking phases (DESIGN 3.3).

A phase marks every node that a match or insert goes through; marked nodes are not evicted.
When the marked tokens reach the capacity C a new phase starts: all marks are cleared and the
current path is marked again. ``evict(n)`` starts a new phase if ``n + marked >= C``, gathers
the unmarked, unlocked leaves (starting a new phase and gathering again if there are none, or
too few tokens), then drops n pages, each from the tail of a leaf chosen uniformly at random;
a leaf that empties is deleted and its parent joins the candidates if it is now an unmarked,
unlocked leaf. The page-at-a-time loop is drawn in one batch with the same distribution
(``leaf_sampling``). Clearing all marks is O(1): a node is marked when its ``mark_phase``
equals the current phase number.

Reference: Wu, Silwal, Zhang, ICLR 2026 (arXiv 2601.18999); the paper's code
``radix_cache_lrt.py`` / ``cy_evict.pyx`` (github.com/fzwark/KVRouting).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from engine_ext.cache.leaf_sampling import draw_leaf_evictions

if TYPE_CHECKING:
    from engine_ext.cache.node import RadixNode
    from engine_ext.cache.radix import RadixCache

__all__ = ["RLTEviction"]


class RLTEviction:
    """Marking phases plus uniform leaf-token eviction; ``rng`` seeds every draw."""

    name = "rlt"

    def __init__(self, cache: RadixCache, rng: random.Random) -> None:
        self.cache = cache
        # One numpy generator for the batched draws, seeded from the injected RNG.
        self.gen = np.random.default_rng(rng.getrandbits(64))
        self.phase = 0
        self.marked_tokens = 0
        self.phases_started = 0

    def reset(self) -> None:
        self.phase += 1
        self.marked_tokens = 0

    def is_marked(self, node: RadixNode) -> bool:
        return node.mark_phase == self.phase

    def on_access(self, path: list[RadixNode]) -> None:
        self._mark(path)
        if self.marked_tokens >= self.cache.capacity_tokens:
            self.new_phase()
            self._mark(path)

    def _mark(self, path: list[RadixNode]) -> None:
        phase = self.phase
        for node in path:
            if node.mark_phase != phase:
                node.mark_phase = phase
                self.marked_tokens += len(node.key)

    def new_phase(self) -> None:
        """Unmark every node at once by moving to the next phase number."""
        self.phase += 1
        self.marked_tokens = 0
        self.phases_started += 1

    def candidates(self) -> list[tuple[RadixNode, int]]:
        """Unmarked, unlocked leaves with their sizes in pages."""
        phase, page = self.phase, self.cache.page_size
        return [
            (leaf, tokens // page)
            for leaf, tokens in self.cache.evictable_leaf_sizes()
            if leaf.mark_phase != phase
        ]

    def evict(self, num_tokens: int) -> int:
        cache = self.cache
        page = cache.page_size
        need = -(-num_tokens // page)
        if need * page + self.marked_tokens >= cache.capacity_tokens:
            self.new_phase()
            cands = self.candidates()
        elif cache.total_tokens - self.marked_tokens < need * page:
            # The candidates hold at most the unmarked tokens, so gathering them would come up
            # short and start a new phase anyway: start it now and gather once.
            cands = []
        else:
            cands = self.candidates()
        if not cands or sum(pages for _, pages in cands) < need:
            self.new_phase()
            cands = self.candidates()
        plan = draw_leaf_evictions(cands, need, self.gen, self._parent_joins_tracker())
        return cache.drop_tails((node, pages * page) for node, pages in plan)

    def _parent_joins_tracker(self) -> Callable[[RadixNode], tuple[RadixNode, int] | None]:
        """When a leaf empties, does its parent become an unmarked, unlocked leaf?"""
        root, phase, page = self.cache.root, self.phase, self.cache.page_size
        children_left: dict[RadixNode, int] = {}

        def parent_joins(leaf: RadixNode) -> tuple[RadixNode, int] | None:
            parent = leaf.parent
            if parent is None or parent is root or parent.lock_ref > 0:
                return None
            if parent.mark_phase == phase:
                return None
            left = children_left.get(parent, len(parent.children)) - 1
            children_left[parent] = left
            return (parent, len(parent.key) // page) if left == 0 else None

        return parent_joins
