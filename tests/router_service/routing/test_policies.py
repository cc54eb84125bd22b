"""Routing policies: every branch of their rules (docs/design.md), with hand-picked snapshots."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router_service.routing import (
    CACHE_AWARE_PRESETS,
    Decision,
    NoEligibleWorker,
    Outcome,
    RouteRequest,
    WorkerSnapshot,
    make_policy,
    policy_names,
    register_policy,
)
from router_service.routing import policy as policy_module
from router_service.routing.policies import CacheAwarePolicy, LBGRPolicy, RoundRobinPolicy


def worker(
    url: str,
    *,
    in_flight: int = 0,
    cached: int = 0,
    index_units: int = 0,
    queue_ms: float = 0.0,
    healthy: bool = True,
    reason: str | None = None,
) -> WorkerSnapshot:
    return WorkerSnapshot(url, healthy, reason, queue_ms, in_flight, cached, index_units)


def request(units: int = 100, rid: str = "r1") -> RouteRequest:
    return RouteRequest(rid, "x" * units)


def cache_aware(preset: str) -> CacheAwarePolicy:
    policy = make_policy("cache_aware", random.Random(0), preset=preset)
    assert isinstance(policy, CacheAwarePolicy)
    return policy


# -- registry ---------------------------------------------------------------------------------
def test_builtin_policies_are_registered() -> None:
    assert set(policy_names()) >= {"random", "round_robin", "power_of_two", "cache_aware", "lbgr"}


def test_registry_refuses_blank_and_duplicate_names(monkeypatch: pytest.MonkeyPatch) -> None:
    policy_names()  # load the built-ins first
    monkeypatch.setattr(
        policy_module.REGISTRY, "_factories", dict(policy_module.REGISTRY._factories)
    )
    for blank in ("", "  "):
        with pytest.raises(ValueError, match="blank"):
            register_policy(blank, RoundRobinPolicy)
    with pytest.raises(ValueError, match="already registered"):
        register_policy("random", RoundRobinPolicy)
    register_policy("my_rr", RoundRobinPolicy)
    assert make_policy("my_rr").name == "round_robin"


def test_a_policy_registered_before_the_first_lookup_does_not_hide_the_builtins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bug: the registry loaded its built-ins only while empty, so a plugin registered
    first hid them (make_policy("round_robin") failed with "known: my_rr")."""
    import kvroute.registry

    monkeypatch.setattr(policy_module.REGISTRY, "_factories", {})
    monkeypatch.setattr(policy_module.REGISTRY, "_loaded", False)
    monkeypatch.setattr(kvroute.registry, "entry_points", lambda group: [])
    register_policy("my_rr", RoundRobinPolicy)
    assert make_policy("round_robin").name == "round_robin"
    assert {"my_rr", "round_robin", "lbgr", "lbgr_paper"} <= set(policy_names())


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'; known: ") as info:
        make_policy("nope")
    for name in ("cache_aware", "lbgr", "power_of_two", "random", "round_robin"):
        assert name in str(info.value)


def test_bad_parameters_fail_with_the_policy_name() -> None:
    with pytest.raises(ValueError, match="bad parameters for policy 'random'"):
        make_policy("random", colour="blue")
    with pytest.raises(ValueError, match="unknown cache_aware preset 'x'; known: sglang, paper"):
        make_policy("cache_aware", preset="x")


# -- eligibility (every policy) ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["random", "round_robin", "power_of_two", "cache_aware", "lbgr"])
def test_unhealthy_workers_are_ineligible_with_their_reason(name: str) -> None:
    policy = make_policy(name, random.Random(1))
    workers = [
        worker("a", healthy=False, reason="health check failed", cached=100),
        worker("b"),
        worker("c", healthy=False),
    ]
    for i in range(20):
        decision = policy.decide(request(rid=f"r{i}"), workers)
        assert decision.chosen == "b"
        by_worker = {c.worker: c for c in decision.candidates}
        assert (by_worker["a"].eligible, by_worker["a"].reason) == (False, "health check failed")
        assert (by_worker["c"].eligible, by_worker["c"].reason) == (False, "unhealthy")
        assert by_worker["b"].eligible
        assert by_worker["b"].reason is None


