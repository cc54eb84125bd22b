"""The exact block sets: page hashes, events in, matches out, liveness on an injected clock.

The reference cache's own events (``sim.cache_events``) drive the sets through random
inserts and evictions under LRU and RLT; after every step a set's match of any key must be
exactly what the cache holds of it (page-aligned), for every worker at once.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from engine_ext.cache.keys import ids_to_key
from router_service.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router_service.routing.block_hash import page_hashes
from router_service.routing.block_sets import BlockSets
from sim.cache_events import EventedRadixCache


def reference_hashes(ids: list[int], page: int) -> list[int]:
    """SGLang's hash_page / hash_str_to_int64, written out independently."""
    out, prior = [], b""
    for start in range(0, len(ids) // page * page, page):
        data = b"".join(t.to_bytes(4, "little") for t in ids[start : start + page])
        prior = hashlib.sha256(prior + data).digest()
        value = int(prior.hex()[:16], 16)
        out.append(value - 2**64 if value >= 2**63 else value)
    return out


@pytest.mark.parametrize("page", [1, 4, 16])
def test_page_hashes_are_sglangs_chain(page: int) -> None:
    rng = random.Random(page)
    ids = [rng.randrange(0, 128_256) for _ in range(100)]
    assert page_hashes(ids, page) == reference_hashes(ids, page)
    assert page_hashes(ids_to_key(ids), page) == reference_hashes(ids, page)  # key strings
    assert len(page_hashes(ids, page)) == 100 // page  # a partial page is not hashed


def batch(*events: object) -> EventBatch:
    return EventBatch(0.0, list(events))  # type: ignore[arg-type]


def stored(ids: list[int], page: int = 2, parent: int | None = None) -> BlockStored:
    return BlockStored(page_hashes(ids, page), parent, ids, page, None)


def test_match_walks_all_workers_at_once_and_stops_at_the_first_missing_page() -> None:
    sets = BlockSets()
    for url in ("a", "b", "c"):
        sets.add(url)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    sets.apply("a", batch(stored(ids)), 0.0)
    sets.apply("b", batch(stored(ids[:4])), 0.0)
    sets.apply("c", batch(AllBlocksCleared()), 0.0)
    matched, reasons = sets.match("r1", [*ids, 9], ["a", "b", "c"])
    assert matched == {"a": 8, "b": 4}
    # c's events are live but name no page size yet: its pages cannot be hashed.
    assert reasons == {"c": "events live, no page stored yet (page size unknown)"}
    # Pages past a missing one never count (the tree holds prefixes only).
    sets.apply("b", batch(BlockRemoved(page_hashes(ids, 2)[:1])), 0.0)
    assert sets.match("r2", ids, ["b"])[0] == {"b": 0}
    sets.check_invariants()


def test_removals_clears_and_worker_removal_keep_counts_exact() -> None:
    sets = BlockSets()
    sets.add("a")
    sets.add("b")
    ids = list(range(10, 30))
    sets.apply("a", batch(stored(ids)), 0.0)
    sets.apply("b", batch(stored(ids)), 0.0)
    assert sets.workers["a"].blocks == sets.workers["b"].blocks == 10
    sets.apply("a", batch(BlockRemoved(page_hashes(ids, 2)[5:])), 0.0)
    assert sets.workers["a"].blocks == 5
    sets.apply("b", batch(AllBlocksCleared()), 0.0)
    assert sets.workers["b"].blocks == 0
    sets.check_invariants()
    sets.remove("a")
    assert sets.holders == {}
    sets.add("c")  # takes the free slot
    assert sets.workers["c"].slot == 0


def test_a_store_whose_parent_was_never_seen_is_counted() -> None:
    sets = BlockSets()
    sets.add("a")
    sets.apply("a", batch(stored([5, 6], parent=12345)), 0.0)
    assert sets.workers["a"].orphans == 1


def test_a_worker_is_matched_on_its_events_only_while_they_are_live() -> None:
    sets = BlockSets(stale_s=10.0)
    sets.add("a")
    assert sets.match("r", [1, 2], ["a"]) == ({}, {"a": "events connecting: no event yet"})
    sets.apply("a", batch(stored([1, 2])), now_ms=0.0)
    assert sets.fallback("a") is None
    sets.expect("a", uncached_tokens=1, now_ms=1_000.0)  # less than a page: nothing due
    assert sets.refresh(now_ms=60_000.0) == []
    sets.expect("a", uncached_tokens=2, now_ms=1_000.0)  # a page to store: an event is due
    assert sets.refresh(now_ms=11_000.0) == []
    assert sets.refresh(now_ms=11_001.0) == ["a"]
    matched, reasons = sets.match("r", [1, 2], ["a"])
    assert matched == {}
    assert reasons["a"].startswith("events stale: no event 10 s after an answer that stored")
    sets.apply("a", batch(), now_ms=12_000.0)  # the next batch: live again
    assert sets.match("r", [1, 2], ["a"]) == ({"a": 2}, {})


@pytest.mark.parametrize("eviction", ["lru", "rlt"])
@pytest.mark.parametrize("page", [1, 4])
def test_sets_fed_by_the_reference_cache_match_it_exactly(eviction: str, page: int) -> None:
    """Random prompts sharing prefixes through two small caches that evict all the time."""
    rng = random.Random(7)
    caches = {
        url: EventedRadixCache(400, eviction, page_size=page, rng=random.Random(i))
        for i, url in enumerate(("w0", "w1"))
    }
    sets = BlockSets()
    for url, cache in caches.items():
        sets.add(url)
        sets.apply(url, EventBatch(0.0, cache.events.take()), 0.0)  # its AllBlocksCleared
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 60))] for _ in range(6)]

    def prompt() -> list[int]:
        return rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 40))]

    for step in range(300):
        url = rng.choice(list(caches))
        cache = caches[url]
        ids = prompt()
        cache.ensure_free(len(ids))
        cache.insert(ids_to_key(ids))
        if step % 7 == 0:
            cache.evict(rng.randrange(1, 120))
        sets.apply(url, EventBatch(0.0, cache.events.take()), 0.0)
        probe = prompt()
        matched, _ = sets.match(f"p{step}", probe, list(caches))
        for name, other in caches.items():
            held = other.peek_prefix(ids_to_key(probe))
            # Absent until its first store names the page size (it then holds nothing).
            assert matched.get(name, 0) == held // page * page, (step, name)
    sets.check_invariants()
    for url, cache in caches.items():
        assert sets.workers[url].blocks == cache.total_tokens // page


