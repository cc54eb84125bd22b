"""Shared pieces of the SGLang tier: a tracking KV allocator, cache builders, a request driver.

The allocator is the ``mock_allocator`` that SGLang's ``RadixCache.create_simulated`` takes
(``device``, ``free_segment``, ``free``) plus ``size`` (the RLT capacity) and ``alloc``; it
hands out page-aligned KV indices and fails a test on any index freed twice or never handed
out. ``KVROUTE_TEST_DEVICE`` (default ``cpu``) puts its index tensors, and so every value
in the tree, on another torch device: ``KVROUTE_TEST_DEVICE=cuda scripts/test_engine.sh``
runs the tier with the KV indices on a GPU, as a serving worker holds them. ``Worker``
replays requests the way SGLang's scheduler uses the tree (match, lock, evict the
shortfall, allocate, insert, unlock) against either SGLang's cache or the reference cache,
so both see identical operations.
"""

from __future__ import annotations

import os
import random
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from engine_ext.cache import RadixCache as ReferenceCache
from engine_ext.cache.leaf_registry import LOCKED
from engine_ext.sglang_rlt import RLTRadixCache

DEVICE = os.environ.get("KVROUTE_TEST_DEVICE", "cpu")


class TrackingAllocator:
    """A KV pool of ``size`` token slots in pages; every free is checked and recorded."""

    def __init__(self, size: int, page_size: int = 1, device: str = DEVICE) -> None:
        if size % page_size:
            raise ValueError("size must be whole pages")
        self.device = device
        self.size = size
        self.page_size = page_size
        self._free_pages = list(range(size // page_size))
        self.in_use: set[int] = set()
        self.freed_log: list[int] = []
        self.free_calls = 0

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor:
        page = self.page_size
        if num_tokens % page or num_tokens > self.available_size():
            raise AssertionError(f"cannot allocate {num_tokens} tokens")
        pages, self._free_pages = (
            self._free_pages[: num_tokens // page],
            self._free_pages[num_tokens // page :],
        )
        ids = [p * page + i for p in pages for i in range(page)]
        self.in_use.update(ids)
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def free_segment(self, values: torch.Tensor, start_pos: int = 0) -> None:
        assert start_pos % self.page_size == 0
        self.free(values)

    def free(self, values: torch.Tensor) -> None:
        self.free_calls += 1
        if values.device.type != torch.device(self.device).type:
            raise AssertionError(f"freed indices on {values.device}, the pool is on {self.device}")
        ids = values.tolist()
        page = self.page_size
        if len(ids) % page:
            raise AssertionError(f"freed {len(ids)} slots: not whole pages")
        for start in range(0, len(ids), page):
            first = ids[start]
            if first % page or ids[start : start + page] != list(range(first, first + page)):
                raise AssertionError(f"freed a partial or torn page at {first}")
        for i in ids:
            if i not in self.in_use:
                raise AssertionError(f"KV slot {i} freed twice or never allocated")
            self.in_use.remove(i)
        self._free_pages.extend(i // page for i in ids[::page])
        self.freed_log.extend(ids)


def cache_params(allocator: Any, page_size: int = 1, **kwargs: Any) -> CacheInitParams:
    """What ``RadixCache.create_simulated`` builds: no memory pools, a mock allocator."""
    return CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        **kwargs,
    )


def rlt_cache(
    capacity: int,
    page_size: int = 1,
    seed: int = 0,
    marking: str = "path",
    device: str = DEVICE,
    **kwargs: Any,
) -> tuple[RLTRadixCache, TrackingAllocator]:
    """kvroute's cache over a tracking pool on ``device`` (the tier's, unless a test needs
    one: a CPU arena's staging array exists only on a CPU)."""
    allocator = TrackingAllocator(capacity, page_size, device)
    params = cache_params(allocator, page_size, **kwargs)
    return RLTRadixCache(params, seed=seed, marking=marking), allocator


def lru_cache(
    capacity: int, page_size: int = 1, **kwargs: Any
) -> tuple[RadixCache, TrackingAllocator]:
    """SGLang's own cache (``eviction_policy="lru"``), built by ``create_simulated``."""
    allocator = TrackingAllocator(capacity, page_size)
    cache = RadixCache.create_simulated(mock_allocator=allocator, page_size=page_size, **kwargs)
    return cache, allocator


def radix_key(ids: Sequence[int], extra_key: str | None = None) -> RadixKey:
    return RadixKey(array("q", ids), extra_key)


# -- recounting SGLang's tree -----------------------------------------------------------------
def iter_nodes(cache: RadixCache) -> Iterator[Any]:
    stack = list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def is_registered(node: Any) -> bool:
    """An RLT leaf in the plugin's leaf registry (``engine_ext.sglang_rlt``)."""
    return "rlt_leaves" in node.__dict__ and node.__dict__.get("slot", -1) >= 0


def is_pending(node: Any) -> bool:
    """An RLT leaf that an eviction trimmed (its size in the registry) but whose attributes
    are not cut yet."""
    if not is_registered(node):
        return False
    state = node.__dict__
    return int(state["rlt_leaves"].size[state["slot"]]) != state["rlt_len"]


def key_and_value(node: Any, page: int) -> tuple[RadixKey, torch.Tensor]:
    """A node's key and value as SGLang will read them, without applying a pending trim
    (reading ``node.key`` would apply it: ``engine_ext.sglang_rlt``'s deferred trims)."""
    state = node.__dict__
    key, value = state["key"], state["value"]
    if not is_registered(node):
        if "rlt_len" in state:  # an RLT cache's inner node
            assert type(node).__name__ == "TreeNode", "an inner node with deferred attributes"
            assert state.get("slot", -1) == -1, "an inner node in the leaf registry"
        return key, value
    leaves, slot = state["rlt_leaves"], state["slot"]
    assert type(node).__name__ == "_RegisteredLeaf", "a registered leaf of a plain class"
    assert leaves.nodes[slot] is node, "the registry's slot holds another node"
    assert state["rlt_len"] == len(value) == len(key), "stored length is not the value's"
    keep = int(leaves.size[slot])
    assert leaves.page_size == page, "a registry of another page size"
    assert not node.children, "a registered leaf has children"
    assert 0 < keep <= len(key), f"registered size {keep} of {len(key)}"
    assert keep % page == 0, f"registered size {keep}: not whole pages"
    if keep < len(key):
        assert node.lock_ref == 0, "a pending trim on a locked node"
    for name in ("hash_value", "event_hash_value"):
        hashes = state[name]
        assert hashes is None or len(hashes) >= keep // page, f"{name} shorter than the key"
    return key[:keep], value[:keep]


def check_arena(cache: RLTRadixCache) -> None:
    """Every node's value is the view of the arena that its offset and length say, and
    every registered leaf's offset in the registry is its node's."""
    arena = cache._arena
    for node in iter_nodes(cache):
        state = node.__dict__
        value = state["value"]
        assert arena is not None
        assert value.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr(), (
            "a node's value is not a view of the arena"
        )
        assert value.storage_offset() == state["rlt_off"], "a node's arena offset drifted"
        assert len(value) == state["rlt_len"], "a node's stored length drifted"
        assert state["rlt_off"] + state["rlt_len"] <= cache._arena_top, "past the arena top"
        if is_registered(node):
            leaves = state["rlt_leaves"]
            assert int(leaves.off[state["slot"]]) == state["rlt_off"], "registry offset drifted"
            expected = LOCKED if node.lock_ref else node.mark_phase
            assert int(leaves.mark[state["slot"]]) == expected, "registry mark or lock drifted"
        elif not node.children:
            raise AssertionError("a leaf missing from the registry")


def check_tree(
    cache: RadixCache, allocator: TrackingAllocator | None = None, *, settle: bool = True
) -> None:
    """Recount sizes, leaves, values and (for RLT) marks from the tree; raise on a mismatch.

    ``settle=False`` reads pending RLT trims without applying them, so that the next
    operations meet them as SGLang's code would; the default also calls SGLang's
    ``total_size``, which reads (and so applies) every one."""
    total = protected = 0
    leaves: set[Any] = set()
    values: list[int] = []
    marked = 0
    page = cache.page_size
    for node in iter_nodes(cache):
        key, value = key_and_value(node, page)
        n = len(key)
        assert n > 0, "an empty node"
        assert n % page == 0, f"node of {n} tokens with page size {page}"
        assert int(value.shape[0]) == n, "key and value lengths differ"
        assert node.parent.children[key.child_key(page)] is node, "child key drifted"
        total += n
        if node.lock_ref > 0:
            protected += n
        elif not node.children:
            leaves.add(node)
        values.extend(value.tolist())
        if allocator is not None and value.device.type != torch.device(allocator.device).type:
            raise AssertionError(f"a node's value moved to {value.device}")
        if isinstance(cache, RLTRadixCache) and cache.is_marked(node):
            marked += n
    assert cache.evictable_size() == total - protected, "evictable size drifted"
    assert cache.protected_size() == protected, "protected size drifted"
    if settle:
        assert cache.total_size() == total
        assert not any(is_pending(node) for node in iter_nodes(cache))
    assert set(cache.evictable_leaves) == leaves, "evictable leaves drifted"
    assert len(values) == len(set(values)), "a KV slot is held by two nodes"
    if isinstance(cache, RLTRadixCache):
        assert cache.marked_tokens == marked, "marked-token count drifted"
        check_arena(cache)
    if allocator is not None:
        assert set(values) <= allocator.in_use, "the tree holds a freed KV slot"


# -- one worker replaying requests --------------------------------------------------------------
class Worker:
    """Serve requests one at a time against an SGLang cache and its allocator."""

    def __init__(
        self, cache: RadixCache, allocator: TrackingAllocator, extra_key: str | None = None
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.extra_key = extra_key
        self.hits: list[int] = []
        self.evicted: list[int] = []

    def serve(self, ids: Sequence[int]) -> int:
        """Match, lock, evict the shortfall, allocate, insert, unlock; return the hit.

        Lengths are in the tree's units: with EAGLE (``is_eagle``) a key of n tokens is
        n - 1 bigrams, and a page-aligned key of a bigrams spans a + 1 raw tokens.
        """
        cache, allocator = self.cache, self.allocator
        bigram = 1 if cache.is_eagle else 0
        aligned = (len(ids) - bigram) // cache.page_size * cache.page_size
        match = cache.match_prefix(MatchPrefixParams(key=radix_key(ids, self.extra_key)))
        hit, node = match.device_prefix_len, match.last_device_node
        lock = cache.inc_lock_ref(node)
        need = aligned - hit
        short = need - allocator.available_size()
        if short > 0:
            self.evicted.append(cache.evict(EvictParams(num_tokens=short)).num_tokens_evicted)
        if aligned > 0 and need <= allocator.available_size():
            value = torch.cat([cache.path_device_indices(node), allocator.alloc(need)])
            key = radix_key(ids[: aligned + bigram], self.extra_key)
            result = cache.insert(InsertParams(key=key, value=value))
            assert result.prefix_len == hit, "the locked prefix changed under the request"
        cache.dec_lock_ref(node, lock.to_dec_params())
        self.hits.append(hit)
        return hit


class ReferenceWorker:
    """The same request loop against the reference cache (``engine_ext.cache``)."""

    def __init__(self, cache: ReferenceCache) -> None:
        self.cache = cache
        self.hits: list[int] = []
        self.evicted: list[int] = []

    def serve(self, ids: Sequence[int]) -> int:
        cache = self.cache
        key = tuple(ids)
        aligned = len(key) // cache.page_size * cache.page_size
        match = cache.match_prefix(key)
        cache.lock(match.node)
        need = aligned - match.length
        short = need - cache.available_tokens
        if short > 0:
            self.evicted.append(cache.evict(short))
        if need <= cache.available_tokens:
            cache.reserve(need)
            assert cache.insert(key).prefix_length == match.length
            cache.release(need)
        cache.unlock(match.node)
        self.hits.append(match.length)
        return match.length


def shared_prefix_requests(
    seed: int, count: int, groups: int = 6, vocab: int = 50
) -> list[list[int]]:
    """GSP-like prompts: a few shared prefixes, each followed by a random question."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(8, 40))] for _ in range(groups)]
    return [
        rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        for _ in range(count)
    ]
