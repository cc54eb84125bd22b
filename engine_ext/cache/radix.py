"""Reference radix cache: a token-id radix tree with locking, capacity and pluggable eviction.

Pure Python, no SGLang import. The simulator and the emulated worker use it as the worker's
KV cache; the SGLang plugin is proven equal to it. The shape follows SGLang's
``mem_cache/radix_cache.py``: ``match_prefix`` / ``insert`` / ``lock`` / ``unlock`` /
``evict``, sizes split into evictable (unlocked) and protected (locked) tokens, page-aligned
keys. On top of the tree the cache keeps the KV-pool arithmetic a worker needs
(``reserve`` / ``release`` / ``ensure_free`` for tokens that running requests hold outside
the tree), so ``total + reserved <= capacity`` holds whenever callers reserve before they insert.

>>> import random
>>> cache = RadixCache(capacity_tokens=8, eviction="lru", rng=random.Random(0))
>>> cache.insert((1, 2, 3, 4)).prefix_length
0
>>> cache.match_prefix((1, 2, 3, 9)).length
3
>>> cache.evict(4), cache.total_tokens
(4, 0)
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_ext.cache import kernels
from engine_ext.cache.eviction import EvictionPolicy, make_eviction_policy
from engine_ext.cache.keys import common_prefix_length
from engine_ext.cache.leaf_registry import LOCKED, LeafRegistry
from engine_ext.cache.node import RadixNode

__all__ = ["MARKINGS", "CacheStats", "CapacityError", "InsertResult", "MatchResult", "RadixCache"]

# What a match marks for a marking policy (RLT): the whole matched path (``"path"``, ours), or
# only the node the match splits off, if any (``"split"``, the paper's ``radix_cache_lrt.py``:
# its match marks nothing else, its insert marks the path as ours does).
MARKINGS = ("path", "split")


class CapacityError(RuntimeError):
    """Raised when tokens are reserved beyond what the cache can free."""


@dataclass(frozen=True, slots=True)
class MatchResult:
    """``length`` tokens of the key are cached; ``node`` is the last node of that prefix."""

    length: int
    node: RadixNode


@dataclass(frozen=True, slots=True)
class InsertResult:
    """``prefix_length`` tokens were already cached; ``node`` ends the inserted key."""

    prefix_length: int
    node: RadixNode


@dataclass(slots=True)
class CacheStats:
    """Counters in the units SGLang exports (``sglang:prompt_tokens_total`` and friends)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    evicted_tokens: int = 0
    evictions: int = 0

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Account one admitted request (what SGLang counts when the request is scheduled)."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class RadixCache:
    """Token radix tree of at most ``capacity_tokens`` tokens (tree plus reserved).

    ``eviction`` names a registered policy (``lru`` or ``rlt`` built in); ``rng`` is the seeded
    source of randomness for randomized policies. ``page_size`` > 1 aligns every key, match
    and eviction to whole pages, as SGLang does. ``marking`` (``MARKINGS``) is what a match
    marks for a marking policy; others ignore it.
    """

    def __init__(
        self,
        capacity_tokens: int,
        eviction: str = "lru",
        *,
        page_size: int = 1,
        rng: random.Random | None = None,
        marking: str = "path",
    ) -> None:
        if marking not in MARKINGS:
            raise ValueError(f"unknown marking {marking!r}; known: {', '.join(MARKINGS)}")
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.capacity_tokens = capacity_tokens
        self.page_size = page_size
        self.marking = marking
        self.rng = rng if rng is not None else random.Random(0)
        self.stats = CacheStats()
        self.leaves = LeafRegistry()  # in the order nodes became leaves: deterministic
        self.policy: EvictionPolicy = make_eviction_policy(eviction, self, self.rng)
        self.reset()

    # -- state ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every cached token (SGLang's ``/flush_cache``); counters are kept."""
        self._next_id = 0
        self.root = self._new_node((), None)
        self.root.lock_ref = 1  # the root is never evicted
        self.leaves.clear()
        self._tick = 0
        self.total_tokens = 0
        self.protected_tokens = 0
        self.reserved_tokens = 0
        self.policy.reset()

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.protected_tokens

    @property
    def available_tokens(self) -> int:
        """Tokens that can be reserved without evicting."""
        return self.capacity_tokens - self.total_tokens - self.reserved_tokens

    @property
    def node_count(self) -> int:
        return sum(1 for _ in self._iter_nodes()) - 1

    def _new_node(self, key: Any, parent: RadixNode | None) -> RadixNode:
        node = RadixNode(key, parent, self._next_id)
        self._next_id += 1
        return node

    def next_tick(self) -> int:
        """A logical clock for recency: deterministic, unlike wall time."""
        self._tick += 1
        return self._tick

    # -- lookup and insert ---------------------------------------------------------------
    def _aligned(self, key: Sequence[Any]) -> Sequence[Any]:
        page = self.page_size
        return key if page == 1 else key[: len(key) // page * page]

    def _child_key(self, key: Sequence[Any], pos: int) -> Any:
        return key[pos] if self.page_size == 1 else key[pos : pos + self.page_size]

    def _walk(
        self, key: Sequence[Any], split: bool
    ) -> tuple[int, RadixNode, list[RadixNode], bool]:
        """Follow ``key`` down the tree; return matched length, last node, the path, and
        whether the walk split its last node off a longer one."""
        node, pos, path = self.root, 0, []
        page, n = self.page_size, len(key)
        sizes = self.leaves.size
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            if child.slot >= 0 and sizes[child.slot] != len(child.key):
                self.settle(child)
            child_len = len(child.key)
            common = common_prefix_length(child.key, key[pos : pos + child_len])
            if page > 1:
                common -= common % page
            if common < child_len:
                if split and common > 0:
                    child = self._split(child, common)
                    path.append(child)
                    return pos + common, child, path, True
                if common > 0:
                    pos += common
                break
            path.append(child)
            node, pos = child, pos + child_len
        return pos, node, path, False

    def match_prefix(self, key: Sequence[Any]) -> MatchResult:
        """Longest cached prefix of ``key``; touches the path (LRU recency, RLT marks)."""
        length, node, path, split = self._walk(self._aligned(key), split=True)
        if path:
            self.policy.on_match(path, split)
        return MatchResult(length, node)

    def peek_prefix(self, key: Sequence[Any]) -> int:
        """Length of the cached prefix of ``key`` without touching or splitting anything."""
        return self._walk(self._aligned(key), split=False)[0]

    def insert(self, key: Sequence[Any]) -> InsertResult:
        """Insert ``key`` (page-aligned) and touch its path.

        The caller must have reserved room for the new tokens (``ensure_free`` + ``reserve``)
        and releases the reservation afterwards, as SGLang's scheduler allocates KV slots before
        it inserts them. Insert itself never evicts, so it can never drop what it is adding.
        """
        key = self._aligned(key)
        prefix, node, path, _ = self._walk(key, split=True)
        if prefix < len(key):
            leaf = self._new_node(key[prefix:], node)
            node.children[self._child_key(key, prefix)] = leaf
            if node.slot >= 0:  # settled by the walk
                self.leaves.remove(node)
            self.leaves.add(leaf)
            self.total_tokens += len(leaf.key)
            path.append(leaf)
            node = leaf
        if path:
            self.policy.on_access(path)
        return InsertResult(prefix, node)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Split ``child`` after ``at`` tokens; the new upper node inherits its state."""
        parent = child.parent
        assert parent is not None  # only the root has no parent, and the root is never split
        upper = self._new_node(child.key[:at], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.mark_phase = child.mark_phase
        parent.children[self._child_key(child.key, 0)] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        if child.slot >= 0:  # a leaf (settled by the walk) keeps its slot, not its size
            self.leaves.size[child.slot] = len(child.key)
        return upper

    # -- locking -------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (a running request uses them)."""
        if node.slot >= 0:  # only the first node can be a leaf
            self.settle(node)
            self.leaves.mark[node.slot] = LOCKED
        while node is not self.root:
            if node.lock_ref == 0:
                self.protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        first = node
        if first.slot >= 0:
            self.settle(first)
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node: {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_tokens -= len(node.key)
            node = node.parent  # type: ignore[assignment]
        if first.slot >= 0 and first.lock_ref == 0:
            self.leaves.mark[first.slot] = first.mark_phase

    # -- KV-pool arithmetic --------------------------------------------------------------
    def ensure_free(self, num_tokens: int) -> bool:
        """Evict until ``num_tokens`` can be reserved; False, evicting nothing, if locks and
        reservations make that impossible (SGLang checks free + evictable KV before it
        evicts for a request: ``PrefillAdder`` in ``managers/schedule_policy.py``)."""
        short = num_tokens - self.available_tokens
        if short > self.evictable_tokens:
            return False
        if short > 0:
            self.evict(short)
        return self.available_tokens >= num_tokens

    def reserve(self, num_tokens: int) -> None:
        """Hold ``num_tokens`` KV slots for a running request (outside the tree)."""
        if num_tokens > self.available_tokens:
            raise CapacityError(
                f"cannot reserve {num_tokens} tokens: {self.available_tokens} available; "
                "call ensure_free() first"
            )
        self.reserved_tokens += num_tokens

    def release(self, num_tokens: int) -> None:
        if num_tokens > self.reserved_tokens:
            raise CapacityError(f"release of {num_tokens} tokens > {self.reserved_tokens} reserved")
        self.reserved_tokens -= num_tokens

    # -- eviction ------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked tokens if possible; returns tokens freed."""
        if num_tokens <= 0:
            return 0
        freed = self.policy.evict(num_tokens)
        if freed:
            self.stats.evicted_tokens += freed
            self.stats.evictions += 1
        return freed

    def evictable_leaves(self) -> Iterator[RadixNode]:
        """Unlocked leaves, in a deterministic order (the order they became leaves)."""
        return (leaf for leaf in self.leaves if leaf.lock_ref == 0)

    def is_leaf(self, node: RadixNode) -> bool:
        return node.slot >= 0

    def leaf_size(self, node: RadixNode) -> int:
        """Tokens of a leaf, cuts included (its ``key`` may not be settled yet)."""
        return int(self.leaves.size[node.slot])

    def settle(self, node: RadixNode) -> None:
        """Apply a leaf's deferred trims to its ``key`` (see ``leaf_registry``)."""
        if node.slot >= 0:
            size = int(self.leaves.size[node.slot])
            if size != len(node.key):
                node.key = node.key[:size]

    def delete_leaf(self, node: RadixNode) -> int:
        """Remove an unlocked leaf and return its tokens; its parent becomes a leaf if it has
        no other child."""
        if node.lock_ref > 0 or node.children or node is self.root or node.slot < 0:
            raise RuntimeError(f"only unlocked leaves can be deleted: {node!r}")
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key, 0)]  # a cut never reaches the first page
        tokens = self.leaf_size(node)
        self.leaves.remove(node)
        self.total_tokens -= tokens
        if not parent.children and parent is not self.root:
            self.leaves.add(parent)
        return tokens

    def delete_emptied(self, nodes: Sequence[RadixNode]) -> int:
        """Delete ``nodes``, each unlocked and childless once those before it are gone
        (children before parents, RLT's emptied leaves); returns the tokens freed.

        Like ``delete_leaf`` in a loop, but a parent that is itself deleted later in
        ``nodes`` never joins the leaf registry in between.
        """
        registry, root, gone = self.leaves, self.root, set(nodes)
        leaves: list[RadixNode] = []  # in the registry: their sizes are read there, at once
        freed = 0
        for node in nodes:
            parent = node.parent
            if node.lock_ref or node.children or parent is None:
                raise RuntimeError(f"only unlocked leaves can be deleted: {node!r}")
            del parent.children[self._child_key(node.key, 0)]
            if node.slot >= 0:
                leaves.append(node)
            else:  # an inner node when the draw began: its key was never trimmed
                freed += len(node.key)
            if not parent.children and parent is not root and parent not in gone:
                registry.add(parent)
        freed += registry.remove_many(leaves)
        registry.compact()
        self.total_tokens -= freed
        return freed

    def trim_leaf(self, node: RadixNode, num_tokens: int) -> int:
        """Drop ``num_tokens`` (whole pages) from the tail of an unlocked leaf, all of it if it
        holds no more; returns the tokens dropped."""
        if node.slot < 0 or node.lock_ref > 0 or num_tokens % self.page_size:
            raise RuntimeError(f"cannot trim {num_tokens} tokens from {node!r}")
        if num_tokens >= self.leaf_size(node):
            return self.delete_leaf(node)
        if num_tokens > 0:
            self.leaves.size[node.slot] -= num_tokens
            self.total_tokens -= num_tokens
        return num_tokens

    def cut_tails(self, slots: np.ndarray, pages: np.ndarray, k: int) -> int:
        """Cut ``pages[i]`` pages (fewer than the leaf holds; 0 is allowed) off the tail of
        the unlocked leaf in ``slots[i]``, ``i < k``, deferred: one loop over the batch
        (``kernels.trim``). Returns the tokens cut."""
        size, page = self.leaves.size, self.page_size
        cut = kernels.trim(size, slots, pages, k, page, None, None, None)
        self.total_tokens -= cut
        return cut

    def _iter_nodes(self) -> Iterator[RadixNode]:
        """Every node, root first; leaves are settled on the way."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.slot >= 0:
                self.settle(node)
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Recount everything from the tree; raise AssertionError on any mismatch (tests)."""
        total = protected = 0
        leaves = set()
        for node in self._iter_nodes():
            if node is self.root:
                continue
            total += len(node.key)
            if node.lock_ref > 0:
                protected += len(node.key)
            if len(node.key) == 0 or len(node.key) % self.page_size:
                raise AssertionError(f"bad node length {len(node.key)}")
            parent = node.parent
            if parent is not None and parent is not self.root and parent.lock_ref < node.lock_ref:
                raise AssertionError("a locked node's parent must be locked at least as often")
            if not node.children:
                leaves.add(node)
        if total != self.total_tokens or protected != self.protected_tokens:
            raise AssertionError(
                f"sizes drifted: total {total} vs {self.total_tokens}, "
                f"protected {protected} vs {self.protected_tokens}"
            )
        registry = self.leaves
        if leaves != set(registry) or len(registry) != len(leaves):
            raise AssertionError("leaf index drifted from the tree")
        for slot, held in enumerate(registry.nodes):
            if held is None:
                if registry.mark[slot] != LOCKED:
                    raise AssertionError(f"empty leaf slot {slot} is a candidate")
                continue
            if held.slot != slot or int(registry.size[slot]) != len(held.key):
                raise AssertionError(
                    f"leaf slot {slot} drifted: size {int(registry.size[slot])} for {held!r}"
                )
            expected = LOCKED if held.lock_ref else held.mark_phase
            if int(registry.mark[slot]) != expected:
                raise AssertionError(f"leaf slot {slot}: lock or mark drifted for {held!r}")