def test_the_router_reads_live_events_and_expects_them_after_an_answer_stored_pages() -> None:
    from router_service.routing import (
        Decision,
        Outcome,
        Router,
        RouteRequest,
        WorkerStatus,
        make_policy,
    )

    sets = BlockSets(stale_s=5.0)
    router = Router(make_policy("cache_aware", preset="sglang"), blocks=sets)
    sets.add("a")
    ids = list(range(1, 9))
    sets.apply("a", batch(stored(ids[:4])), now_ms=0.0)
    workers = [WorkerStatus("a"), WorkerStatus("b")]
    request = RouteRequest("r1", ids_to_key(ids), len(ids), 1, tokens=True)
    decision = router.decide(request, workers)
    assert decision.candidate("a").cached == 4
    assert decision.cache_sources == {"a": "events"}
    shown = {c["worker"]: c for c in decision.to_dict()["candidates"]}
    assert (shown["a"]["cache_source"], shown["b"]["cache_source"]) == ("events", "approximate")
    text = RouteRequest("r2", "some text", None, 1)
    assert "no token ids" in (router.decide(text, workers).cache_sources or {})["a"]

    only_a = [WorkerStatus("a")]

    def send(rid: str, first: int, now_ms: float) -> Decision:
        sent = RouteRequest(rid, ids_to_key(list(range(first, first + 8))), 8, 1, tokens=True)
        return router.route(sent, only_a, now_ms)

    # Sent with 4 uncached tokens (2 pages), then queued in the worker for ten minutes:
    # nothing is stored meanwhile, so silence is no fault.
    first = router.decide(request, only_a)
    router.commit(request, first, now_ms=100.0)
    assert sets.refresh(now_ms=600_000.0) == []
    router.first_token("r1", now_ms=600_000.0)  # prefilled: the pages' events were due
    assert sets.refresh(now_ms=604_000.0) == []
    stored_4 = Outcome(True, latency_ms=50.0, cached_tokens=4, prompt_tokens=8)
    router.complete(first, stored_4, now_ms=604_000.0)  # its answer: 4 tokens stored
    assert sets.refresh(now_ms=605_000.0) == []  # 5 s from the first token
    assert sets.refresh(now_ms=605_001.0) == ["a"]
    assert "after an answer that stored blocks" in (sets.fallback("a") or "")
    sets.apply("a", batch(), now_ms=606_000.0)  # the next batch: live again

    # A batch that came after the send shows the publisher alive, whenever the answer comes.
    r3 = send("r3", 100, 607_000.0)
    sets.apply("a", batch(stored(list(range(100, 108)))), now_ms=608_000.0)
    router.first_token(r3.decision_id, now_ms=700_000.0)
    router.complete(r3, Outcome(True, latency_ms=50.0), 700_050.0)
    assert sets.refresh(now_ms=800_000.0) == []

    # An answer that found its whole prompt cached stored nothing, whatever was predicted;
    # a failed request proves nothing stored.
    r4 = send("r4", 200, 850_000.0)
    cached_all = Outcome(True, latency_ms=50.0, cached_tokens=7, prompt_tokens=8)
    router.complete(r4, cached_all, 850_050.0)
    router.complete(send("r5", 250, 900_000.0), Outcome(False, status="http_500"), 950_000.0)
    assert sets.refresh(now_ms=990_000.0) == []
    # A whole answer (not streamed) that does not say what it found: the router's
    # prediction (8 uncached), from the answer's end.
    r6 = send("r6", 300, 1_000_000.0)
    router.complete(r6, Outcome(True, latency_ms=50.0), 1_000_050.0)
    assert sets.refresh(now_ms=1_005_050.0) == []
    assert sets.refresh(now_ms=1_005_051.0) == ["a"]