@pytest.mark.parametrize("name", ["random", "round_robin", "power_of_two", "cache_aware", "lbgr"])
def test_no_eligible_worker_raises(name: str) -> None:
    policy = make_policy(name)
    with pytest.raises(NoEligibleWorker, match="no workers are registered"):
        policy.decide(request(), [])
    with pytest.raises(NoEligibleWorker, match=r"a: draining; b: unhealthy"):
        policy.decide(
            request(), [worker("a", healthy=False, reason="draining"), worker("b", healthy=False)]
        )


# -- random, round_robin, power_of_two ---------------------------------------------------------
def test_random_is_reproducible_side_effect_free_and_covers_every_worker() -> None:
    workers = [worker(u) for u in "abcd"]
    one, two = make_policy("random", random.Random(5)), make_policy("random", random.Random(5))
    picks = [one.decide(request(rid=f"r{i}"), workers).chosen for i in range(400)]
    assert picks == [two.decide(request(rid=f"r{i}"), workers).chosen for i in range(400)]
    assert one.decide(request(rid="r7"), workers).chosen == picks[7]  # same request, same pick
    counts = Counter(picks)
    assert set(counts) == set("abcd")
    assert all(60 < c < 140 for c in counts.values()), counts


def test_round_robin_cycles_and_advances_only_on_commit() -> None:
    policy = make_policy("round_robin")
    workers = [worker(u) for u in "abc"]
    first = policy.decide(request(), workers)
    assert first.chosen == "a"
    assert policy.decide(request(), workers).chosen == "a"  # decide alone changes nothing
    chosen = []
    for i in range(7):
        decision = policy.decide(request(rid=f"r{i}"), workers)
        policy.commit(decision)
        chosen.append(decision.chosen)
    assert chosen == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_skips_unhealthy_workers() -> None:
    policy = make_policy("round_robin")
    workers = [worker("a"), worker("b", healthy=False), worker("c")]
    chosen = []
    for _ in range(4):
        decision = policy.decide(request(), workers)
        policy.commit(decision)
        chosen.append(decision.chosen)
    assert chosen == ["a", "c", "a", "c"]


@pytest.mark.parametrize(("loads", "expected"), [((5, 3), "b"), ((3, 5), "a"), ((4, 4), "a")])
def test_power_of_two_keeps_the_lower_in_flight_of_two(
    loads: tuple[int, int], expected: str
) -> None:
    policy = make_policy("power_of_two", random.Random(2))
    workers = [worker("a", in_flight=loads[0]), worker("b", in_flight=loads[1])]
    for i in range(10):
        decision = policy.decide(request(rid=f"r{i}"), workers)
        assert decision.chosen == expected
        assert [c.in_flight for c in decision.candidates] == list(loads)


def test_power_of_two_never_picks_the_busiest_and_samples_pairs_uniformly() -> None:
    policy = make_policy("power_of_two", random.Random(9))
    workers = [worker("a", in_flight=0), worker("b", in_flight=10), worker("c", in_flight=20)]
    counts = Counter(policy.decide(request(rid=f"r{i}"), workers).chosen for i in range(900))
    # Pairs {a,b}, {a,c}, {b,c} equally likely: a wins 2/3 of the time, b 1/3, c never.
    assert counts["c"] == 0
    assert 540 < counts["a"] < 660
    assert counts["a"] + counts["b"] == 900


def test_power_of_two_with_one_healthy_worker_picks_it() -> None:
    policy = make_policy("power_of_two")
    decision = policy.decide(request(), [worker("a", healthy=False), worker("b", in_flight=99)])
    assert decision.chosen == "b"


