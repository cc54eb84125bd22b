"""Reference radix cache: property tests over both eviction policies and two page sizes."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_ext.cache import (
    CapacityError,
    RadixCache,
    RadixNode,
    RLTEviction,
    eviction_policy_names,
    make_eviction_policy,
    register_eviction_policy,
)
from engine_ext.cache import eviction as eviction_module

CONFIGS = [("lru", 1), ("lru", 4), ("rlt", 1), ("rlt", 4)]
CAPACITY = 40  # above the longest key, so one access path never fills a phase on its own

# Keys share a few prefixes, so trees get deep (nested parents) and matches split nodes.
PREFIXES = [(), (7, 7, 7, 7), (8,) * 8, (7, 7, 7, 7, 9, 9)]
keys = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 3), max_size=8)).map(
    lambda parts: parts[0] + tuple(parts[1])
)
locking = st.sampled_from([False, False, False, True])
OP_STRATEGIES = {
    "insert": st.tuples(st.just("insert"), keys, locking),
    "match": st.tuples(st.just("match"), keys, locking),
    "unlock": st.tuples(st.just("unlock"), st.integers(0, 20)),
    "evict_few": st.tuples(st.just("evict"), st.integers(0, 8)),
    "evict_any": st.tuples(st.just("evict"), st.integers(0, 60)),
    "shrink": st.tuples(st.just("shrink")),
}
# Weighted so that trees grow past capacity between evictions.
OP_KINDS = ["insert"] * 5 + ["match"] * 2 + ["unlock", "evict_few", "evict_any", "shrink"]
operations = st.lists(
    st.sampled_from(OP_KINDS).flatmap(OP_STRATEGIES.__getitem__), min_size=10, max_size=60
)


def all_nodes(cache: RadixCache) -> Iterator[tuple[RadixNode, tuple[int, ...]]]:
    """Every node but the root, with the full key from the root to its end."""
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = prefix + tuple(child.key)
            yield child, path
            stack.append((child, path))


@dataclass
class Model:
    """What the test remembers independently of the cache."""

    cache: RadixCache
    inserted: list[tuple[int, ...]] = field(default_factory=list)
    locks: list[tuple[RadixNode, tuple[int, ...], int]] = field(default_factory=list)
    evicted: int = 0

    def aligned(self, key: tuple[int, ...]) -> tuple[int, ...]:
        page = self.cache.page_size
        return key[: len(key) // page * page]


def check_state(m: Model) -> None:
    cache = m.cache
    cache.check_invariants()
    nodes = list(all_nodes(cache))
    unlocked = sum(len(node.key) for node, _ in nodes if node.lock_ref == 0)
    locked = sum(len(node.key) for node, _ in nodes if node.lock_ref > 0)
    assert cache.evictable_tokens == unlocked
    assert cache.protected_tokens == locked
    assert cache.evictable_tokens + cache.protected_tokens == cache.total_tokens
    assert cache.stats.evicted_tokens == m.evicted
    for _, path in nodes:
        assert any(k[: len(path)] == path for k in m.inserted), f"{path} was never inserted"
    for _, key, length in m.locks:
        assert cache.peek_prefix(key) >= length, "a locked prefix lost tokens"
    if isinstance(cache.policy, RLTEviction):
        rlt = cache.policy
        marked = sum(len(node.key) for node, _ in nodes if rlt.is_marked(node))
        assert rlt.marked_tokens == marked
        assert rlt.marked_tokens < cache.capacity_tokens


def rlt_expected_new_phases(cache: RadixCache, num_tokens: int) -> int:
    """RLT's definition: how many phases ``evict(num_tokens)`` must start."""
    rlt = cache.policy
    assert isinstance(rlt, RLTEviction)
    page = cache.page_size
    need = -(-num_tokens // page)
    leaves = list(cache.evictable_leaves())
    first = need * page + rlt.marked_tokens >= cache.capacity_tokens
    pages = [len(x.key) // page for x in leaves if first or not rlt.is_marked(x)]
    second = not pages or sum(pages) < need
    return int(first) + int(second)


def do_evict(m: Model, num_tokens: int) -> None:
    cache = m.cache
    total, evictable = cache.total_tokens, cache.evictable_tokens
    rlt = cache.policy if isinstance(cache.policy, RLTEviction) else None
    if rlt is not None and num_tokens > 0:
        phases = rlt.phases_started
        expected_phases = rlt_expected_new_phases(cache, num_tokens)
        marked = {node: len(node.key) for node, _ in all_nodes(cache) if rlt.is_marked(node)}
    freed = cache.evict(num_tokens)
    m.evicted += freed
    assert cache.total_tokens == total - freed
    assert freed <= evictable
    if num_tokens <= 0:
        assert freed == 0
        return
    assert freed >= min(num_tokens, evictable)
    if rlt is None:
        return
    page = cache.page_size
    assert freed == min(-(-num_tokens // page) * page, evictable), "RLT frees whole pages"
    assert rlt.phases_started - phases == expected_phases
    if expected_phases == 0:
        alive = {node: len(node.key) for node, _ in all_nodes(cache)}
        for node, size in marked.items():
            assert alive.get(node) == size, "a marked node was evicted while unmarked ones sufficed"


def apply(m: Model, op: tuple) -> None:  # type: ignore[type-arg]
    cache = m.cache
    kind = op[0]
    if kind == "insert":
        _, key, lock = op
        m.inserted.append(key)
        result = cache.insert(key)
        aligned = m.aligned(key)
        assert result.node is cache.root or len(result.node.key) > 0
        assert cache.peek_prefix(key) == len(aligned)
        assert cache.match_prefix(key).length == len(aligned)
        if lock:
            cache.lock(result.node)
            m.locks.append((result.node, key, len(aligned)))
    elif kind == "match":
        _, key, lock = op
        peeked = cache.peek_prefix(key)
        result = cache.match_prefix(key)
        assert result.length == peeked
        assert result.length % cache.page_size == 0
        expected = max(
            (n for _, path in all_nodes(cache) for n in [len(path)] if key[:n] == path),
            default=0,
        )
        assert result.length == expected
        if lock:
            cache.lock(result.node)
            m.locks.append((result.node, key, result.length))
    elif kind == "unlock":
        if m.locks:
            node, _, _ = m.locks.pop(op[1] % len(m.locks))
            cache.unlock(node)
    elif kind == "evict":
        do_evict(m, op[1])
    else:  # shrink to capacity
        over = cache.total_tokens - cache.capacity_tokens
        evictable = cache.evictable_tokens
        do_evict(m, over)
        if over > 0 and evictable >= over:
            assert cache.total_tokens <= cache.capacity_tokens


@pytest.mark.usefixtures("rlt_paths")
@pytest.mark.parametrize(("eviction", "page_size"), CONFIGS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, seed=st.integers(0, 2**16))
def test_random_operations_keep_every_invariant(
    eviction: str,
    page_size: int,
    ops: list[tuple],
    seed: int,  # type: ignore[type-arg]
) -> None:
    cache = RadixCache(CAPACITY, eviction, page_size=page_size, rng=random.Random(seed))
    m = Model(cache)
    for op in ops:
        apply(m, op)
        check_state(m)
    # Unlocking everything makes every token evictable again.
    while m.locks:
        cache.unlock(m.locks.pop()[0])
    assert cache.protected_tokens == 0
    do_evict(m, cache.total_tokens)
    assert cache.total_tokens == 0
    check_state(m)


@pytest.mark.parametrize(("eviction", "page_size"), CONFIGS)
def test_match_after_insert_returns_the_page_aligned_prefix(eviction: str, page_size: int) -> None:
    cache = RadixCache(100, eviction, page_size=page_size)
    key = tuple(range(10))
    assert cache.insert(key).prefix_length == 0
    aligned = 10 // page_size * page_size
    assert cache.match_prefix(key).length == aligned
    assert cache.total_tokens == aligned
    # A second key sharing 6 tokens: its cached prefix is the shared, page-aligned part.
    other = (*range(6), 99, 98, 97, 96)
    shared = 6 // page_size * page_size
    assert cache.insert(other).prefix_length == shared
    assert cache.match_prefix(other).length == 10 // page_size * page_size
    assert cache.peek_prefix((*range(6), 50)) == shared
    cache.check_invariants()


def test_string_keys_work_like_token_tuples() -> None:
    cache = RadixCache(100, "lru")
    cache.insert("hello world")
    assert cache.match_prefix("hello there").length == 6
    assert cache.node_count == 2  # the match split "hello world" after "hello "


@pytest.mark.usefixtures("rlt_paths")
@pytest.mark.parametrize("eviction", ["lru", "rlt"])
def test_locked_nodes_survive_an_eviction_of_everything(eviction: str) -> None:
    cache = RadixCache(50, eviction, rng=random.Random(3))
    cache.insert((1, 2, 3, 4, 5, 6))
    cache.insert((1, 2, 3, 7, 8))
    kept = cache.insert((9, 9, 9, 9))
    cache.lock(kept.node)
    locked_prefix = cache.match_prefix((1, 2, 3, 4, 5, 6, 0))
    cache.lock(cache.match_prefix((1, 2, 3)).node)
    assert locked_prefix.length == 6
    freed = cache.evict(1_000)
    assert freed == 3 + 2  # (4, 5, 6) and (7, 8): everything not locked
    assert cache.peek_prefix((9, 9, 9, 9)) == 4
    assert cache.peek_prefix((1, 2, 3, 4)) == 3
    assert cache.evictable_tokens == 0
    cache.check_invariants()


def test_kv_pool_arithmetic_reserve_release_and_ensure_free() -> None:
    cache = RadixCache(10, "lru")
    cache.insert((1, 2, 3, 4, 5, 6))
    assert cache.available_tokens == 4
    with pytest.raises(CapacityError, match="ensure_free"):
        cache.reserve(5)
    assert cache.ensure_free(7)  # evicts the 6-token leaf
    assert cache.total_tokens == 0
    cache.reserve(7)
    assert cache.available_tokens == 3
    with pytest.raises(CapacityError):
        cache.release(8)
    cache.release(7)
    assert cache.available_tokens == 10


def test_ensure_free_is_false_when_locks_hold_the_memory() -> None:
    cache = RadixCache(10, "lru")
    node = cache.insert(tuple(range(8))).node
    cache.lock(node)
    assert not cache.ensure_free(5)
    assert cache.total_tokens == 8
    cache.unlock(node)
    assert cache.ensure_free(5)


def test_ensure_free_evicts_nothing_when_it_cannot_make_the_room() -> None:
    cache = RadixCache(20, "lru")
    locked = cache.insert(tuple(range(8))).node
    cache.lock(locked)
    cache.insert(tuple(range(100, 106)))  # 6 evictable tokens; 6 free
    assert not cache.ensure_free(13)  # 6 free + 6 evictable < 13
    assert cache.total_tokens == 14
    assert cache.stats.evicted_tokens == 0
    assert cache.ensure_free(12)
    assert cache.total_tokens == 8


def test_unlock_of_an_unlocked_node_fails_loudly() -> None:
    cache = RadixCache(10, "lru")
    node = cache.insert((1, 2)).node
    with pytest.raises(RuntimeError, match="unlock"):
        cache.unlock(node)


def test_reset_drops_tokens_keeps_counters() -> None:
    cache = RadixCache(10, "lru")
    cache.insert((1, 2, 3))
    cache.stats.record(3, 1)
    cache.reset()
    assert cache.total_tokens == 0
    assert cache.match_prefix((1, 2, 3)).length == 0
    assert cache.stats.requests == 1
    assert cache.stats.hit_rate == pytest.approx(1 / 3)


@pytest.mark.parametrize(("capacity", "page_size"), [(0, 1), (10, 0)])
def test_constructor_rejects_bad_sizes(capacity: int, page_size: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        RadixCache(capacity, page_size=page_size)


def test_eviction_registry_refuses_blank_and_duplicate_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert {"lru", "rlt"} <= set(eviction_policy_names())
    monkeypatch.setattr(
        eviction_module.REGISTRY, "_factories", dict(eviction_module.REGISTRY._factories)
    )
    for blank in ("", "   "):
        with pytest.raises(ValueError, match="blank"):
            register_eviction_policy(blank, eviction_module.REGISTRY.get("lru"))
    with pytest.raises(ValueError, match="already registered"):
        register_eviction_policy("lru", eviction_module.REGISTRY.get("lru"))
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'; known: ") as info:
        make_eviction_policy("fifo", RadixCache(4), random.Random(0))
    assert "lru" in str(info.value)
    assert "rlt" in str(info.value)


@pytest.mark.parametrize("chains", [2, 20], ids=["few", "many"])  # leaves: below / above 16
def test_delete_emptied_removes_chains_children_first_and_frees_exactly_them(
    chains: int,
) -> None:
    """RLT's batch of emptied nodes: each chain's leaf, then its parent (which never joins
    the leaf registry in between); other leaves and their sizes are untouched."""
    cache = RadixCache(10_000, "rlt")
    doomed = []
    for c in range(chains):
        upper = cache.insert((c, 1, 1)).node
        lower = cache.insert((c, 1, 1, 2, 2, 2, 2)).node  # a child of ``upper``
        doomed += [lower, upper]
    kept = cache.insert((99, 5, 5, 5)).node
    cache.trim_leaf(doomed[0], 2)  # a deferred trim: the size in the registry is the truth
    before = cache.total_tokens
    assert cache.delete_emptied(doomed) == before - 4
    assert cache.total_tokens == 4
    assert len(cache.leaves) == 1
    assert list(cache.leaves) == [kept]
    assert all(node.slot == -1 for node in doomed)
    assert cache.peek_prefix((0, 1, 1)) == 0
    assert cache.peek_prefix((99, 5, 5, 5)) == 4
    cache.check_invariants()