def test_pages_of_requests_in_flight_count_until_they_end() -> None:
    sets = BlockSets()
    sets.add("a")
    sets.add("b")
    sets.apply("a", batch(AllBlocksCleared()), 0.0)
    sets.apply("b", batch(stored([1, 2])), 0.0)  # b's page size is known, a's not yet
    ids = [1, 2, 3, 4, 5, 6]
    sets.open("r1", "b", ids)  # sent to b: being prefilled there, no event yet
    sets.open("r2", "b", ids[:4])
    sets.open("r0", "a", ids)  # a's page size is unknown: nothing to count
    assert sets.match("probe", [*ids, 7, 8], ["a", "b"])[0] == {"b": 6}
    sets.close("r1")
    assert sets.match("probe2", ids, ["b"])[0] == {"b": 4}  # r2 still carries 4 tokens
    sets.close("r2")
    sets.close("r2")  # twice: nothing
    assert sets.match("probe3", ids, ["b"])[0] == {"b": 2}  # what the events stored
    assert sets.pending == {}
    sets.open("r3", "b", ids)
    sets.remove("b")
    assert sets.pending == {}


def test_with_the_workers_chunk_size_a_request_in_flight_counts_all_but_its_last_chunk() -> None:
    """SGLang stores a chunked prompt after each chunk; a request admitted beside the last
    chunk (or a prompt's only one) finds what the earlier chunks stored, not that chunk."""
    sets = BlockSets()
    sets.add("w")
    sets.apply("w", batch(stored([1, 2])), 0.0)  # page size 2; the first page is held
    sets.set_chunk("w", 4)
    ids = list(range(1, 13))  # 12 tokens, 2 of them cached: chunks of 4, 4 and 2
    sets.open("r1", "w", ids, cached_tokens=2)
    assert sets.match("p1", ids, ["w"])[0] == {"w": 10}  # the first two chunks, not the last
    sets.close("r1")
    sets.open("r2", "w", ids[:6], cached_tokens=2)  # one chunk: only what is stored counts
    assert sets.match("p2", ids, ["w"])[0] == {"w": 2}
    sets.close("r2")
    sets.open("r3", "w", ids[:10], cached_tokens=2)  # 8 new tokens: two whole chunks
    assert sets.match("p3", ids, ["w"])[0] == {"w": 6}
    sets.close("r3")
    for unknown in (None, 0, -1):  # not known, or the worker does not chunk: all pages count
        sets.set_chunk("w", unknown)
        assert sets.workers["w"].chunk_tokens is None
        sets.open("r4", "w", ids, cached_tokens=2)
        assert sets.match(f"p4{unknown}", ids, ["w"])[0] == {"w": 12}
        sets.close("r4")
    assert sets.pending == {}
    assert sets.status()["w"]["chunk_tokens"] is None
