"""SGLang's leaf-LRU eviction: drop the least recently used unlocked leaf, whole, and repeat."""

from __future__ import annotations

import heapq
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_ext.cache.node import RadixNode
    from engine_ext.cache.radix import RadixCache

__all__ = ["LRUEviction"]


class LRUEviction:
    """Leaf LRU as in SGLang's ``RadixCache.evict``.

    Recency is a logical tick per access, so runs are reproducible. Whole leaves go, so one
    call may free more than asked (as in SGLang); a parent that becomes an unlocked leaf joins
    the candidates.
    """

    name = "lru"

    def __init__(self, cache: RadixCache, rng: random.Random) -> None:
        self.cache = cache

    def on_access(self, path: list[RadixNode]) -> None:
        tick = self.cache.next_tick()
        for node in path:
            node.last_access = tick

    def on_match(self, path: list[RadixNode], split: bool) -> None:
        self.on_access(path)  # a match is a use: the whole path is recent

    def evict(self, num_tokens: int) -> int:
        cache = self.cache
        heap = [(leaf.last_access, leaf.node_id, leaf) for leaf in cache.evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += len(leaf.key)
            cache.delete_leaf(leaf)
            if parent is not None and parent.lock_ref == 0 and cache.is_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def reset(self) -> None:
        pass
