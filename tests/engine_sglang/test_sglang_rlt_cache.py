"""RLTRadixCache on SGLang's real tree: marks, tail eviction, locks, sizes, frees, KV events."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.events import BlockRemoved, BlockStored, KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import TreeNode
from sglang_harness import (
    DEVICE,
    TrackingAllocator,
    Worker,
    cache_params,
    check_tree,
    is_pending,
    iter_nodes,
    lru_cache,
    radix_key,
    rlt_cache,
    shared_prefix_requests,
)

from engine_ext import sglang_rlt
from engine_ext.cache import kernels
from engine_ext.sglang_rlt import RLTRadixCache


def insert(cache: Any, allocator: TrackingAllocator, ids: list[int]) -> Any:
    """Insert ``ids`` with KV slots allocated for the uncached part only (no eviction)."""
    prefix = match(cache, ids)
    cached = cache.path_device_indices(prefix.last_device_node)
    value = torch.cat([cached, allocator.alloc(len(ids) - prefix.device_prefix_len)])
    return cache.insert(InsertParams(key=radix_key(ids), value=value)).last_device_node


def match(cache: Any, ids: list[int]) -> Any:
    return cache.match_prefix(MatchPrefixParams(key=radix_key(ids)))


def evict(cache: Any, tokens: int) -> int:
    return int(cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted)


# -- marking phases ---------------------------------------------------------------------------
def test_match_and_insert_mark_their_path_once_per_phase() -> None:
    cache, allocator = rlt_cache(10)
    insert(cache, allocator, [1, 2, 3, 4])
    insert(cache, allocator, [5, 6, 7, 8])
    match(cache, [1, 2, 3, 4])  # already marked: counted once
    assert cache.marked_tokens == 8
    assert cache.phases_started == 0
    insert(cache, allocator, [9, 9])  # 8 + 2 == C: a new phase re-marks only this path
    assert cache.phases_started == 1
    assert cache.marked_tokens == 2
    marks = {node.key.token_ids[0]: cache.is_marked(node) for node in iter_nodes(cache)}
    assert marks == {1: False, 5: False, 9: True}
    check_tree(cache, allocator)


def test_a_split_keeps_the_mark_on_both_halves() -> None:
    cache, allocator = rlt_cache(100)
    insert(cache, allocator, list(range(8)))
    cache.rlt.new_phase()
    result = match(cache, [0, 1, 2, 3, 99])  # splits the node after 4 tokens
    upper = result.last_device_node
    (lower,) = upper.children.values()
    assert result.device_prefix_len == 4
    assert cache.is_marked(upper)
    assert not cache.is_marked(lower)
    assert cache.marked_tokens == 4
    check_tree(cache, allocator)


# -- eviction -----------------------------------------------------------------------------------
def test_evict_trims_unmarked_tails_and_frees_them_in_one_call() -> None:
    cache, allocator = rlt_cache(100)
    a = insert(cache, allocator, list(range(10)))
    b = insert(cache, allocator, list(range(100, 110)))
    before = {id(a): a.value.tolist(), id(b): b.value.tolist()}
    calls = allocator.free_calls
    assert evict(cache, 5) == 5  # both leaves are marked: a new phase makes them candidates
    assert cache.phases_started == 1
    assert allocator.free_calls == calls + 1
    assert cache.total_size() == 15
    for node in (a, b):
        kept = before[id(node)][: len(node.key)]
        assert node.value.tolist() == kept  # heads stay, tails go
    freed = sorted(allocator.freed_log)
    tails = sorted(before[id(a)][len(a.key) :] + before[id(b)][len(b.key) :])
    assert freed == tails
    check_tree(cache, allocator)


def test_an_emptied_leaf_is_deleted_and_its_parent_joins() -> None:
    cache, allocator = rlt_cache(100)
    insert(cache, allocator, [1, 2, 3, 4, 5, 6])
    insert(cache, allocator, [1, 2, 3, 7])  # splits: [1,2,3] -> [4,5,6], [7]
    assert evict(cache, 7) == 7  # everything: leaves, then the parent once it is a leaf
    assert cache.total_size() == 0
    assert not cache.root_node.children
    assert allocator.in_use == set()
    check_tree(cache, allocator)


def test_locked_nodes_survive_any_eviction() -> None:
    cache, allocator = rlt_cache(100)
    kept = insert(cache, allocator, [1, 2, 3, 4, 5])
    insert(cache, allocator, [1, 2, 3, 9, 9])
    insert(cache, allocator, [7] * 6)
    lock = cache.inc_lock_ref(kept)
    path = cache.path_device_indices(kept).tolist()
    assert evict(cache, 100) == 8  # all but the locked path
    assert cache.path_device_indices(kept).tolist() == path
    assert cache.evictable_size() == 0
    assert cache.protected_size() == 5
    check_tree(cache, allocator)
    cache.dec_lock_ref(kept, lock.to_dec_params())
    assert evict(cache, 100) == 5
    assert allocator.in_use == set()


def test_pages_go_whole_from_the_tail() -> None:
    cache, allocator = rlt_cache(64, page_size=4)
    leaf = insert(cache, allocator, list(range(16)))
    head = leaf.value.tolist()
    assert evict(cache, 5) == 8  # 5 tokens round up to 2 pages
    assert len(leaf.key) == 8
    assert leaf.value.tolist() == head[:8]
    assert sorted(allocator.freed_log) == head[8:]
    check_tree(cache, allocator)


def registered_size(node: Any) -> int:
    """A registered leaf's size in the plugin's registry (its attributes may be longer)."""
    state = node.__dict__
    return int(state["rlt_leaves"].size[state["slot"]])


def test_a_pending_trim_is_applied_when_sglang_first_reads_the_leaf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deferred trims: an evicted leaf keeps its old attributes until something reads one;
    every SGLang path that does (match, split, insert, lock, delete) sees the cut leaf, and
    the freed tails come from the arena, each KV slot once."""
    cache, allocator = rlt_cache(100, page_size=2, enable_kv_cache_events=True)

    # The draw is fixed here (picks in turn over the three candidates, last first: two pages
    # off each), so that every leaf is cut and none emptied, whatever the seeded stream.
    def in_turn(need: int) -> np.ndarray:
        return (2 - np.arange(need) % 3 + 0.5) / 3

    monkeypatch.setattr(cache.rlt, "uniforms", in_turn)
    a = insert(cache, allocator, list(range(12)))
    b = insert(cache, allocator, list(range(100, 112)))
    c = insert(cache, allocator, list(range(200, 212)))
    stored = {id(n): n.value.tolist() for n in (a, b, c)}
    cache.kv_events.take()
    cache.rlt.new_phase()
    assert evict(cache, 12) == 12
    assert all(type(n).__name__ == "_RegisteredLeaf" for n in (a, b, c))
    assert [registered_size(n) for n in (a, b, c)] == [8, 8, 8]
    assert all(is_pending(n) for n in (a, b, c))
    check_tree(cache, allocator, settle=False)
    kept = {id(n): registered_size(n) for n in (a, b, c)}
    assert all(len(n.__dict__["key"]) == 12 for n in (a, b, c)), "the attributes wait"
    assert sum(kept.values()) == 36 - 12
    assert sorted(allocator.freed_log) == sorted(
        i for n in (a, b, c) for i in stored[id(n)][kept[id(n)] :]
    )
    # A match that runs past a's kept part: SGLang reads a.key and gets the cut leaf.
    hit = match(cache, list(range(12)))
    assert hit.device_prefix_len == kept[id(a)]
    assert cache.path_device_indices(hit.last_device_node).tolist() == stored[id(a)][: kept[id(a)]]
    assert not is_pending(a)
    assert len(a.__dict__["key"]) == a.__dict__["value"].numel() == kept[id(a)]
    assert len(a.hash_value) == kept[id(a)] // 2  # the KV events' hashes were cut too
    # An insert that splits b inside its kept part and extends it; a lock on the new leaf.
    split_at = kept[id(b)] - 2
    leaf = insert(cache, allocator, [*range(100, 100 + split_at), 7, 7])
    assert not is_pending(b)
    assert len(b.key) == registered_size(b) == 2  # b is the lower half of the split
    assert b.value.tolist() == stored[id(b)][split_at : kept[id(b)]]
    assert type(b.parent) is TreeNode  # the upper half is an inner node, never registered
    lock = cache.inc_lock_ref(leaf)
    assert cache.path_device_indices(leaf).tolist()[:split_at] == stored[id(b)][:split_at]
    cache.dec_lock_ref(leaf, lock.to_dec_params())
    # c (unmarked, as is b's lower half; the fixed draw takes the last candidate) is
    # trimmed again while pending, then emptied with the rest: each KV slot comes back
    # once, and c's only from its registered size down.
    assert is_pending(c)
    freed_before = len(allocator.freed_log)
    assert evict(cache, 2) == 2
    assert registered_size(c) == kept[id(c)] - 2
    assert allocator.freed_log[freed_before:] == stored[id(c)][kept[id(c)] - 2 : kept[id(c)]]
    check_tree(cache, allocator, settle=False)
    left = cache.evictable_size()
    assert evict(cache, 1_000) == left
    assert allocator.in_use == set()
    assert all(type(n) is TreeNode for n in (a, b, c)), "deleted leaves leave the registry"
    events = cache.kv_events.take()
    removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
    assert removed == (36 + 2) // 2  # every page stored was reported removed once
    check_tree(cache, allocator)


