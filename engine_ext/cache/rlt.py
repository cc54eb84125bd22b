"""RLT: the paper's randomized leaf-token eviction with marking phases (docs/design.md, *RLT
eviction*).

A phase marks every node that an insert goes through, and with the cache's ``marking``
``"path"`` (the default) every node a match goes through; with ``"split"`` a match marks only
the node it splits off (nothing when it splits nothing), as the paper's code does
(``radix_cache_lrt.py``). Marked nodes are not evicted.
When the marked tokens reach the capacity C a new phase starts: all marks are cleared and the
current path is marked again. ``evict(n)`` starts a new phase if ``n + marked >= C``, gathers
the unmarked, unlocked leaves (starting a new phase and gathering again if there are none, or
too few tokens), then drops n pages, each from the tail of a leaf chosen uniformly at random;
a leaf that empties is deleted and its parent joins the candidates if it is now an unmarked,
unlocked leaf. The page-at-a-time loop is drawn in one batch with the same distribution
(``leaf_sampling``). Clearing all marks is O(1): a node is marked when its ``mark_phase``
equals the current phase number.

The candidates, the draw and the trims run over the cache's leaf registry
(``leaf_registry``) in compiled loops (``kernels``; numpy where the extension is not built):
in the common case, where no leaf empties, an eviction is two of them (``first_round``,
``trim``); where a leaf empties among a few thousand pages, a third (``steps``, the
definition page by page) calls back once per emptying; otherwise a few numpy calls plus
one Python step per leaf that empties. Both
trees keep a registry: the reference cache, and the SGLang plugin's view of SGLang's
tree (``engine_ext.sglang_rlt``), which offers the same few methods (``cut_tails``,
``cut_few_tails``, ``delete_emptied``, ``trim_leaf``).

Reference: Wu, Silwal, Zhang, ICLR 2026 (arXiv 2601.18999); the paper's code
``radix_cache_lrt.py`` / ``cy_evict.pyx`` (github.com/fzwark/KVRouting).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_ext.cache import kernels, leaf_sampling
from engine_ext.cache.leaf_sampling import (
    FEW_LEAVES,
    Draws,
    draw_first_counts,
    draw_first_round,
    draw_leaf_counts,
)

if TYPE_CHECKING:
    from engine_ext.cache.node import RadixNode
    from engine_ext.cache.radix import RadixCache

__all__ = ["RLTEviction"]

# a ufunc reduction without numpy's Python-level wrapper (see ``leaf_sampling``)
_any = np.logical_or.reduce


class RLTEviction:
    """Marking phases plus uniform leaf-token eviction; ``rng`` seeds every draw."""

    name = "rlt"

    def __init__(self, cache: RadixCache, rng: random.Random) -> None:
        self.cache = cache
        # One numpy generator for the batched draws, seeded from the injected RNG.
        self.gen = Draws(rng.getrandbits(64))
        self.phase = 0
        self.marked_tokens = 0
        self.phases_started = 0
        self.registry = cache.leaves  # the unlocked leaves are candidates (docs/design.md)
        self.marks_match_path = cache.marking == "path"

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
        phase = self.phase
        registry = self.registry
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

    def evict(self, num_tokens: int) -> int:
        """The definition's ``evict(n)`` on the cache's leaf registry: the candidates, the
        draw and the trims."""
        cache, registry = self.cache, self.registry
        page = cache.page_size
        need = -(-num_tokens // page)
        short = self._start_phase_if_due(need * page)
        smallest: int | None = None
        if registry.live <= FEW_LEAVES:  # Python lists; the same draws (draw_first_round)
            cand, cand_pages = self._few_candidates(need * page, short)
            if not cand:
                return 0
            method, drawn, whole_draw = draw_first_round(cand_pages, need, self.gen)
            if whole_draw is not None:  # no leaf emptied: trims only
                return cache.cut_few_tails(cand, whole_draw, need * page)
            # A leaf empties (or many will): the general path goes on from the same draws.
            slots = np.asarray(cand, dtype=np.int64)
            pages = np.asarray(cand_pages, dtype=np.int64)
        else:
            status, k, smallest, used, slots, pages = self._first_round(need, short)
            if not k:
                return 0
            if status == kernels.WHOLE:  # the common case: every candidate loses a few pages
                self.gen.consume(used)
                cache.cut_tails(slots, registry.scratch[2], k)
                return need * page
            if len(slots) != k:  # the compiled loop's arrays: the first k are the candidates
                slots, pages = slots[:k], pages[:k]
            if status == kernels.STEPS:  # a leaf empties: page by page from the same picks
                method, drawn = "steps", None
            elif status == kernels.ROUNDS:  # a leaf empties: compiled rounds, the same first
                method, drawn = "rounds", None
            else:
                method, drawn, whole = draw_first_counts(pages, need, self.gen, smallest)
                if whole is not None:  # no leaf emptied after all
                    cache.cut_tails(slots, whole, k)
                    return need * page
        nodes = registry.nodes
        # Node of each label: a candidate's from its slot, then the parents in the order
        # they joined (labels k and up); only the labels that empty are looked up.
        joined_nodes: list[RadixNode] = []
        joined_pages: list[int] = []
        tracker, k = self._parent_joins_tracker(), len(slots)

        def node_of(label: int) -> RadixNode:
            node = nodes[slots[label]] if label < k else joined_nodes[label - k]
            assert node is not None  # a candidate's slot holds a leaf
            return node

        def parent_joins(label: int) -> int | None:
            joined = tracker(node_of(label))
            if joined is None or joined[1] <= 0:
                return None
            joined_nodes.append(joined[0])
            joined_pages.append(joined[1])
            return joined[1]

        counts, emptied = draw_leaf_counts(
            pages, need, self.gen, parent_joins, method=method, first=drawn, smallest=smallest
        )
        if not emptied:  # every candidate loses a few pages, none empties (parents the
            # walk saw join after the target have labels past k, and no pages)
            cache.cut_tails(slots, counts, k)
            return need * page
        # Partial trims of the first candidates first, in one step (deleting leaves may
        # renumber the slots); then the emptied leaves, children before parents; then the
        # few parents that joined and lost only part of their pages.
        first = counts[:k]
        partial = (first > 0) & (first < pages)
        if _any(partial):
            cut = slots[partial]
            freed = cache.cut_tails(cut, first[partial], len(cut))
        else:
            freed = 0
        freed += cache.delete_emptied([node_of(label) for label in emptied])
        taken_by_joined = counts[k:].tolist()
        for node, taken, size in zip(joined_nodes, taken_by_joined, joined_pages, strict=True):
            if 0 < taken < size:
                freed += cache.trim_leaf(node, taken * page)
        return freed

    def _start_phase_if_due(self, need_tokens: int) -> bool:
        """The definition's first rule; True if gathering now would come up short anyway (the
        candidates hold at most the unmarked tokens), so the caller starts a phase at once."""
        cache = self.cache
        if need_tokens + self.marked_tokens >= cache.capacity_tokens:
            self.new_phase()
            return False
        return cache.total_tokens - self.marked_tokens < need_tokens

    def _first_round(self, need: int, short: bool) -> tuple[int, int, int, int, Any, Any]:
        """``kernels.first_round`` on the registry, after starting a new phase if the
        candidates hold fewer than ``need`` pages (or ``short``: the caller knows they
        do): (status, k, smallest, used, slots, pages). The candidates are the first k
        of ``slots`` (registry slots of the unmarked, unlocked leaves) and ``pages``
        (their sizes in pages); ``smallest`` is the smallest of those (0 if k is 0). On
        ``WHOLE`` the first k of the registry's ``scratch[2]`` are the whole draw (pages
        taken per candidate: the first round's picks emptied no leaf), which took ``used``
        of the generator's buffered uniforms. The compiled loop writes into the registry's
        scratch arrays (the numpy one makes its own): views of those, valid until the next
        eviction."""
        registry, gen = self.registry, self.gen
        if short:
            self.new_phase()
        uniforms, start = gen.ahead()
        rules = (
            leaf_sampling._MULTINOMIAL_PICKS_PER_LEAF,
            leaf_sampling._BINOMIAL_PICKS_PER_LEAF,
            leaf_sampling._MAX_ROUNDS,
            leaf_sampling._STEP_PAGES,
        )
        args = (self.cache.page_size, need, uniforms, start, *rules, *registry.scratch)
        mark, size, end = registry.mark, registry.size, len(registry.nodes)
        found = kernels.first_round(mark, size, end, self.phase, *args)
        if found[0] == kernels.SHORT and not short:
            self.new_phase()
            found = kernels.first_round(mark, size, end, self.phase, *args)
        return found

    def _few_candidates(self, need_tokens: int, short: bool) -> tuple[list[int], list[int]]:
        """``_first_round``'s candidates with Python lists, for a registry of a few leaves
        (read from its arrays, as there: the nodes themselves are not touched)."""
        registry = self.registry
        end = registry.end
        marks, sizes = registry.mark[:end].tolist(), registry.size[:end].tolist()
        if not short:
            phase = self.phase
            cand = [i for i, mark in enumerate(marks) if mark < phase]
            short = sum(sizes[i] for i in cand) < need_tokens
        if short:
            self.new_phase()
            phase = self.phase  # no leaf is marked now: every unlocked one is a candidate
            cand = [i for i, mark in enumerate(marks) if mark < phase]
        page = self.cache.page_size
        return cand, [sizes[i] // page for i in cand]

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
