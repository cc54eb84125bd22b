"""RLT eviction (``rlt``): the reference loop's draw, compiled, applied to the tree in a batch.

``rlt_reference.RLTReference`` is the definition (marking phases; ``evict(n)`` picks a leaf
uniformly among the unmarked, unlocked ones and cuts one page from its tail, n times). It cuts
page by page, one Python call each: evicting 1k tokens from a tree of ~260 leaves cuts ~4
pages off nearly every leaf. This class keeps its marking and phase rules and makes the same
picks from the same uniforms in C (``kernels``: the candidates from the leaf registry's arrays,
then the picks), then applies what they took at once: every partly cut leaf in one compiled
loop over the registry's sizes (deferred trims, ``leaf_registry``), the emptied leaves in one
``delete_emptied``. The tree that results is the reference loop's (the tests check it).
Where the extension is not built it runs the reference loop itself.

Both trees run it: the reference cache and the SGLang plugin's view of SGLang's tree
(``engine_ext.sglang_rlt``), which offers the same few methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from engine_ext.cache import kernels
from engine_ext.cache.rlt_reference import RLTReference

if TYPE_CHECKING:
    from engine_ext.cache.node import RadixNode

__all__ = ["RLTEviction"]


class RLTEviction(RLTReference):
    """RLT with the draw compiled; ``rng`` seeds every draw, as the reference's."""

    name = "rlt"

    def evict(self, num_tokens: int) -> int:
        if not kernels.COMPILED:
            return super().evict(num_tokens)
        tree, page = self.cache, self.cache.page_size
        need = -(-num_tokens // page)
        k = self.candidates(need, self._gather)
        slots, pages, taken = self.registry.scratch
        node_of, parent_joins, joined = self._labels(slots, k)
        emptied, joined_taken = kernels.steps(self.uniforms(need), pages, k, parent_joins, taken)
        if not emptied:  # the common case: every candidate lost fewer pages than it held
            return tree.cut_tails(slots, taken, k)
        # Cut the candidates that kept pages first (deleting leaves may renumber the slots),
        # then delete the emptied leaves (children before parents), then cut the parents that
        # joined and kept pages.
        taken[[label for label in emptied if label < k]] = 0
        freed = tree.cut_tails(slots, taken, k)
        freed += tree.delete_emptied([node_of(label) for label in emptied])
        gone = set(emptied)
        for label, (node, cut) in enumerate(zip(joined, joined_taken, strict=True), start=k):
            if cut and label not in gone:
                freed += tree.trim_leaf(node, cut * page)
        return freed

    def _gather(self) -> tuple[int, int]:
        """The candidates into the registry's scratch arrays: (how many, their pages)."""
        registry = self.registry
        slots, pages, _ = registry.scratch
        end, page = registry.end, self.cache.page_size
        return kernels.candidates(registry.mark, registry.size, end, self.phase, page, slots, pages)

    def _labels(
        self, slots: np.ndarray, k: int
    ) -> tuple[Callable[[int], RadixNode], Callable[[int], int | None], list[RadixNode]]:
        """The draw's labels as nodes: ``node_of(label)`` (a candidate's from its slot, then
        the parents in the order they joined), and ``steps``' callback ``parent_joins``: when
        a leaf empties, does its parent become a candidate (``may_join``, once its last child
        has emptied)? Its pages if so, and it goes to the list returned third."""
        nodes, page = self.registry.nodes, self.cache.page_size
        joined: list[RadixNode] = []
        children_left: dict[RadixNode, int] = {}

        def node_of(label: int) -> RadixNode:
            node = joined[label - k] if label >= k else nodes[slots[label]]
            assert node is not None  # a candidate's slot holds a leaf
            return node

        def parent_joins(label: int) -> int | None:
            parent = node_of(label).parent
            if parent is None or not self.may_join(parent):
                return None
            left = children_left.get(parent, len(parent.children)) - 1
            children_left[parent] = left
            if left:
                return None
            joined.append(parent)
            return len(parent.key) // page

        return node_of, parent_joins, joined
