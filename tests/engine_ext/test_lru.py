"""SGLang's leaf-LRU: whole leaves go in last-access order; parents join when they empty."""

from __future__ import annotations

import pytest

from engine_ext.cache import RadixCache


def cached(cache: RadixCache, *keys: tuple[int, ...]) -> list[bool]:
    return [cache.peek_prefix(key) == len(key) for key in keys]


@pytest.mark.parametrize("page_size", [1, 4])
def test_leaves_go_in_last_access_order_one_leaf_at_a_time(page_size: int) -> None:
    cache = RadixCache(1_000, "lru", page_size=page_size)
    a, b, c, d = ((i,) * 8 for i in (1, 2, 3, 4))
    for key in (a, b, c, d):
        cache.insert(key)
    # Touch in a known order; insertion order (a, b, c, d) must not matter.
    for key in (c, a, d, b):
        assert cache.match_prefix(key).length == 8
    order = []
    for _ in range(4):
        assert cache.evict(1) == 8  # one token asked, the whole leaf goes
        gone = [
            key for key, ok in zip((a, b, c, d), cached(cache, a, b, c, d), strict=True) if not ok
        ]
        order.append(next(key for key in gone if key not in order))
        assert len(gone) == len(order)
    assert order == [c, a, d, b]
    assert cache.total_tokens == 0


def test_peek_does_not_refresh_recency_but_match_and_insert_do() -> None:
    cache = RadixCache(1_000, "lru")
    old, new = (1, 1, 1), (2, 2, 2)
    cache.insert(old)
    cache.insert(new)
    cache.peek_prefix(old)  # no touch
    cache.evict(1)
    assert cached(cache, old, new) == [False, True]
    cache.insert(old)
    cache.insert(new)  # re-inserting touches `new`
    cache.match_prefix(old)  # ... and matching touches `old` last
    cache.evict(1)
    assert cached(cache, old, new) == [True, False]


def test_a_parent_that_becomes_a_leaf_competes_by_its_own_last_access() -> None:
    cache = RadixCache(1_000, "lru")
    cache.insert((5, 5, 6))  # parent (5, 5) with leaves (6,) and (7,)
    cache.insert((5, 5, 7))
    cache.insert((8, 8, 8))
    cache.match_prefix((5, 5))  # the parent is now the most recent of all
    cache.match_prefix((8, 8, 8))  # ... until (8, 8, 8) is touched
    # Leaves by last access: (5,5,6) and (5,5,7) oldest, then (8,8,8).
    assert cache.evict(2) == 2  # both children of (5, 5)
    assert cache.peek_prefix((5, 5, 6)) == 2
    assert cache.peek_prefix((5, 5, 7)) == 2
    # Now (5, 5) is a leaf last touched before (8, 8, 8): it goes next.
    assert cache.evict(1) == 2
    assert cache.peek_prefix((5, 5)) == 0
    assert cache.peek_prefix((8, 8, 8)) == 3


def test_locked_leaves_are_skipped_and_evict_frees_what_it_can() -> None:
    cache = RadixCache(1_000, "lru")
    oldest = cache.insert((1, 1, 1, 1)).node
    cache.insert((2, 2))
    cache.insert((3, 3, 3))
    cache.lock(oldest)
    assert cache.evict(2) == 2  # (2, 2) is the oldest unlocked leaf
    assert cached(cache, (1, 1, 1, 1), (2, 2), (3, 3, 3)) == [True, False, True]
    assert cache.evict(100) == 3  # everything unlocked, no more
    assert cache.total_tokens == 4
    cache.unlock(oldest)
    assert cache.evict(100) == 4


def test_one_call_may_free_more_than_asked_because_leaves_go_whole() -> None:
    cache = RadixCache(1_000, "lru")
    cache.insert(tuple(range(10)))
    cache.insert((100, 101))
    assert cache.evict(3) == 10  # the older, 10-token leaf
    assert cache.peek_prefix((100, 101)) == 2
    assert cache.stats.evicted_tokens == 10
    assert cache.stats.evictions == 1
