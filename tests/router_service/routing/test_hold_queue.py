"""The hold queue's rule: affinity, shortest first, no starvation, slots, retries' exclusions."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from router_service.routing import Held, HoldQueue, HoldSettings, PrefixIndex, RouteRequest

W = ["http://w0", "http://w1", "http://w2"]


def request(rid: str, key: str) -> RouteRequest:
    return RouteRequest(rid, key)


class Index:
    """The router's prefix index as the queue sees it: cached units per worker."""

    def __init__(self) -> None:
        self.index = PrefixIndex()

    def match(self, req: RouteRequest) -> Mapping[str, int]:
        return self.index.match(req.key)[1]

    def place(self, req: RouteRequest, worker: str, now_ms: float) -> None:
        self.index.insert(req.key, worker, now_ms)


def queue(**settings: float) -> HoldQueue:
    return HoldQueue(HoldSettings(**{"slots": 1, **settings}))  # type: ignore[arg-type]


def names(picks: list[tuple[Held, str]]) -> list[tuple[str, str]]:
    return [(held.request.request_id, worker) for held, worker in picks]


def test_a_request_waits_for_the_worker_caching_it_while_others_go_anywhere() -> None:
    idx = Index()
    idx.index.insert("SYSTEM-A" * 10 + "q0", W[0], 0.0)
    q = queue()
    q.busy[W[0]] = 1  # w0 is busy
    q.push(Held(request("bound", "SYSTEM-A" * 10 + "q1"), 0.0))
    q.push(Held(request("fresh", "OTHER" * 10), 1.0))
    picks = q.assign(W, 10.0, idx.match, idx.place)
    assert names(picks) == [("fresh", W[1])]  # the least busy free worker, in order
    assert [h.request.request_id for h in q.waiting] == ["bound"]
    q.release(W[0])
    assert names(q.assign(W, 20.0, idx.match, idx.place)) == [("bound", W[0])]


def test_shortest_first_among_what_a_worker_may_take() -> None:
    idx = Index()
    q = queue()
    for rid, length in (("long", 400), ("short", 40), ("mid", 200)):
        q.push(Held(request(rid, rid[0] * length), 0.0))
    picks = q.assign(W, 1.0, idx.match, idx.place)
    assert names(picks) == [("short", W[0]), ("mid", W[1]), ("long", W[2])]
    assert q.busy == {W[0]: 1, W[1]: 1, W[2]: 1}
    assert q.assign(W, 2.0, idx.match, idx.place) == []


def test_uncached_units_rank_requests_so_a_long_cached_prompt_can_go_first() -> None:
    idx = Index()
    idx.index.insert("P" * 900, W[0], 0.0)
    q = queue()
    q.push(Held(request("short-cold", "c" * 100), 0.0))
    q.push(Held(request("long-warm", "P" * 900 + "x" * 50), 0.0))  # 50 uncached on w0
    picks = q.assign(W[:1], 1.0, idx.match, idx.place)
    assert names(picks) == [("long-warm", W[0])]


def test_the_rest_of_a_new_group_follows_its_first_request_in_the_same_pass() -> None:
    idx = Index()
    q = queue()
    group = "G" * 300
    for i in range(3):
        q.push(Held(request(f"g{i}", group + str(i) * 20), 0.0))
    q.push(Held(request("other", "O" * 400), 0.0))
    picks = q.assign(W, 1.0, idx.match, idx.place)
    # g0 is placed first; g1 and g2 are then bound to its worker (busy), so the other free
    # workers take only the unrelated request.
    assert names(picks) == [("g0", W[0]), ("other", W[1])]
    assert sorted(h.request.request_id for h in q.waiting) == ["g1", "g2"]
    assert all(h.bound == frozenset({W[0]}) for h in q.waiting)


def test_a_small_shared_prefix_does_not_bind() -> None:
    idx = Index()
    idx.index.insert("hdr" + "a" * 100, W[0], 0.0)
    q = queue(bind_ratio=0.25)
    q.busy[W[0]] = 1
    q.push(Held(request("r", "hdr" + "b" * 100), 0.0))  # 3 of 103 units cached on w0
    assert names(q.assign(W, 1.0, idx.match, idx.place)) == [("r", W[1])]


def test_after_max_wait_a_request_goes_to_any_worker_oldest_first() -> None:
    idx = Index()
    idx.index.insert("A" * 100, W[0], 0.0)
    q = queue(max_wait_ms=1_000.0)
    q.busy[W[0]] = 1
    q.push(Held(request("old", "A" * 100 + "x"), 0.0))
    q.push(Held(request("new-short", "n"), 900.0))
    assert names(q.assign(W[:2], 500.0, idx.match, idx.place)) == [("new-short", W[1])]
    q.release(W[1])
    q.push(Held(request("newer-short", "m"), 1_100.0))
    picks = q.assign(W[:2], 1_200.0, idx.match, idx.place)
    assert names(picks) == [("old", W[1])]  # it waited 1.2 s: before the shorter one
    assert q.aged == 1


def test_slots_bound_the_requests_in_flight_per_worker() -> None:
    idx = Index()
    q = queue(slots=2)
    for i in range(7):
        q.push(Held(request(f"r{i}", f"{i}" * 10), 0.0))
    picks = q.assign(W, 1.0, idx.match, idx.place)
    assert len(picks) == 6
    assert q.busy == dict.fromkeys(W, 2)
    q.release(W[2])
    assert [w for _, w in q.assign(W, 2.0, idx.match, idx.place)] == [W[2]]


def test_a_retry_never_goes_back_to_a_worker_that_failed_it() -> None:
    idx = Index()
    idx.index.insert("A" * 100, W[0], 0.0)
    q = queue()
    q.push(Held(request("retry", "A" * 100 + "x"), 0.0, avoid=frozenset({W[0]})))
    assert names(q.assign(W[:2], 1.0, idx.match, idx.place)) == [("retry", W[1])]


def test_a_request_bound_to_a_worker_that_went_down_is_matched_again() -> None:
    idx = Index()
    idx.index.insert("A" * 100, W[0], 0.0)
    q = queue()
    q.busy[W[0]] = 1
    q.push(Held(request("r", "A" * 100 + "x"), 0.0))
    assert q.assign(W[:1], 1.0, idx.match, idx.place) == []  # waits for w0
    assert names(q.assign(W[1:], 2.0, idx.match, idx.place)) == [("r", W[1])]  # w0 gone


def test_only_the_window_of_oldest_requests_is_considered() -> None:
    idx = Index()
    q = queue(window=2)
    for rid, length in (("a", 300), ("b", 200), ("c", 10)):
        q.push(Held(request(rid, rid * length), 0.0))
    assert names(q.assign(W[:1], 1.0, idx.match, idx.place)) == [("b", W[0])]


def test_removed_and_released_bookkeeping() -> None:
    q = queue()
    held = Held(request("r", "x"), 0.0)
    q.push(held)
    assert q.remove(held) is True
    assert q.remove(held) is False
    q.release(W[0])  # releasing a free worker never goes negative
    assert q.busy == {}
    assert len(q) == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"slots": -1}, "queue slots must be >= 0"),
        ({"slots": 1, "max_wait_ms": 0.0}, "max wait must be > 0"),
        ({"slots": 1, "window": 0}, "window must be >= 1"),
        ({"slots": 1, "bind_ratio": 0.0}, "bind ratio must be in"),
    ],
)
def test_bad_settings_are_refused_by_name(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HoldSettings(**settings)  # type: ignore[arg-type]


def test_a_queue_needs_slots() -> None:
    with pytest.raises(ValueError, match="slots >= 1"):
        HoldQueue(HoldSettings())