def test_asking_whether_a_leaf_is_evicted_applies_no_pending_cut() -> None:
    """SGLang asks ``evicted`` of every sibling when it deletes a leaf; the answer needs
    no cut, so pending trims stay deferred (and the answer is SGLang's: a value is there)."""
    cache, allocator = rlt_cache(100)
    insert(cache, allocator, [1, 2, 3, 4, 5, 6])
    insert(cache, allocator, [1, 2, 3, 7, 8, 9])  # two leaves of 3 under [1, 2, 3]
    cache.rlt.new_phase()
    assert evict(cache, 2) == 2
    pending = [node for node in iter_nodes(cache) if is_pending(node)]
    assert pending
    for node in pending:
        assert node.evicted is False
        assert is_pending(node)
    check_tree(cache, allocator)


def test_a_full_arena_is_packed_and_every_value_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena holds twice the pool; once its end is reached (evicted and trimmed
    tokens leave holes), the next insert packs the live KV indices into a new one and
    points every node, leaves and inner nodes, at it."""
    monkeypatch.setattr(sglang_rlt, "_MIN_ARENA", 0)
    cache, allocator = rlt_cache(40)
    worker = Worker(cache, allocator)
    arenas = []
    for ids in shared_prefix_requests(2, 60):
        worker.serve(ids)
        if not arenas or cache._arena is not arenas[-1]:
            arenas.append(cache._arena)
        check_tree(cache, allocator, settle=False)
    assert len(arenas) >= 3, "the arena was packed at least twice"
    assert all(len(arena) == 80 for arena in arenas)  # twice the pool of 40
    assert cache._arena_top <= 80
    paths = {id(n): cache.path_device_indices(n).tolist() for n in iter_nodes(cache)}
    cache._pack_arena(0, cache._arena, None)  # an explicit pack changes no node's indices
    assert {id(n): cache.path_device_indices(n).tolist() for n in iter_nodes(cache)} == paths
    assert cache._arena_top == cache.total_size()
    check_tree(cache, allocator)
    evict(cache, 1_000)
    assert allocator.in_use == set()


@contextmanager
def device_waits_are_errors() -> Iterator[None]:
    """torch's sync debug mode: a call that makes the host wait for the CUDA device raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="host-device waits exist on a CUDA pool only (KVROUTE_TEST_DEVICE=cuda, "
    "scripts/gpu_engine_check.sh)",
)
@pytest.mark.parametrize("few_runs", [16, 0], ids=["slices", "one-index"])
def test_a_gpu_arena_evicts_and_packs_without_waiting_for_the_device(
    few_runs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CUDA pool (SGLang's own allocator) an eviction, whichever way it gathers the
    freed indices (a slice per run, or one index over all runs), and a pack of the arena
    queue their work and return: none makes the host wait for the device. A wait there
    would stall SGLang's scheduler, which runs while the GPU computes the batch before."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    monkeypatch.setattr(sglang_rlt, "_FEW_RUNS", few_runs)
    allocator = TokenToKVPoolAllocator(200, torch.bfloat16, "cuda", None, need_sort=False)
    cache = RLTRadixCache(cache_params(allocator), seed=0)
    evicted = []
    for ids in shared_prefix_requests(7, 120):
        node = match(cache, ids).last_device_node
        receipt = cache.inc_lock_ref(node)
        need = len(ids) - len(cache.path_device_indices(node))
        if need > allocator.available_size():
            with device_waits_are_errors():
                evicted.append(evict(cache, need - allocator.available_size()))
        value = torch.cat([cache.path_device_indices(node), allocator.alloc(need)])
        cache.insert(InsertParams(key=radix_key(ids), value=value))
        cache.dec_lock_ref(node, receipt.to_dec_params())
    assert len(evicted) > 10
    assert all(evicted)
    paths = {id(n): cache.path_device_indices(n).tolist() for n in iter_nodes(cache)}
    with device_waits_are_errors():
        cache._pack_arena(0, cache._arena, None)
    assert {id(n): cache.path_device_indices(n).tolist() for n in iter_nodes(cache)} == paths
    held = cache.all_values_flatten().tolist()
    free = allocator.free_pages.tolist()
    assert sorted(held + free) == list(range(1, 201))  # every index held or free, once


def test_a_cpu_arena_stages_the_same_frees_that_torch_gathers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU arena an eviction copies the KV indices it cuts into a staging array as it
    cuts them (``kernels.trim_gather``; an emptied leaf's by ``kernels.gather``) and hands
    the pool a view of it, reused by the next eviction; a GPU arena gathers the runs with
    torch at the end. On one seeded stream the pool gets the same indices in the same
    order, call by call, whichever way they were gathered."""
    logs: list[list[list[int]]] = []
    for staged in (True, False):
        monkeypatch.setattr(sglang_rlt, "_NUMPY_GATHER", staged)
        cache, allocator = rlt_cache(60, seed=3, device="cpu")  # on any machine
        calls: list[list[int]] = []

        def logged(
            values: torch.Tensor,
            free: Callable[[torch.Tensor], None] = allocator.free,
            calls: list[list[int]] = calls,
        ) -> None:
            calls.append(values.tolist())
            free(values)

        monkeypatch.setattr(allocator, "free", logged)
        worker = Worker(cache, allocator)
        for ids in shared_prefix_requests(5, 80):
            worker.serve(ids)
        assert (cache._staging is not None) is staged
        check_tree(cache, allocator)
        logs.append(calls)
    assert logs[0] == logs[1]
    assert len(logs[0]) == len(worker.evicted) > 10


def test_the_staging_array_grows_keeping_what_is_staged() -> None:
    cache, allocator = rlt_cache(40, device="cpu")  # the staging array is a CPU arena's
    insert(cache, allocator, list(range(10)))  # the CPU arena and its staging array
    staging = cache._staging
    assert staging is not None
    assert len(staging) >= 40
    staging[:3] = [7, 8, 9]
    cache._staged = 3
    assert cache._staging_room(len(staging) - 3) is staging  # room enough: the same array
    grown = cache._staging_room(len(staging))  # one more than is left
    assert grown is cache._staging is not staging
    assert len(grown) >= len(staging) + 3
    assert grown[:3].tolist() == [7, 8, 9]
    cache._staged = 0


def test_reset_flushes_tree_and_marks() -> None:
    cache, allocator = rlt_cache(50)
    worker = Worker(cache, allocator)
    for ids in shared_prefix_requests(0, 40):
        worker.serve(ids)
    cache.rlt.new_phase()
    evict(cache, 7)  # pending trims on the leaves that are flushed next
    old = list(cache._leaves)
    assert any(is_pending(node) for node in old)
    held = {id(n): n.__dict__["value"][: registered_size(n)].tolist() for n in old}
    cache.reset()
    assert cache.total_size() == 0
    assert cache.marked_tokens == 0
    assert len(cache._leaves) == 0
    for node in old:  # detached: plain nodes, cut to what they held
        assert type(node) is TreeNode
        assert node.slot == -1
        assert node.value.tolist() == held[id(node)]
        assert len(node.key) == len(held[id(node)])
    worker.allocator = allocator = TrackingAllocator(50)
    cache.token_to_kv_pool_allocator = allocator
    for ids in shared_prefix_requests(1, 40):
        worker.serve(ids)
    check_tree(cache, allocator)


# -- random operation sequences ----------------------------------------------------------------
_ids = st.lists(st.integers(0, 3), min_size=1, max_size=24)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("serve"), _ids),
        st.tuples(st.just("lock"), _ids),
        st.tuples(st.just("unlock"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(1, 80)),
    ),
    max_size=60,
)


@pytest.mark.parametrize(
    ("page_size", "eagle", "gather", "path"),
    [
        (1, False, "cpu", "compiled"),
        (4, False, "cpu", "compiled"),
        (1, True, "cpu", "compiled"),
        (2, False, "torch", "compiled"),
        (1, False, "torch-index", "compiled"),
        (1, False, "cpu", "reference"),
        (4, True, "torch", "reference"),
        (2, False, "torch", "reference"),
    ],
    ids=[
        "page1",
        "page4",
        "eagle",
        "page2-torch",
        "page1-torch-index",
        "page1-reference",
        "page4-eagle-torch-reference",
        "page2-torch-reference",
    ],
)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=_ops, seed=st.integers(0, 3))
def test_random_sequences_keep_every_invariant(
    page_size: int,
    eagle: bool,
    gather: str,
    path: str,
    ops: list[tuple[str, Any]],
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sizes recount, each KV slot is freed once, locked paths never lose a token; the
    freed indices gathered from the arena every way (on a CPU arena by ``kernels.gather``;
    with torch, as on a GPU: a slice per run, or one index, ``-index``), on both of RLT's
    eviction paths: the compiled loops (``kernels``) on the leaf registry's arrays, or
    without them the reference loop (``rlt_reference``), page by page."""
    monkeypatch.setattr(sglang_rlt, "_MIN_ARENA", 0)  # twice the pool: packs come often
    monkeypatch.setattr(sglang_rlt, "_NUMPY_GATHER", gather == "cpu")
    if gather.endswith("-index"):
        monkeypatch.setattr(sglang_rlt, "_FEW_RUNS", 0)
    if path == "compiled" and not kernels.COMPILED:  # the main suite asserts it is built
        pytest.skip("the C extension is not built here (no C compiler)")
    monkeypatch.setattr(kernels, "COMPILED", path == "compiled")
    cache, allocator = rlt_cache(48, page_size, seed=seed, is_eagle=eagle)
    worker = Worker(cache, allocator)
    locks: list[tuple[Any, Any, list[int]]] = []
    for op, arg in ops:
        if op == "serve":
            worker.serve(arg)
        elif op == "lock":
            node = match(cache, arg).last_device_node
            locks.append((node, cache.inc_lock_ref(node), cache.path_device_indices(node).tolist()))
        elif op == "unlock" and locks:
            node, receipt, _ = locks.pop(arg % len(locks))
            cache.dec_lock_ref(node, receipt.to_dec_params())
        elif op == "evict":
            freed = evict(cache, arg)
            assert freed <= -(-arg // page_size) * page_size
        check_tree(cache, allocator, settle=False)  # the next op meets pending trims
        for node, _, path in locks:
            assert cache.path_device_indices(node).tolist() == path
    for node, receipt, _ in locks:
        cache.dec_lock_ref(node, receipt.to_dec_params())
    evict(cache, 10_000)
    assert cache.total_size() == 0
    assert allocator.in_use == set()  # every slot handed out came back exactly once
    check_tree(cache, allocator)


# -- observability ----------------------------------------------------------------------------
def test_evictions_reach_sglang_metrics_hook_and_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    allocator = TrackingAllocator(40)
    cache = RLTRadixCache(cache_params(allocator), seed=0, log_every=2)
    observed: list[int] = []
    monkeypatch.setattr(cache, "update_eviction_metrics", lambda n, start: observed.append(n))
    worker = Worker(cache, allocator)
    with caplog.at_level(logging.INFO, logger="engine_ext.sglang_rlt"):
        for ids in shared_prefix_requests(3, 60):
            worker.serve(ids)
    assert observed == worker.evicted
    assert sum(observed) == cache.evicted_tokens_total > 0
    lines = [r.getMessage() for r in caplog.records if "evict calls" in r.getMessage()]
    assert len(lines) == len(worker.evicted) // 2
    assert f"{cache.phases_started} phases" in lines[-1] or len(worker.evicted) % 2


# -- KV events ------------------------------------------------------------------------------------
def _live_blocks(cache: Any, page_size: int) -> set[int]:
    """The block hashes a fresh recorder would publish for the tree as it stands now."""
    recorder = KVCacheEventRecorder(enabled=True, page_size=page_size)
    stack = [cache.root_node]
    while stack:  # parents before children, as the hashes chain
        node = stack.pop()
        if node is not cache.root_node:
            recorder.record_store(node)
        stack.extend(node.children.values())
    return {h for event in recorder.take() for h in event.block_hashes}


@pytest.mark.parametrize("policy", ["lru", "rlt"])
@pytest.mark.parametrize(("page_size", "extra_key"), [(1, None), (4, None), (1, "lora-a")])
def test_kv_events_remove_exactly_what_was_stored(
    policy: str, page_size: int, extra_key: str | None
) -> None:
    """Replaying the events gives the tree's blocks; SGLang's LRU passes the same check."""
    build = rlt_cache if policy == "rlt" else lru_cache
    cache, allocator = build(120, page_size, enable_kv_cache_events=True)
    worker = Worker(cache, allocator, extra_key=extra_key)
    live: set[int] = set()
    removed = 0
    for ids in shared_prefix_requests(5, 150):
        worker.serve(ids)
        for event in cache.kv_events.take():
            if isinstance(event, BlockStored):
                assert live.isdisjoint(event.block_hashes)
                live.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= live, "removed a block never stored"
                live.difference_update(event.block_hashes)
                removed += len(event.block_hashes)
    assert sum(worker.evicted) > 0
    assert removed > 0
    assert live == _live_blocks(cache, page_size)
    check_tree(cache, allocator)


def test_values_of_another_dtype_than_the_arena_are_refused() -> None:
    cache, allocator = rlt_cache(30)
    insert(cache, allocator, [1, 2, 3])
    odd = allocator.alloc(2).to(torch.int32)
    with pytest.raises(RuntimeError, match=r"torch\.int32 .* torch\.int64 .* one KV pool"):
        cache.insert(InsertParams(key=radix_key([7, 8]), value=odd))
    assert cache.total_size() == 3  # refused before the tree changed
    check_tree(cache)


def test_values_stay_tensors_of_the_right_dtype() -> None:
    cache, allocator = rlt_cache(30)
    worker = Worker(cache, allocator)
    for ids in shared_prefix_requests(9, 50):
        worker.serve(ids)
    for node in iter_nodes(cache):
        assert isinstance(node.value, torch.Tensor)
        assert node.value.dtype == torch.int64
