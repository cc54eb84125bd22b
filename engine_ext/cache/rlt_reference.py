"""RLT as the paper defines it: marking phases, and eviction one page at a time from the tail
of a leaf chosen uniformly at random (Wu, Silwal, Zhang, ICLR 2026, arXiv 2601.18999; the
paper's code is ``radix_cache_lrt.py`` and ``cy_evict.pyx`` in github.com/fzwark/KVRouting).

Marking. A phase marks every node that an insert goes through, and with the cache's
``marking`` ``"path"`` (the default) every node a match goes through; with ``"split"`` a match
marks only the node it splits off (nothing when it splits nothing), as the paper's code does.
Marked nodes are not evicted. When the marked tokens reach the capacity C a new phase starts:
all marks are cleared and the current path is marked again. Clearing is O(1): a node is marked
when its ``mark_phase`` equals the current phase number.

Eviction, ``evict(n)``: start a new phase if ``n + marked >= C``; gather the unmarked, unlocked
leaves (starting a new phase and gathering again if they hold fewer than n tokens); then, n
times, pick a leaf uniformly among them and cut one page from its tail. A leaf that empties is
deleted and leaves the candidates, and its parent joins them (at the end) if it is now an
unmarked, unlocked leaf. The candidates come in the order they became leaves (the cache's
leaf registry), and the k-th pick is ``floor(u_k * candidates)`` of the k-th of n uniforms
drawn at once, so a seeded run is reproducible.

This module is that loop, written out; it is the oracle of the tests and what ``rlt`` runs
where the C extension is not built. ``rlt.RLTEviction`` draws the same picks in C and applies
them in a batch, with the same result (``tests/engine_ext/test_rlt.py``).

The policy runs on any tree that offers what it reads and calls: the reference cache
(``radix.RadixCache``) and the SGLang plugin's view of SGLang's tree (``engine_ext.sglang_rlt``)
both do (``capacity_tokens``, ``page_size``, ``marking``, ``root``, ``leaves``, ``trim_leaf``,
``cut_tails``, ``delete_emptied``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    from engine_ext.cache.node import RadixNode
    from engine_ext.cache.radix import RadixCache

__all__ = ["RLTReference"]

Found = TypeVar("Found")


class RLTReference:
    """Marking phases plus uniform leaf-page eviction; ``rng`` seeds every draw."""

    name = "rlt_reference"

    def __init__(self, cache: RadixCache, rng: random.Random) -> None:
        self.cache = cache
        self.registry = cache.leaves
        self.gen = np.random.Generator(np.random.PCG64(rng.getrandbits(64)))
        self.phase = 0
        self.marked_tokens = 0
        self.phases_started = 0
        self.marks_match_path = cache.marking == "path"

    # -- marking ------------------------------------------------------------------------
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

    def on_match(self, path: list[RadixNode], split: bool) -> None:
        if self.marks_match_path:
            self.on_access(path)
        elif split:  # the paper's rule: the split-off node, and its path if a phase starts
            self._mark(path[-1:])
            if self.marked_tokens >= self.cache.capacity_tokens:
                self.new_phase()
                self._mark(path)

    def _mark(self, path: list[RadixNode]) -> None:
        phase, registry = self.phase, self.registry
        for node in path:
            if node.mark_phase != phase:
                node.mark_phase = phase
                self.marked_tokens += len(node.key)  # the walk settled the path's leaf
                if node.slot >= 0 and not node.lock_ref:
                    registry.mark[node.slot] = phase

    def new_phase(self) -> None:
        """Unmark every node at once by moving to the next phase number."""
        self.phase += 1
        self.marked_tokens = 0
        self.phases_started += 1

    # -- eviction -----------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """The definition, page by page; returns the tokens freed."""
        tree, page = self.cache, self.cache.page_size
        need = -(-num_tokens // page)
        leaves = self.candidates(need, self._unmarked_leaves)
        left = [int(self.registry.size[leaf.slot]) // page for leaf in leaves]
        freed = 0
        for u in self.uniforms(need).tolist():
            if not leaves:
                break
            i = int(u * len(leaves))
            leaf = leaves[i]
            parent = leaf.parent
            freed += tree.trim_leaf(leaf, page)  # the last page deletes the leaf
            left[i] -= 1
            if left[i] == 0:
                del leaves[i], left[i]
                if parent is not None and self.may_join(parent) and not parent.children:
                    leaves.append(parent)
                    left.append(len(parent.key) // page)
        return freed

    def candidates(self, need: int, gather: Callable[[], tuple[Found, int]]) -> Found:
        """The phase rules of ``evict``: a new phase if ``need`` pages and the marked tokens
        reach C; then ``gather()`` (the candidates and the pages they hold), and if those
        are fewer than ``need``, a new phase and ``gather()`` again."""
        if need * self.cache.page_size + self.marked_tokens >= self.cache.capacity_tokens:
            self.new_phase()
        found, pages = gather()
        if pages < need:
            self.new_phase()
            found, pages = gather()
        return found

    def may_join(self, parent: RadixNode) -> bool:
        """Whether ``parent`` becomes a candidate once it is a leaf: unmarked, unlocked, not
        the root."""
        return parent is not self.cache.root and not parent.lock_ref and not self.is_marked(parent)

    def uniforms(self, need: int) -> np.ndarray:
        """The eviction's uniforms on [0, 1), one per pick: ``need``, or as many as the tree
        holds pages if fewer (picks past those would find no leaf)."""
        return self.gen.random(min(need, self.cache.total_tokens // self.cache.page_size))

    def _unmarked_leaves(self) -> tuple[list[RadixNode], int]:
        page, size = self.cache.page_size, self.registry.size
        leaves = [leaf for leaf in self.registry if not leaf.lock_ref and not self.is_marked(leaf)]
        return leaves, sum(int(size[leaf.slot]) // page for leaf in leaves)