# -- cache_aware ------------------------------------------------------------------------------
def test_cache_aware_presets() -> None:
    sglang, paper = CACHE_AWARE_PRESETS["sglang"], CACHE_AWARE_PRESETS["paper"]
    assert (sglang.cache_threshold, sglang.balance_abs_threshold) == (0.3, 64)
    assert sglang.balance_rel_threshold == 1.5
    assert (paper.cache_threshold, paper.balance_abs_threshold) == (0.5, 32)
    assert paper.balance_rel_threshold == 1.0001
    # Index trimming: sglang-router 0.3.2 ships 60 s / 2**26 units; the paper's 60 s / 2**24.
    sglang_index, paper_index = (
        cache_aware("sglang").index_settings,
        cache_aware("paper").index_settings,
    )
    assert (sglang_index.trim_interval_s, sglang_index.max_units_per_worker) == (60.0, 2**26)
    assert (paper_index.trim_interval_s, paper_index.max_units_per_worker) == (60.0, 2**24)


@pytest.mark.parametrize(
    ("preset", "loads", "branch", "chosen"),
    [
        # imbalanced on both counts: the least loaded wins despite b's cache
        ("sglang", (100, 10), "balance", "a2"),
        ("paper", (43, 10), "balance", "a2"),
        # the absolute gap exactly at the threshold is not above it
        ("sglang", (74, 10), "cache", "b"),
        ("paper", (42, 10), "cache", "b"),
        # the absolute gap is above, but max is exactly 1.5 x min: not above
        ("sglang", (195, 130), "cache", "b"),
        ("sglang", (196, 130), "balance", "a2"),
    ],
)
def test_cache_aware_balance_branch(
    preset: str, loads: tuple[int, int], branch: str, chosen: str
) -> None:
    busy, idle = loads
    workers = [
        worker("a1", in_flight=busy),
        worker("b", in_flight=busy, cached=90),
        worker("a2", in_flight=idle),
    ]
    decision = cache_aware(preset).decide(request(100), workers)
    assert (decision.branch, decision.chosen) == (branch, chosen)


