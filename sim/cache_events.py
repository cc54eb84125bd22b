"""The reference radix cache's KV events, recorded the way SGLang records its own.

``EventedRadixCache`` is the reference cache (``engine_ext.cache.RadixCache``) that also
reports every change of its contents to a ``CacheEventRecorder``: a new leaf is a
``BlockStored`` of its pages (chained to its parent's last page), a deleted leaf or a cut
tail (LRU's whole leaves, RLT's trimmed tails and emptied leaves) a ``BlockRemoved`` of
those pages, a flush ``AllBlocksCleared``. Splits change no content and send nothing, as in
SGLang. Page hashes are SGLang's (``routing.block_hash``), so a router hashing a request's
tokens finds them. Consecutive events coalesce as SGLang's ``KVCacheEventRecorder.enqueue``
does; ``take`` hands the queue to whoever publishes it (the emulated worker after each
scheduler step, the simulator straight to its router). Like SGLang's, a new cache starts
with an ``AllBlocksCleared``.

>>> cache = EventedRadixCache(64, "lru")
>>> _ = cache.insert("\\x01\\x02\\x03"); _ = cache.insert("\\x01\\x02\\x09")
>>> [type(e).__name__ for e in cache.events.take()]
['AllBlocksCleared', 'BlockStored', 'BlockStored']
>>> cache.evict(64), [type(e).__name__ for e in cache.events.take()]
(4, ['BlockRemoved'])
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine_ext.cache import RadixCache, RadixNode
from router_service.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from router_service.routing.block_hash import token_bytes

__all__ = ["CacheEventRecorder", "EventedRadixCache"]


def _block_hash(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


class CacheEventRecorder:
    """Page digests of every node, and the events not yet taken."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._digests: dict[RadixNode, list[bytes]] = {}
        self._queue: list[KVEvent] = []

    def stored(self, node: RadixNode) -> None:
        """``node`` is a new leaf: its pages are stored."""
        parent = node.parent
        before = self._digests.get(parent) if parent is not None else None
        prior = before[-1] if before else b""
        data = token_bytes(node.key)
        step, sha = 4 * self.page_size, hashlib.sha256
        digests = []
        for start in range(0, len(data) - step + 1, step):
            prior = sha(prior + data[start : start + step]).digest()
            digests.append(prior)
        self._digests[node] = digests
        if digests:
            ids = np.frombuffer(data, dtype="<u4").tolist()
            parent_hash = _block_hash(before[-1]) if before else None
            hashes = [_block_hash(d) for d in digests]
            self._enqueue(BlockStored(hashes, parent_hash, ids, self.page_size, None))

    def split(self, upper: RadixNode, child: RadixNode) -> None:
        """``upper`` took the first pages of ``child`` (no event: the content is the same)."""
        digests = self._digests.pop(child, [])
        pages = len(upper.key) // self.page_size
        self._digests[upper] = digests[:pages]
        self._digests[child] = digests[pages:]

    def removed(self, node: RadixNode) -> None:
        """``node`` and the pages it still holds are gone."""
        digests = self._digests.pop(node, [])
        if digests:
            self._enqueue(BlockRemoved([_block_hash(d) for d in digests]))

    def trimmed(self, node: RadixNode, tokens: int) -> None:
        """The last ``tokens`` (whole pages) of leaf ``node`` are gone."""
        pages = tokens // self.page_size
        digests = self._digests.get(node)
        if pages <= 0 or not digests:
            return
        cut = digests[-pages:]
        del digests[-pages:]
        self._enqueue(BlockRemoved([_block_hash(d) for d in cut]))

    def cleared(self) -> None:
        self._digests.clear()
        self._enqueue(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self._queue = self._queue, []
        return events

    def _enqueue(self, event: KVEvent) -> None:
        """Append, coalescing with the tail as SGLang does: removals with removals, a store
        with the store whose last page it continues."""
        if self._queue:
            tail = self._queue[-1]
            if isinstance(tail, BlockRemoved) and isinstance(event, BlockRemoved):
                tail.block_hashes.extend(event.block_hashes)
                return
            if (
                isinstance(tail, BlockStored)
                and isinstance(event, BlockStored)
                and tail.block_hashes
                and event.parent_block_hash == tail.block_hashes[-1]
            ):
                tail.block_hashes.extend(event.block_hashes)
                tail.token_ids.extend(event.token_ids)
                return
        self._queue.append(event)


class EventedRadixCache(RadixCache):
    """The reference cache, reporting its changes to ``events`` (a ``CacheEventRecorder``).

    Every mutation of the tree goes through the methods below (inserts, splits, whole-leaf
    deletions, tail cuts, flushes), so the recorder sees them all whatever the eviction
    policy; eviction itself is the base class's, unchanged.
    """

    def __init__(
        self,
        capacity_tokens: int,
        eviction: str = "lru",
        *,
        page_size: int = 1,
        rng: random.Random | None = None,
        **options: Any,
    ) -> None:
        self.events = CacheEventRecorder(page_size)
        super().__init__(capacity_tokens, eviction, page_size=page_size, rng=rng, **options)

    def reset(self) -> None:
        super().reset()
        self.events.cleared()

    def insert(self, key: Sequence[Any]) -> Any:
        result = super().insert(key)
        if result.prefix_length < len(self._aligned(key)):
            self.events.stored(result.node)
        return result

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        upper = super()._split(child, at)
        self.events.split(upper, child)
        return upper

    def delete_leaf(self, node: RadixNode) -> int:
        self.events.removed(node)
        return super().delete_leaf(node)

    def delete_emptied(self, nodes: Sequence[RadixNode]) -> int:
        for node in nodes:
            self.events.removed(node)
        return super().delete_emptied(nodes)

    def trim_leaf(self, node: RadixNode, num_tokens: int) -> int:
        if 0 < num_tokens < self.leaf_size(node):  # a whole leaf goes through delete_leaf
            self.events.trimmed(node, num_tokens)
        return super().trim_leaf(node, num_tokens)

    def cut_tails(self, slots: np.ndarray, pages: np.ndarray, k: int) -> int:
        nodes, page = self.leaves.nodes, self.page_size
        for slot, taken in zip(slots[:k].tolist(), pages[:k].tolist(), strict=True):
            node = nodes[slot]
            if taken and node is not None:
                self.events.trimmed(node, taken * page)
        return super().cut_tails(slots, pages, k)
