"""What survives in a worker's cache: learned from its answers, used by lbgr's index."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from router_service.routing import Outcome, PrefixIndex, Router, RouteRequest, WorkerStatus
from router_service.routing.policy import make_policy
from router_service.routing.survival import BASE_MS, BUCKETS, CacheSurvival, age_bucket

A, B = "http://a", "http://b"
BOTH = [WorkerStatus(A), WorkerStatus(B)]


def ids(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def req(rid: str, key: tuple[int, ...], max_new: int = 4) -> RouteRequest:
    return RouteRequest(rid, key, len(key), max_new, tokens=True)


# -- the curve --------------------------------------------------------------------------------
def test_octaves_of_age() -> None:
    assert age_bucket(0.0) == age_bucket(BASE_MS - 1) == 0
    assert age_bucket(BASE_MS) == 1
    assert age_bucket(2 * BASE_MS) == 2
    assert age_bucket(math.nan) == 0
    assert age_bucket(1e15) == BUCKETS - 1


def test_unlearned_worker_keeps_the_index_as_it_is() -> None:
    s = CacheSurvival()
    segments = [(0, 100, 10.0), (100, 300, 1e6)]
    assert s.expected("w", segments) == 300
    assert s.horizon_ms("w") is None
    assert s.curve("w") == (1.0,) * BUCKETS


def test_learns_an_lru_horizon_and_keeps_the_curve_non_increasing() -> None:
    s = CacheSurvival()
    rng = random.Random(0)
    for _ in range(400):  # an LRU cache keeping what was sent in the last ~8 s
        age = rng.uniform(0, 60_000)
        s.observe("w", [(0, 200, age)], cached_units=200 if age < 8_000 else 0)
    curve = s.curve("w")
    assert all(a >= b for a, b in itertools.pairwise(curve))
    assert s.survival("w", 1_000) > 0.9
    assert s.survival("w", 30_000) < 0.1
    assert 4_000 <= (s.horizon_ms("w") or 0) <= 16_000
    assert s.survival("other", 30_000) == 1.0  # per worker


def test_a_partial_hit_covers_the_segments_it_reaches() -> None:
    s = CacheSurvival(slack_tokens=0)
    young, old = (0, 100, 100.0), (100, 200, 100_000.0)
    for _ in range(200):
        s.observe("w", [young, old], cached_units=150)  # half of the old segment was there
    assert s.survival("w", 100.0) == pytest.approx(1.0)
    assert s.survival("w", 100_000.0) == pytest.approx(0.5, abs=0.05)
    assert s.expected("w", [young, old]) == pytest.approx(150, abs=5)
    # A belief whose survival reaches ``whole_from`` counts whole; below, at its survival.
    assert s.expected("w", [young, old], whole_from=0.4) == 200
    assert s.expected("w", [young, old], whole_from=0.6) == pytest.approx(150, abs=5)


def test_slack_forgives_the_page_rounding_and_the_recomputed_last_token() -> None:
    s = CacheSurvival(slack_tokens=16)
    for _ in range(100):
        s.observe("w", [(0, 1000, 5_000.0)], cached_units=999 - 15)
    assert s.survival("w", 5_000.0) == 1.0
    # In character units (4 characters a token), 16 tokens are 64 units.
    text = CacheSurvival(slack_tokens=16)
    for _ in range(100):
        text.observe("w", [(0, 1000, 5_000.0)], cached_units=940, tokens_per_unit=0.25)
    assert text.survival("w", 5_000.0) == 1.0


def test_a_curve_that_fell_recovers_when_answers_say_the_entries_are_there() -> None:
    s = CacheSurvival()
    for _ in range(100):
        s.observe("w", [(0, 100, 10_000.0)], cached_units=0)
    assert s.survival("w", 10_000.0) < 0.1
    for _ in range(100):
        s.observe("w", [(0, 100, 10_000.0)], cached_units=100)
    assert s.survival("w", 10_000.0) > 0.9


def test_entries_that_never_survive_fall_to_the_priors_floor_and_one_miss_does_not() -> None:
    s = CacheSurvival()
    s.observe("w", [(0, 1000, 20_000.0)], cached_units=0)
    # One miss: the octave's share halves (one pseudo-answer of trust), still counted whole.
    assert s.survival("w", 20_000.0) == pytest.approx(0.5)
    assert s.expected("w", [(0, 1000, 20_000.0)], whole_from=0.2) == 1000
    for _ in range(300):  # a cycle larger than the cache: nothing comes back
        s.observe("w", [(0, 1000, 20_000.0)], cached_units=0)
    floor = 1.0 / (1.0 + 1.0 / (1.0 - 0.97))
    assert s.survival("w", 20_000.0) == pytest.approx(floor, rel=0.01)
    assert s.expected("w", [(0, 1000, 20_000.0)], whole_from=0.2) < 30  # of 1,000 believed


def test_bad_answers_teach_nothing_and_bad_settings_are_refused() -> None:
    s = CacheSurvival()
    for bad in (-1.0, math.nan, math.inf):
        s.observe("w", [(0, 100, 10_000.0)], cached_units=bad)
    s.observe("w", [], cached_units=0)
    assert s.answers == 0
    assert s.curve("w") == (1.0,) * BUCKETS
    with pytest.raises(ValueError, match="memory"):
        CacheSurvival(memory=1.0)
    with pytest.raises(ValueError, match="prior"):
        CacheSurvival(prior=0.0)


# -- the index's ages -------------------------------------------------------------------------
def test_segments_carry_each_workers_age_of_each_part() -> None:
    index = PrefixIndex()
    index.insert(ids(100), A, now_ms=0)
    index.insert(ids(50) + ids(50, 500), B, now_ms=1_000)
    index.insert(ids(30), A, now_ms=2_000)  # refreshes A's first 30 units
    segments = index.match_segments(ids(100), now_ms=3_000)
    assert segments[A] == [(0, 30, 1_000.0), (30, 100, 3_000.0)]  # same age: one run
    assert segments[B] == [(0, 50, 2_000.0)]
    _, matched = index.match(ids(100))
    assert {w: runs[-1][1] for w, runs in segments.items()} == matched


# -- the router -------------------------------------------------------------------------------
def _teach(router: Router, prompt: tuple[int, ...], found: int, at_ms: float, n: int) -> None:
    """``n`` requests for ``prompt`` sent to A, which answers that it found ``found`` tokens."""
    for i in range(n):
        now = at_ms + i
        router.index.insert(prompt, A, now_ms=now - 60_000)  # the index: sent a minute ago
        d = router.route(req(f"t{at_ms}-{i}", prompt), [WorkerStatus(A)], now_ms=now)
        router.complete(d, Outcome(True, 100.0, 50.0, output_tokens=4, cached_tokens=found))


def test_lbgr_stops_chasing_prefixes_the_worker_says_it_evicted() -> None:
    router = Router(make_policy("lbgr", random.Random(0)))
    prompt = ids(2000)
    router.index.insert(prompt, A, now_ms=0)
    first = router.decide(req("x", prompt), BOTH, now_ms=60_000)
    assert (first.chosen, first.candidate(A).cached) == (A, 2000)  # believed: it goes to A
    _teach(router, prompt, found=0, at_ms=100_000, n=60)  # A keeps nothing a minute old
    router.index.insert(prompt, A, now_ms=200_000)
    later = router.decide(req("y", prompt), BOTH, now_ms=260_000)
    cand = later.candidate(A)
    assert cand.index_cached == 2000
    assert cand.cached < 200
    assert later.to_dict()["candidates"][0]["index_cached"] == 2000
    assert router.survival.horizon_ms(A) is not None
    # What was sent a moment ago still counts whole.
    router.index.insert(prompt, A, now_ms=300_000)
    fresh = router.decide(req("z", prompt), BOTH, now_ms=300_050)
    assert fresh.candidate(A).cached == 2000
    assert fresh.chosen == A


def test_answers_that_confirm_the_index_keep_it_whole() -> None:
    router = Router(make_policy("lbgr", random.Random(0)))
    prompt = ids(2000)
    _teach(router, prompt, found=1999, at_ms=100_000, n=60)
    router.index.insert(prompt, A, now_ms=200_000)
    assert router.decide(req("y", prompt), BOTH, now_ms=260_000).candidate(A).cached == 2000


def test_the_paper_and_sglang_routers_use_the_index_as_it_is() -> None:
    for name in ("lbgr_paper", "cache_aware"):
        router = Router(make_policy(name, random.Random(0)))
        prompt = ids(2000)
        _teach(router, prompt, found=0, at_ms=100_000, n=60)
        router.index.insert(prompt, A, now_ms=200_000)
        decision = router.decide(req("y", prompt), BOTH, now_ms=260_000)
        assert decision.candidate(A).cached == 2000, name
    off = make_policy("lbgr", random.Random(0), learn_cache=False)
    assert not Router(off).learns_cache
    with pytest.raises(ValueError, match="learn_cache"):
        make_policy("lbgr", random.Random(0), learn_cache="yes")


def test_a_text_prompts_found_tokens_are_scaled_by_the_prompts_own_count() -> None:
    """A text prompt is matched in characters; the answer counts tokens. With the prompt's
    token count in the answer, a full hit covers the whole belief whatever the characters
    per token (here 2.5, not the 4 the router guesses without it)."""
    router = Router(make_policy("lbgr", random.Random(0)))
    text = "x" * 1000  # 400 tokens
    for i in range(40):
        router.index.insert(text, A, now_ms=i * 1000.0 - 60_000)
        d = router.route(RouteRequest(f"t{i}", text), [WorkerStatus(A)], now_ms=i * 1000.0)
        router.complete(d, Outcome(True, 100.0, 50.0, cached_tokens=399, prompt_tokens=400))
    assert router.survival.survival(A, 60_000.0) == 1.0
    # Without the answer's count the router's own guess converts: told 500 tokens (2
    # characters a token), it reads 399 tokens as 798 of the 1,000 characters found.
    short = Router(make_policy("lbgr", random.Random(0)))
    for i in range(40):
        short.index.insert(text, A, now_ms=i * 1000.0 - 60_000)
        req = RouteRequest(f"s{i}", text, prompt_tokens=500)  # the router's guess: 2 a token
        d = short.route(req, [WorkerStatus(A)], now_ms=i * 1000.0)
        short.complete(d, Outcome(True, 100.0, 50.0, cached_tokens=399))
    assert short.survival.survival(A, 60_000.0) == pytest.approx(0.8, abs=0.05)


def test_answers_without_a_cached_count_and_failures_teach_nothing() -> None:
    router = Router(make_policy("lbgr", random.Random(0)))
    prompt = ids(500)
    router.index.insert(prompt, A, now_ms=0)
    d1 = router.route(req("a", prompt), [WorkerStatus(A)], now_ms=60_000)
    router.complete(d1, Outcome(True, 100.0, 50.0, output_tokens=4))  # no cached count
    d2 = router.route(req("b", prompt), [WorkerStatus(A)], now_ms=60_001)
    router.complete(d2, Outcome(False, status="http_500"))
    assert router.survival.answers == 0
    assert not router._matched_on  # nothing left behind for closed decisions


# -- what an eviction costs -------------------------------------------------------------------
def test_the_refetch_share_is_what_a_worker_prefills_that_it_held_before() -> None:
    s = CacheSurvival()
    assert s.refetch_share("w") == 0.0  # nothing prefilled yet
    s.observe_prefill("w", believed_units=0, cached_units=0, prompt_units=1000)  # new
    s.observe_prefill("w", believed_units=1000, cached_units=0, prompt_units=1000)  # evicted
    assert s.refetch_share("w") == pytest.approx((1000 - 16) / (1000 * 0.99 + 1000))
    # A cache with room finds what the index believes: the share decays towards 0.
    for _ in range(500):
        s.observe_prefill("w", believed_units=900, cached_units=899, prompt_units=1000)
    assert s.refetch_share("w") < 0.01
    assert s.view("w")["refetch_share"] == round(s.refetch_share("w"), 3)
    s.observe_prefill("w", believed_units=math.nan, cached_units=0, prompt_units=10)
    s.observe_prefill("w", believed_units=5, cached_units=-1, prompt_units=10)
    assert s.refetch_share("w") < 0.01  # bad counts teach nothing
    s.forget_worker("w")
    assert s.refetch_share("w") == 0.0


def test_lbgr_learns_each_workers_refetch_share_from_its_answers() -> None:
    """A's answers say it no longer held what the router sent it; B's that it did. Only A
    learns a refetch share, and the policy sees it in its snapshot; the paper's LBGR (which
    reads the index as it is) learns none."""
    router = Router(make_policy("lbgr", random.Random(0)))
    for i in range(30):
        for worker, found in ((A, 0), (B, 1999)):
            prompt = ids(2000, start=10_000 * i + (5000 if worker == B else 0))
            router.index.insert(prompt, worker, now_ms=i * 1000.0)
            d = router.route(req(f"{worker}{i}", prompt), [WorkerStatus(worker)], i * 1000.0)
            router.complete(d, Outcome(True, 100.0, 50.0, cached_tokens=found))
    assert router.survival.refetch_share(A) > 0.9
    assert router.survival.refetch_share(B) == 0.0
    shares = {s.url: s.refetch_share for s in router.snapshots(req("q", ids(10)), BOTH)}
    assert shares[A] == router.survival.refetch_share(A)
    assert shares[B] == 0.0
    assert not router._matched_on  # nothing left behind for closed decisions
    paper = Router(make_policy("lbgr_paper", random.Random(0)))
    paper.index.insert(ids(2000), A, now_ms=0)
    d = paper.route(req("p", ids(2000)), [WorkerStatus(A)], now_ms=1000)
    paper.complete(d, Outcome(True, 100.0, 50.0, cached_tokens=0))
    assert paper.survival.refetch_share(A) == 0.0


def test_a_removed_worker_forgets_its_curve() -> None:
    router = Router(make_policy("lbgr", random.Random(0)))
    _teach(router, ids(300), found=0, at_ms=100_000, n=20)
    assert router.survival.horizon_ms(A) is not None
    router.remove_worker(A)
    assert router.survival.horizon_ms(A) is None
