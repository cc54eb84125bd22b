"""Our SGLang cache and the reference cache run RLT identically on the same requests.

Both caches get the same capacity, page size and seed, and ``Worker`` / ``ReferenceWorker``
issue identical operations (match, lock, evict the shortfall, insert, unlock). The seeds
reach the shared sampler through the same path (``random.Random(seed)`` -> ``RLTEviction``),
and candidate leaves come in the same order, so every draw is the same: equal hits request
by request, equal tokens per eviction, equal phase counts, and equal trees at the end.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang_harness import (
    ReferenceWorker,
    Worker,
    check_tree,
    iter_nodes,
    radix_key,
    rlt_cache,
    shared_prefix_requests,
)

from engine_ext.cache import RadixCache as ReferenceCache
from engine_ext.cache import RLTEviction


def _paths(nodes: Any, key_of: Any) -> set[tuple[int, ...]]:
    """Every node as the full token path from the root: the tree's shape, implementation-free."""
    out = set()
    for node in nodes:
        path: list[int] = []
        while node.parent is not None:
            path[:0] = key_of(node)
            node = node.parent
        out.add(tuple(path))
    return out


def _reference_nodes(cache: ReferenceCache) -> list[Any]:
    stack, out = list(cache.root.children.values()), []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


@pytest.mark.parametrize(
    ("seed", "capacity", "page_size"),
    [(0, 300, 1), (1, 200, 1), (2, 500, 1), (3, 256, 4), (4, 400, 2), (5, 120, 1)],
)
def test_same_requests_same_hits_and_evictions(seed: int, capacity: int, page_size: int) -> None:
    requests = shared_prefix_requests(seed, count=400)
    ours, allocator = rlt_cache(capacity, page_size, seed=seed)
    reference = ReferenceCache(capacity, "rlt", page_size=page_size, rng=random.Random(seed))
    sglang_worker, reference_worker = Worker(ours, allocator), ReferenceWorker(reference)
    for ids in requests:
        sglang_worker.serve(ids)
        reference_worker.serve(ids)
    check_tree(ours, allocator)
    reference.check_invariants()

    assert sglang_worker.hits == reference_worker.hits
    assert sglang_worker.evicted == reference_worker.evicted
    assert len(sglang_worker.evicted) > 20, "the sequence must exercise eviction"
    assert 0 < sum(sglang_worker.hits) < sum(len(ids) for ids in requests)
    policy = reference.policy
    assert isinstance(policy, RLTEviction)
    assert ours.phases_started == policy.phases_started > 1
    assert ours.marked_tokens == policy.marked_tokens
    assert ours.total_size() == reference.total_tokens
    assert _paths(iter_nodes(ours), lambda n: n.key.token_ids) == _paths(
        _reference_nodes(reference), lambda n: n.key
    )


def test_different_seeds_draw_differently() -> None:
    """The equality above is not vacuous: the seed does change which tails go."""
    requests = shared_prefix_requests(7, count=300)
    hits = []
    for seed in (0, 1):
        cache, allocator = rlt_cache(200, seed=seed)
        worker = Worker(cache, allocator)
        for ids in requests:
            worker.serve(ids)
        hits.append(worker.hits)
    assert hits[0] != hits[1]


@pytest.mark.parametrize(("seed", "capacity", "page_size"), [(0, 300, 1), (3, 256, 4)])
def test_split_marking_is_the_same_in_both_caches(seed: int, capacity: int, page_size: int) -> None:
    """The paper's rule (a match marks only the node it splits off) in both trees: equal
    hits, evictions, phases and marks; and a match that splits nothing marks nothing, where
    the whole-path rule marks the path."""
    requests = shared_prefix_requests(seed, count=400)
    ours, allocator = rlt_cache(capacity, page_size, seed=seed, marking="split")
    reference = ReferenceCache(
        capacity, "rlt", page_size=page_size, rng=random.Random(seed), marking="split"
    )
    path_marking = ReferenceCache(capacity, "rlt", page_size=page_size, rng=random.Random(seed))
    policy, path_policy = reference.policy, path_marking.policy
    assert isinstance(policy, RLTEviction)
    assert isinstance(path_policy, RLTEviction)
    sglang_worker, reference_worker = Worker(ours, allocator), ReferenceWorker(reference)
    for ids in requests:
        sglang_worker.serve(ids)
        reference_worker.serve(ids)
        assert ours.marked_tokens == policy.marked_tokens
    check_tree(ours, allocator)
    assert sglang_worker.hits == reference_worker.hits
    assert sglang_worker.evicted == reference_worker.evicted
    assert ours.phases_started == policy.phases_started > 1

    # A new phase, then a match of the last request, which ends on a node boundary.
    ReferenceWorker(path_marking).serve(requests[-1])
    for rlt in (ours.rlt, policy, path_policy):
        rlt.new_phase()
    last = requests[-1][: len(requests[-1]) // page_size * page_size]
    hit = ours.match_prefix(MatchPrefixParams(key=radix_key(last))).device_prefix_len
    assert hit == reference.match_prefix(tuple(last)).length > 0
    assert path_marking.match_prefix(tuple(last)).length == hit
    assert ours.marked_tokens == policy.marked_tokens == 0
    assert path_policy.marked_tokens == hit
