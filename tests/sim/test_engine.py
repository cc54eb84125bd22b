"""WorkerEngine: SGLang-like scheduling and KV accounting over the reference radix cache."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from engine_ext.cache import RadixCache
from router_service.kv_wire import BlockStored
from sim.cache_events import EventedRadixCache
from sim.engine import EngineRequest, RequestTooLarge, StepResult, WorkerEngine
from sim.profiles import PROFILES, ServiceProfile, get_profile
from sim.tokens import ids_to_key

ROUND = ServiceProfile(
    name="round",
    kv_capacity_tokens=1_000,
    chunked_prefill_tokens=1_000,
    max_running_requests=64,
    weight_ms=10.0,
    kv_read_ms_per_token=0.0,
    per_seq_ms=0.0,
    prefill_ms_per_token=1.0,
    attn_ms_per_token_pair=0.0,
    step_overhead_ms=0.0,
    request_overhead_ms=0.0,
)


def engine(
    capacity: int, eviction: str = "lru", page_size: int = 1, **profile: int
) -> WorkerEngine:
    cache = RadixCache(capacity, eviction, page_size=page_size, rng=random.Random(0))
    return WorkerEngine(replace(ROUND, **profile), cache)


def tokens(*ranges: range) -> str:
    return ids_to_key([i for r in ranges for i in r])


def drain(
    eng: WorkerEngine, now_ms: float = 0.0, check: Callable[[], None] | None = None
) -> tuple[float, list[StepResult]]:
    """Run steps back to back until the engine is idle; returns the end time and results."""
    results = []
    while (step := eng.plan_step(now_ms)) is not None:
        if check is not None:
            check()
        now_ms += step.duration_ms
        results.append(eng.finish_step(step, now_ms))
        if check is not None:
            check()
    return now_ms, results


def test_profiles_have_sources_and_unknown_names_list_the_known() -> None:
    assert get_profile("llama3.1-8b-l40").kv_capacity_tokens == 196_000
    for profile in PROFILES.values():
        assert profile.source
    with pytest.raises(ValueError, match=r"unknown profile 'gpu'; known: llama3\.1-70b-h200"):
        get_profile("gpu")


def test_step_time_formulas() -> None:
    p = replace(
        ROUND,
        weight_ms=10.0,
        kv_read_ms_per_token=0.5,
        per_seq_ms=1.0,
        prefill_ms_per_token=2.0,
        attn_ms_per_token_pair=0.25,
        step_overhead_ms=3.0,
    )
    # prefill: max(T_w, a * N_new + c * sum n (prior + n / 2)) + o_step
    assert p.prefill_ms([(4, 0)]) == max(10.0, 8.0 + 0.25 * 4 * 2) + 3.0
    assert p.prefill_ms([(10, 2), (2, 0)]) == 2.0 * 12 + 0.25 * (10 * 7 + 2 * 1) + 3.0
    # decode: T_w + beta * context + b * batch + o_step
    assert p.decode_ms(context_tokens=40, batch=3) == 10.0 + 20.0 + 3.0 + 3.0
    half = p.scaled(0.5)
    assert half.decode_ms(40, 3) == 2 * p.decode_ms(40, 3)
    with pytest.raises(ValueError, match="speed must be > 0"):
        p.scaled(0)


def test_a_request_larger_than_the_cache_is_refused() -> None:
    eng = engine(50)
    with pytest.raises(RequestTooLarge, match="needs 51 KV tokens; the cache holds 50"):
        eng.submit(EngineRequest("big", tokens(range(45)), max_new_tokens=6), now_ms=0)
    eng.submit(EngineRequest("fits", tokens(range(45)), max_new_tokens=5), now_ms=0)
    assert eng.load == 1
    with pytest.raises(ValueError, match="at least one prompt token"):
        eng.submit(EngineRequest("empty", "", max_new_tokens=1), now_ms=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.submit(EngineRequest("none", "a", max_new_tokens=0), now_ms=0)


def test_prefill_runs_before_decode_and_reuses_the_cached_prefix() -> None:
    eng = engine(1_000)
    a = EngineRequest("a", tokens(range(20)), max_new_tokens=3)
    eng.submit(a, now_ms=0)
    step = eng.plan_step(0)
    assert step is not None
    assert (step.kind, step.duration_ms, [n for _, n in step.chunks]) == ("prefill", 20.0, [20])
    assert eng.finish_step(step, 20).first_tokens == [a]
    b = EngineRequest("b", tokens(range(15), range(100, 105)), max_new_tokens=1)
    eng.submit(b, now_ms=20)
    step = eng.plan_step(20)  # a is decoding, but b's prefill goes first
    assert step is not None
    assert step.kind == "prefill"
    assert [(r.rid, n) for r, n in step.chunks] == [("b", 5)]  # 15 of 20 tokens cached
    assert step.duration_ms == 10.0  # max(T_w, 5 * 1 ms)
    result = eng.finish_step(step, 30)
    assert result.finished == [b]  # one output token: done at its first token
    step = eng.plan_step(30)
    assert step is not None
    assert step.kind == "decode"
    assert step.decode == [a]
    assert (b.cached, b.first_token_ms, b.finished_ms) == (15, 30, 30)


def test_the_last_prompt_token_is_always_recomputed() -> None:
    eng = engine(1_000)
    prompt = tokens(range(12))
    eng.submit(EngineRequest("a", prompt, max_new_tokens=1), now_ms=0)
    drain(eng)
    again = EngineRequest("b", prompt, max_new_tokens=1)
    eng.submit(again, now_ms=100)
    step = eng.plan_step(100)
    assert step is not None
    assert step.chunks == [(again, 1)]
    assert again.cached == 11
    assert eng.cache.stats.cached_tokens == 11
    assert eng.cache.stats.prompt_tokens == 24


def test_chunked_prefill_splits_a_long_prompt() -> None:
    eng = engine(1_000, chunked_prefill_tokens=8)
    a = EngineRequest("a", tokens(range(20)), max_new_tokens=1)
    b = EngineRequest("b", tokens(range(50, 53)), max_new_tokens=1)
    eng.submit(a, now_ms=0)
    eng.submit(b, now_ms=0)
    sizes = []
    while (step := eng.plan_step(0)) is not None:
        sizes.append([(r.rid, n) for r, n in step.chunks])
        eng.finish_step(step, 0)
    # One request in chunked prefill at a time; b waits for a's last chunk and fills the
    # budget it leaves (SGLang's PrefillAdder goes on through the queue after it).
    assert sizes == [[("a", 8)], [("a", 8)], [("a", 4), ("b", 3)]]
    assert a.finished_ms == 0
    assert b.finished_ms == 0


def test_a_chunked_prompt_enters_the_tree_chunk_by_chunk() -> None:
    """SGLang checkpoints a chunked request's prefix into the tree after each chunk: a
    request with the same prefix admitted beside the last chunk matches the earlier ones,
    and is itself cut to the budget left, becoming the next chunked request."""
    eng = engine(1_000, chunked_prefill_tokens=8)
    a = EngineRequest("a", tokens(range(20)), max_new_tokens=2)
    b = EngineRequest("b", tokens(range(20), range(100, 103)), max_new_tokens=1)
    eng.submit(a, now_ms=0)
    eng.submit(b, now_ms=0)
    step = eng.plan_step(0)
    assert step is not None
    eng.finish_step(step, 10)
    assert eng.cache.peek_prefix(a.prompt) == 8  # the first chunk is in the tree
    assert eng.cache.evictable_tokens == 0  # and locked by a, which is still prefilling
    assert a.reserved == 20 - 8 + 2
    sizes = []
    while (step := eng.plan_step(10)) is not None:
        sizes.append([(r.rid, n) for r, n in step.chunks])
        eng.finish_step(step, 10)
    assert sizes[:3] == [[("a", 8)], [("a", 4), ("b", 4)], [("b", 3)]]
    assert (a.cached, b.cached) == (0, 16)
    assert eng.cache.reserved_tokens == eng.cache.protected_tokens == 0
    assert eng.cache.total_tokens == 23 + 1  # b's prompt, then a's prompt and first answer token
    eng.cache.check_invariants()


def test_max_running_requests_caps_the_batch() -> None:
    eng = engine(1_000, max_running_requests=2)
    reqs = [EngineRequest(f"r{i}", tokens(range(i * 10, i * 10 + 5)), 3) for i in range(3)]
    for r in reqs:
        eng.submit(r, now_ms=0)
    step = eng.plan_step(0)
    assert step is not None
    assert [r.rid for r, _ in step.chunks] == ["r0", "r1"]
    eng.finish_step(step, 10)
    step = eng.plan_step(10)  # two running: r2 cannot join, so this is a decode step
    assert step is not None
    assert (step.kind, [r.rid for r in step.decode]) == ("decode", ["r0", "r1"])
    eng.finish_step(step, 20)
    drain(eng, now_ms=20)
    assert reqs[2].admitted_ms == reqs[0].finished_ms == reqs[1].finished_ms == 30


def test_a_request_that_does_not_fit_waits_at_the_head_of_the_queue() -> None:
    eng = engine(40)
    big = EngineRequest("big", tokens(range(30)), max_new_tokens=5)  # holds 35 of 40
    mid = EngineRequest("mid", tokens(range(100, 110)), max_new_tokens=2)  # needs 12
    small = EngineRequest("small", tokens(range(200, 202)), max_new_tokens=1)  # needs 3
    for r in (big, mid, small):
        eng.submit(r, now_ms=0)
    now, order = 0.0, []
    while (step := eng.plan_step(now)) is not None:
        order.extend(r.rid for r, _ in step.chunks)
        if big.finished_ms is None:
            # While big holds its memory, mid cannot be admitted, and small (which would
            # fit) must not overtake it: FCFS.
            assert [r.rid for r in eng.waiting] == ["mid", "small"][: len(eng.waiting)]
            assert mid.admitted_ms is None
            assert small.admitted_ms is None
        now += step.duration_ms
        eng.finish_step(step, now)
        assert eng.cache.total_tokens + eng.cache.reserved_tokens <= 40
    assert order == ["big", "mid", "small"]
    assert mid.admitted_ms is not None
    assert big.finished_ms is not None
    assert mid.admitted_ms >= big.finished_ms
    assert eng.cache.stats.evicted_tokens > 0  # mid's admission evicted big's finished KV


@pytest.mark.parametrize("eviction", ["lru", "rlt"])
def test_a_request_waiting_for_kv_room_evicts_nothing(eviction: str) -> None:
    """SGLang admits a request only when free + evictable KV covers it, and evicts nothing for
    one it cannot admit yet: the cached prefix of a third request survives the wait."""
    eng = engine(40, eviction)
    kept = EngineRequest("kept", tokens(range(10)), max_new_tokens=1)
    eng.submit(kept, now_ms=0)
    now, _ = drain(eng)
    assert eng.cache.total_tokens == 10
    running = EngineRequest("running", tokens(range(100, 120)), max_new_tokens=5)  # needs 25
    waiting = EngineRequest("waiting", tokens(range(200, 215)), max_new_tokens=5)  # needs 20
    eng.submit(running, now_ms=now)
    eng.submit(waiting, now_ms=now)
    while running.finished_ms is None:
        step = eng.plan_step(now)
        assert step is not None
        # 40 - 10 cached - 25 held leaves 5 free + 10 evictable: waiting cannot fit yet.
        assert waiting.admitted_ms is None
        assert eng.cache.stats.evicted_tokens == 0
        assert eng.cache.match_prefix(kept.prompt).length == 10
        now += step.duration_ms
        eng.finish_step(step, now)
    drain(eng, now_ms=now)
    assert waiting.finished_ms is not None
    assert eng.cache.stats.evicted_tokens > 0  # admitted once running's KV could go


@pytest.mark.parametrize(("eviction", "page_size"), [("lru", 1), ("rlt", 1), ("rlt", 4)])
def test_kv_accounting_never_exceeds_capacity(eviction: str, page_size: int) -> None:
    capacity = 96
    eng = engine(capacity, eviction, page_size, max_running_requests=4, chunked_prefill_tokens=16)
    rng = random.Random(5)
    prefixes = [list(range(g * 1000, g * 1000 + 24)) for g in range(4)]
    requests = []
    for i in range(60):
        prefix = prefixes[rng.randrange(4)]
        tail = list(range(10**5 + i * 100, 10**5 + i * 100 + rng.randrange(1, 30)))
        requests.append(EngineRequest(f"r{i}", ids_to_key(prefix + tail), rng.randrange(1, 6)))

    def check() -> None:
        cache = eng.cache
        assert cache.total_tokens + cache.reserved_tokens <= capacity
        cache.check_invariants()

    now = 0.0
    for i, r in enumerate(requests):
        eng.submit(r, now_ms=now)
        if i % 5 == 4:  # submit in bursts, run a few steps in between
            for _ in range(3):
                step = eng.plan_step(now)
                if step is None:
                    break
                check()
                now += step.duration_ms
                eng.finish_step(step, now)
                check()
    drain(eng, now, check)
    assert all(r.finished_ms is not None for r in requests)
    assert all(r.generated == r.max_new_tokens for r in requests)
    assert eng.cache.reserved_tokens == 0
    assert eng.cache.protected_tokens == 0
    assert eng.cache.stats.requests == 60
    assert 0 < eng.cache.stats.cached_tokens < eng.cache.stats.prompt_tokens
    assert eng.cache.stats.evicted_tokens > 0


def test_flush_is_refused_while_requests_are_in_the_worker() -> None:
    eng = engine(100)
    eng.submit(EngineRequest("a", tokens(range(5)), max_new_tokens=2), now_ms=0)
    assert not eng.flush()
    drain(eng)
    assert eng.cache.total_tokens > 0
    assert eng.flush()
    assert eng.cache.total_tokens == 0


def test_each_chunk_publishes_its_pages_as_it_enters_the_tree() -> None:
    """The KV events of a chunked prompt: a ``BlockStored`` after each chunk (SGLang's
    checkpoint), so a router reading them sees the prefix grow before the first token."""
    cache = EventedRadixCache(1_000, "lru", page_size=4, rng=random.Random(0))
    eng = WorkerEngine(replace(ROUND, chunked_prefill_tokens=8), cache)
    cache.events.take()  # its AllBlocksCleared
    a = EngineRequest("a", tokens(range(20)), max_new_tokens=1)
    eng.submit(a, now_ms=0)
    stored_pages = []
    while (step := eng.plan_step(0)) is not None:
        eng.finish_step(step, 0)
        events = cache.events.take()
        stored_pages.append(sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)))
    assert stored_pages == [2, 2, 1]  # 8 tokens, 8 more, then the last 4: pages of 4


def _refresh_case(eviction: str = "lru", refresh: bool = True, rankings: int = 0):
    """Two cached prompts, ``old`` then ``new``; ``head`` needs room that evicts one of
    them, and ``waiter``, queued behind it, shares ``old``'s prefix."""
    cache = RadixCache(100, eviction, rng=random.Random(0))
    eng = WorkerEngine(replace(ROUND, kv_capacity_tokens=100), cache, refresh_waiting=refresh)
    old = EngineRequest("old", tokens(range(20)), max_new_tokens=1)
    new = EngineRequest("new", tokens(range(100, 120)), max_new_tokens=1)
    for r in (old, new):
        eng.submit(r, now_ms=0)
        drain(eng)
    assert cache.total_tokens == 40
    eng.rankings = rankings
    head = EngineRequest("head", tokens(range(200, 275)), max_new_tokens=5)  # needs 80 of 60 free
    waiter = EngineRequest("waiter", tokens(range(20), range(300, 310)), max_new_tokens=1)
    eng.submit(head, now_ms=0)
    eng.submit(waiter, now_ms=0)
    return eng, head, waiter


