"""The Router facade: snapshots from the prefix index, commit/complete bookkeeping, swaps."""

from __future__ import annotations

import random

import pytest

from router_service.routing import (
    IndexSettings,
    Outcome,
    Router,
    RouteRequest,
    WorkerStatus,
    make_policy,
)
from router_service.routing.policies import RoundRobinPolicy

W0, W1 = "http://w0", "http://w1"
STATUSES = [WorkerStatus(W0, queue_ms=12.5), WorkerStatus(W1, healthy=False, reason="down")]
BOTH_UP = [WorkerStatus(W0), WorkerStatus(W1)]


def req(key: str, rid: str) -> RouteRequest:
    return RouteRequest(rid, key)


def test_snapshots_fill_cached_and_index_units_from_the_prefix_index() -> None:
    router = Router(make_policy("round_robin"))
    router.route(req("abcdef", "r1"), BOTH_UP, now_ms=0)  # -> w0
    snaps = router.snapshots(req("abcxyz", "r2"), STATUSES)
    w0, w1 = snaps
    assert (w0.url, w0.cached, w0.index_units, w0.in_flight) == (W0, 3, 6, 1)
    assert (w0.healthy, w0.reason, w0.queue_ms) == (True, None, 12.5)
    assert (w1.url, w1.cached, w1.index_units, w1.in_flight) == (W1, 0, 0, 0)
    assert (w1.healthy, w1.reason) == (False, "down")


def test_decide_changes_nothing_and_commit_records_the_decision() -> None:
    router = Router(make_policy("round_robin"))
    request = req("abcdef", "r1")
    decision = router.decide(request, BOTH_UP)
    assert router.decide(request, BOTH_UP) == decision
    assert router.index.units(W0) == 0
    assert router.in_flight == {}
    router.commit(request, decision, now_ms=0)
    assert router.index.match("abcdef") == (6, {W0: 6})
    assert router.in_flight == {W0: 1}
    assert router.pending_units == {W0: 6}
    second = router.route(req("abcxyz", "r2"), BOTH_UP, now_ms=1)  # round robin -> w1
    assert second.chosen == W1
    third = router.route(req("abcdef", "r3"), BOTH_UP, now_ms=2)  # -> w0, fully cached
    assert third.chosen == W0
    assert router.in_flight == {W0: 2, W1: 1}
    assert router.pending_units == {W0: 6, W1: 6}


def test_complete_decrements_in_flight_and_trains_the_policy() -> None:
    router = Router(make_policy("lbgr_paper", random.Random(0)))
    decision = router.route(req("x" * 100, "r1"), [WorkerStatus(W0)], now_ms=0)
    assert decision.candidate(W0).residual_ms == 0.0
    learned = router.complete(decision, Outcome(True, latency_ms=300.0))
    assert learned is not None
    assert learned.residual_target_ms == 200.0  # 300 - (base 100 + queue 0)
    assert router.in_flight == {W0: 0}
    assert router.pending_units == {W0: 0}
    again = router.decide(req("y" * 100, "r2"), [WorkerStatus(W0)])
    assert again.candidate(W0).residual_ms == pytest.approx(200.0, rel=1e-5)
    # A second completion of the same decision cannot drive counts negative.
    router.complete(decision, Outcome(False))
    assert router.in_flight == {W0: 0}


def test_a_decision_from_a_swapped_out_policy_is_not_fed_to_the_new_one() -> None:
    router = Router(make_policy("round_robin"))
    old = router.route(req("x" * 100, "r1"), [WorkerStatus(W0)], now_ms=0)
    new_policy = make_policy("lbgr", random.Random(0))
    router.set_policy(new_policy)
    assert router.complete(old, Outcome(True, latency_ms=900.0)) is None
    assert router.in_flight == {W0: 0}  # bookkeeping still happens
    fresh = router.decide(req("y" * 100, "r2"), [WorkerStatus(W0)])
    assert fresh.candidate(W0).residual_ms == 0.0  # lbgr learned nothing from it
    # The index survives the swap: the new policy starts warm.
    assert router.snapshots(req("x" * 100, "r3"), [WorkerStatus(W0)])[0].cached == 100


def test_remove_worker_drops_its_index_entries_counts_and_learned_state() -> None:
    router = Router(make_policy("lbgr", random.Random(0)))
    d = router.route(req("abcdef", "r1"), [WorkerStatus(W0)], now_ms=0)
    router.complete(d, Outcome(True, latency_ms=500.0))
    router.route(req("abcdef", "r2"), [WorkerStatus(W0)], now_ms=1)
    router.route(req("abcxyz", "r3"), [WorkerStatus(W1)], now_ms=2)
    router.remove_worker(W0)
    assert router.index.match("abcdef") == (3, {W1: 3})
    assert router.index.units(W0) == 0
    assert W0 not in router.in_flight
    assert W0 not in router.pending_units
    back = router.decide(req("abcdef", "r4"), [WorkerStatus(W0)])
    assert back.candidate(W0).residual_ms == 0.0
    assert back.candidate(W0).cached == 0


class _TinyIndexPolicy(RoundRobinPolicy):
    index_settings = IndexSettings(trim_interval_s=1.0, max_units_per_worker=4)


def test_maybe_trim_runs_on_the_policys_interval_and_cap() -> None:
    router = Router(_TinyIndexPolicy(random.Random(0)))
    router.route(req("aaaa", "r1"), [WorkerStatus(W0)], now_ms=0)
    router.route(req("bbbb", "r2"), [WorkerStatus(W0)], now_ms=10)
    assert router.maybe_trim(now_ms=999) == 0
    assert router.index.units(W0) == 8
    assert router.maybe_trim(now_ms=1_000) == 4  # the older "aaaa" goes
    assert router.index.match("bbbb") == (4, {W0: 4})
    router.route(req("cccc", "r3"), [WorkerStatus(W0)], now_ms=1_100)
    assert router.maybe_trim(now_ms=1_999) == 0  # next trim one interval after the last
    assert router.maybe_trim(now_ms=2_000) == 4