@pytest.mark.parametrize(
    ("preset", "matched", "branch"),
    [
        ("sglang", 31, "cache"),
        ("sglang", 30, "least_load"),  # 30/100 == 0.3 is not > 0.3; 0.3.x: least loaded
        ("paper", 51, "cache"),
        ("paper", 50, "smallest_tree"),  # 50/100 == 0.5 is not > 0.5
        ("paper", 0, "smallest_tree"),
    ],
)
def test_cache_aware_match_rate_threshold(preset: str, matched: int, branch: str) -> None:
    workers = [
        worker("small", cached=0, index_units=10),
        worker("deep", cached=matched, index_units=500),
        worker("big", cached=matched // 2, index_units=900),
    ]
    decision = cache_aware(preset).decide(request(100), workers)
    assert decision.branch == branch
    # Equal loads: least_load keeps the first worker, which is also the smallest tree.
    assert decision.chosen == ("deep" if branch == "cache" else "small")
    deep = decision.candidate("deep")
    assert (deep.cached, deep.uncached) == (matched, 100 - matched)


def test_cache_aware_ties_keep_the_first_worker() -> None:
    policy = cache_aware("sglang")
    tie_cache = [worker("a", cached=80), worker("b", cached=80)]
    assert policy.decide(request(100), tie_cache).chosen == "a"
    tie_tree = [worker("a", index_units=7), worker("b", index_units=3), worker("c", index_units=3)]
    assert cache_aware("paper").decide(request(100), tie_tree).chosen == "b"
    tie_load = [worker("a", in_flight=7), worker("b", in_flight=3), worker("c", in_flight=3)]
    assert policy.decide(request(100), tie_load).chosen == "b"


def test_cache_aware_considers_only_healthy_workers_for_every_branch() -> None:
    policy = cache_aware("sglang")
    workers = [
        worker("sick", healthy=False, cached=100, index_units=0, in_flight=0),
        worker("a", cached=10, index_units=50, in_flight=6),
        worker("b", cached=0, index_units=40, in_flight=5),
    ]
    decision = policy.decide(request(100), workers)
    assert (decision.branch, decision.chosen) == ("least_load", "b")
    decision = cache_aware("paper").decide(request(100), workers)
    assert (decision.branch, decision.chosen) == ("smallest_tree", "b")


def test_cache_aware_empty_request_goes_to_the_smallest_tree_or_least_load() -> None:
    workers = [worker("a", index_units=5, in_flight=0), worker("b", index_units=1, in_flight=2)]
    decision = cache_aware("paper").decide(request(0), workers)
    assert (decision.branch, decision.chosen) == ("smallest_tree", "b")
    decision = cache_aware("sglang").decide(request(0), workers)
    assert (decision.branch, decision.chosen) == ("least_load", "a")


def test_cache_aware_overrides_and_validation() -> None:
    policy = make_policy("cache_aware", preset="paper", cache_threshold=0.9)
    assert isinstance(policy, CacheAwarePolicy)
    assert policy.cache_threshold == 0.9
    assert policy.balance_abs_threshold == 32
    with pytest.raises(ValueError, match="cache_threshold must be in"):
        make_policy("cache_aware", cache_threshold=1.5)


# -- lbgr_paper: the paper's estimate, exactly ------------------------------------------------
# (lbgr's default service estimate: tests/router_service/routing/test_lbgr_service.py)
def lbgr(**params: object) -> LBGRPolicy:
    policy = make_policy("lbgr_paper", random.Random(0), **params)
    assert isinstance(policy, LBGRPolicy)
    return policy


def test_lbgr_paper_is_the_papers_estimate_and_residual() -> None:
    policy = lbgr()
    assert (policy.name, policy.estimate) == ("lbgr_paper", "paper")
    assert (policy.a_ms, policy.b_cached_ms, policy.b_uncached_ms, policy.alpha) == (
        0.0,
        0.0,
        1000.0,
        1.0,
    )
    model = policy.models.champion._default
    assert (type(model).__name__, model.forgetting, model.p0) == ("EWMeanResidual", 0.992, 1e6)
    default = make_policy("lbgr", random.Random(0))
    assert isinstance(default, LBGRPolicy)
    assert (default.name, default.estimate, default.models.kind_for("w")) == (
        "lbgr",
        "service",
        "ratio",
    )


def test_lbgr_base_ms_formula() -> None:
    default = lbgr()
    assert default.base_ms(cached=700, uncached=300) == 300.0  # 1 ms per uncached unit
    assert default.base_ms(cached=5_000, uncached=0) == 1.0  # floored at 1 ms
    custom = lbgr(a_ms=2.0, b_cached_ms=100.0, b_uncached_ms=500.0)
    assert custom.base_ms(cached=1_000, uncached=2_000) == 2.0 + 100.0 + 1_000.0
    assert lbgr(a_ms=-50.0).base_ms(0, 10) == 1.0


def test_lbgr_picks_the_argmin_of_predicted_latency() -> None:
    workers = [
        worker("a", cached=0, queue_ms=0.0),  # 1000
        worker("b", cached=600, queue_ms=50.0),  # 400 + 50
        worker("c", cached=300, queue_ms=0.0),  # 700
        worker("d", cached=900, queue_ms=400.0),  # 100 + 400
    ]
    decision = lbgr().decide(request(1_000), workers)
    assert decision.chosen == "b"
    assert decision.branch == "argmin"
    assert [c.predicted_ms for c in decision.candidates] == [1_000.0, 450.0, 700.0, 500.0]
    assert [c.base_ms for c in decision.candidates] == [1_000.0, 400.0, 700.0, 100.0]
    assert decision.reserve_ms == 400.0  # the chosen worker's base
    assert decision.model is not None
    assert decision.model.kind == "ewmean"


@pytest.mark.parametrize(
    ("queues", "chosen"),
    [
        ((1.0, 0.0), "a"),  # b is better by exactly 1 ms: the incumbent stays
        ((0.5, 0.0), "a"),  # better by less than 1 ms
        ((1.5, 0.0), "b"),  # better by more than 1 ms
        ((0.0, 0.0), "a"),  # a tie keeps the first
    ],
)
def test_lbgr_a_worker_must_beat_the_incumbent_by_more_than_the_margin(
    queues: tuple[float, float], chosen: str
) -> None:
    workers = [worker("a", queue_ms=queues[0]), worker("b", queue_ms=queues[1])]
    assert lbgr().decide(request(100), workers).chosen == chosen


def test_lbgr_margin_is_measured_against_the_incumbent_not_the_first() -> None:
    # predicted 102, 100.9 (beats a by 1.1: takes over), 100.5 (beats b by only 0.4)
    workers = [worker("a", queue_ms=2.0), worker("b", queue_ms=0.9), worker("c", queue_ms=0.5)]
    assert lbgr().decide(request(100), workers).chosen == "b"
    assert lbgr(margin_ms=0.0).decide(request(100), workers).chosen == "c"


def test_lbgr_learns_the_residual_target_per_worker() -> None:
    policy = lbgr(alpha=0.5)
    workers = [worker("a", cached=0, queue_ms=20.0), worker("b", cached=0, queue_ms=500.0)]
    decision = policy.decide(request(100), workers)
    assert decision.chosen == "a"
    a = decision.candidate("a")
    assert (a.base_ms, a.queue_ms, a.residual_ms, a.predicted_ms) == (100.0, 20.0, 0.0, 110.0)
    # target = max(1, y - (base + alpha * queue)) = 250 - (100 + 0.5 * 20) = 140
    learned = policy.complete(decision, Outcome(True, latency_ms=250.0))
    assert learned is not None
    assert learned.residual_target_ms == 140.0
    assert learned.model_error_ms == 140.0  # the untrained model predicted 0
    after = policy.decide(request(100, rid="r2"), workers).candidate("a")
    assert after.residual_ms == pytest.approx(140.0, rel=1e-5)  # ewmean takes the first whole
    assert after.predicted_ms == pytest.approx(100.0 + 10.0 + 140.0, rel=1e-5)
    assert policy.decide(request(100, rid="r3"), workers).candidate("b").residual_ms == 0.0


def test_lbgr_residual_target_is_floored_at_one_ms() -> None:
    policy = lbgr()
    decision = policy.decide(request(100), [worker("a", queue_ms=30.0)])
    learned = policy.complete(decision, Outcome(True, latency_ms=50.0))  # 50 - 130 < 1
    assert learned is not None
    assert learned.residual_target_ms == 1.0


def residual(policy: LBGRPolicy, url: str = "a") -> float | None:
    return policy.decide(request(100, rid="probe"), [worker(url)]).candidate(url).residual_ms


def test_lbgr_does_not_learn_from_failures_and_forgets_removed_workers() -> None:
    policy = lbgr()
    decision = policy.decide(request(100), [worker("a")])
    assert policy.complete(decision, Outcome(False, status="error")) is None
    assert policy.complete(decision, Outcome(True, latency_ms=None)) is None
    assert residual(policy) == 0.0
    assert policy.complete(decision, Outcome(True, latency_ms=500.0)) is not None
    assert residual(policy) == pytest.approx(400.0, rel=1e-5)
    policy.forget_worker("a")
    assert residual(policy) == 0.0


def test_lbgr_decide_and_commit_learn_nothing() -> None:
    policy = lbgr()
    workers = [worker("a", cached=10), worker("b", cached=50)]
    first = policy.decide(request(100), workers)
    policy.commit(first)
    again = policy.decide(request(100), workers)
    assert first == again
    assert residual(policy) == 0.0


def test_decisions_explain_themselves_with_every_design_field() -> None:
    decision: Decision = lbgr().decide(request(10), [worker("a"), worker("b", healthy=False)])
    data = decision.to_dict()
    assert {"decision_id", "policy", "chosen", "model", "candidates"} <= data.keys()
    fields = {"worker", "cached", "uncached", "base_ms", "queue_ms", "residual_ms"}
    fields |= {"predicted_ms", "eligible", "reason"}
    for cand in data["candidates"]:
        assert fields <= cand.keys()
    assert data["candidates"][1]["base_ms"] is None  # unused fields are present and null
    assert data["model"] == {"kind": "ewmean", "version": 1}
    assert data["policy"] == "lbgr_paper"