def test_the_waiting_queue_prefixes_are_touched_as_sglang_does() -> None:
    """SGLang 0.5.23 touches the waiting requests' cached prefixes when it ranks the queue
    (``_touch_waiting_prefixes``): head's admission evicts the newer prompt, not the one
    ``waiter`` will reuse; without the refresh LRU takes the older one and waiter finds
    nothing."""
    eng, _, waiter = _refresh_case()
    drain(eng)
    assert waiter.cached == 20  # old's whole prompt
    eng, _, waiter = _refresh_case(refresh=False)
    drain(eng)
    assert waiter.cached == 0


def test_the_refresh_runs_every_32nd_ranking_and_not_while_the_batch_is_full() -> None:
    eng, head, waiter = _refresh_case(rankings=1)  # the next ranking is not a refresh
    drain(eng)
    assert waiter.cached == 0
    eng, head, waiter = _refresh_case()
    now, seen = 0.0, []
    while (step := eng.plan_step(now)) is not None:
        seen.append((eng.rankings, eng.full, head.finished_ms is None))
        now += step.duration_ms
        eng.finish_step(step, now)
    # head is admitted at the first ranking; waiter is refused for KV, and the queue is not
    # ranked again while head holds its room: once more when head leaves.
    while_head = {(r, full) for r, full, running in seen if running}
    assert while_head == {(1, True)}
    assert seen[-1][0] == 2
    assert waiter.cached == 20
