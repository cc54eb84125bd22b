"""lbgr's default: the service estimate on the router's ledger of requests in flight.

The ledger counts what each worker still holds (prefill backlog, KV, requests) until the
request completes; the estimate turns it into time to first token plus decode time, and the
impact term prices what a request's prefill costs the requests already in the worker.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from router_service.routing import (
    LBGRPolicy,
    Outcome,
    Router,
    RouteRequest,
    WorkerSnapshot,
    WorkerStatus,
    make_policy,
)
from router_service.routing.ledger import Ledger, OutputEstimate, attention_pairs

A, B = "http://a", "http://b"
BOTH = [WorkerStatus(A), WorkerStatus(B)]


def lbgr(**params: object) -> LBGRPolicy:
    params.setdefault("model", "none")  # the estimate alone, unless a test says otherwise
    policy = make_policy("lbgr", random.Random(0), **params)
    assert isinstance(policy, LBGRPolicy)
    return policy


def ids(n: int, start: int = 0) -> str:
    """A prompt of ``n`` token ids (the router's key for ``input_ids``)."""
    return "".join(chr(0x100 + start + i) for i in range(n))


def req(rid: str, prompt: str, max_new: int | None) -> RouteRequest:
    return RouteRequest(rid, prompt, prompt_tokens=len(prompt), max_new_tokens=max_new)


def snap(url: str, **fields: float) -> WorkerSnapshot:
    values: dict[str, float] = {"queue_ms": 0.0, "in_flight": 0, "cached": 0, "index_units": 0}
    values.update(fields)
    return WorkerSnapshot(url, True, None, **values)  # type: ignore[arg-type]


# -- the ledger -------------------------------------------------------------------------------
def test_the_ledger_counts_a_request_until_it_completes() -> None:
    ledger = Ledger()
    ledger.open("r1", A, uncached=600, prompt_tokens=1000, max_new_tokens=100)
    ledger.open("r2", A, uncached=1000, prompt_tokens=1000, max_new_tokens=300)
    assert ledger.in_flight[A] == 2
    assert ledger.prefill_tokens[A] == 1600
    assert ledger.prefill_pairs[A] == attention_pairs(400, 600) + attention_pairs(0, 1000)
    assert ledger.kv_tokens[A] == 1100 + 1300
    ledger.first_token("r1")
    ledger.first_token("r1")  # twice changes nothing
    assert ledger.prefill_tokens[A] == 1000
    assert ledger.close("r2") == A  # no first token seen: its prefill leaves now
    assert ledger.close("r2") is None  # and only once
    assert (ledger.prefill_tokens[A], ledger.kv_tokens[A], ledger.in_flight[A]) == (0, 1100, 1)
    assert ledger.drop_worker(A) == ["r1"]
    assert A not in ledger.kv_tokens


def test_the_ledger_keeps_the_prefill_done_lately_as_a_rate() -> None:
    ledger = Ledger(recent_window_ms=2000.0)
    ledger.open("r1", A, uncached=600, prompt_tokens=1000, max_new_tokens=100, now_ms=0.0)
    assert ledger.recent_prefill(A, 0.0) == (0.0, 0.0)  # still queued: not done yet
    ledger.first_token("r1")
    tokens, pairs = ledger.recent_prefill(A, 0.0)
    assert tokens == pytest.approx(600 / 2000)  # prefill tokens per ms over the window
    assert pairs == pytest.approx(attention_pairs(400, 600) / 2000)
    # It fades with the routing time: done or not, the request was routed then.
    ledger.close("r1")
    assert ledger.recent_prefill(A, 2000.0)[0] == pytest.approx(600 / 2000 * math.exp(-1))
    ledger.open("r2", A, uncached=1000, prompt_tokens=1000, max_new_tokens=1, now_ms=2000.0)
    assert ledger.recent_prefill(A, 2000.0)[0] == pytest.approx(600 / math.e / 2000)
    ledger.close("r2")
    assert ledger.recent_prefill(A, 2000.0)[0] == pytest.approx((600 / math.e + 1000) / 2000)
    assert ledger.recent_prefill(A, 1000.0)[0] == ledger.recent_prefill(A, 2000.0)[0]
    ledger.open("r3", B, uncached=500, prompt_tokens=500, max_new_tokens=1)  # no time: uncounted
    ledger.close("r3")
    assert ledger.recent_prefill(B, 0.0) == (0.0, 0.0)
    ledger.drop_worker(A)
    assert ledger.recent_prefill(A, 2000.0) == (0.0, 0.0)
    with pytest.raises(ValueError, match="recent_window_ms"):
        Ledger(recent_window_ms=0.0)
    with pytest.raises(ValueError, match="time_scale"):
        Ledger(time_scale=-1.0)
    # Emulated workers 10x faster than the clock: the window is 2 s of theirs, 0.2 s of it.
    fast = Ledger(recent_window_ms=2000.0, time_scale=10.0)
    fast.open("f", A, uncached=600, prompt_tokens=600, max_new_tokens=1, now_ms=0.0)
    fast.close("f")
    assert fast.recent_prefill(A, 200.0)[0] == pytest.approx(600 / 2000 * math.exp(-1))
    # The router's snapshots carry it, at the router's clock.
    router = Router(lbgr())
    first = router.route(req("s1", ids(2000), 4), [WorkerStatus(A)], now_ms=0.0)
    router.first_token(first.decision_id, 10.0)
    snapshot = router.snapshots(req("s2", ids(10, 5000), 4), [WorkerStatus(A)])[0]
    assert snapshot.recent_prefill_tokens == pytest.approx(2000 / router.ledger.recent_window_ms)


def test_text_prompts_count_tokens_at_four_characters_each() -> None:
    router = Router(lbgr())
    text = RouteRequest("t1", "x" * 4000, max_new_tokens=10)  # no token count: text
    assert text.tokens_per_unit == 0.25
    decision = router.route(text, [WorkerStatus(A)], now_ms=0)
    assert router.ledger.prefill_tokens[A] == 1000
    assert router.ledger.kv_tokens[A] == 1010
    assert decision.candidate(A).uncached == 4000  # the breakdown keeps routing units


def test_output_lengths_are_learned_from_completions() -> None:
    estimate = OutputEstimate(weight=0.1)
    assert estimate.expected(500) == 500  # a cap taken at its word until told otherwise
    for _ in range(100):
        estimate.observe(500, 50)  # clients ask for 500, get 50
        estimate.observe(None, 80)
    assert estimate.expected(500) == pytest.approx(50, rel=0.01)
    assert estimate.expected(None) == pytest.approx(65, rel=0.05)
    # The router feeds it: outcomes carry the tokens generated.
    router = Router(lbgr())
    for i in range(300):
        d = router.route(req(f"r{i}", ids(10, i), 1000), [WorkerStatus(A)], now_ms=i)
        router.complete(d, Outcome(True, 100.0, 10.0, output_tokens=100))
    assert router.expected_output_tokens(req("x", ids(10), 1000)) == pytest.approx(100, rel=0.05)


# -- the estimate -----------------------------------------------------------------------------
def test_the_estimate_is_time_to_first_token_plus_decode() -> None:
    policy = lbgr(impact=0.0)
    p, a = policy.prefill_ms_per_token, policy.attention_ms_per_pair
    d0, dkv, dseq = policy.decode_step_ms, policy.decode_ms_per_kv_token, policy.decode_ms_per_seq
    request = req("r", ids(1000), 50)
    worker = snap(
        A,
        cached=400,
        prefill_tokens=2000,
        prefill_pairs=1e6,
        kv_tokens=8000,
        in_flight=3,
        output_tokens=50,
    )
    cand = policy.decide(request, [worker]).candidate(A)
    own = p * 600 + a * attention_pairs(400, 600) + 50 * (d0 + dkv * (1000 + 25) + dseq)
    wait = p * 2000 + a * 1e6 + 50 * (dkv * 8000 + dseq * 3)
    assert cand.base_ms == pytest.approx(own)
    assert cand.queue_ms == pytest.approx(wait)
    assert cand.predicted_ms == pytest.approx(own + wait)
    assert (cand.impact_ms, cand.cost_ms) == (0.0, pytest.approx(own + wait))


def test_prefill_routed_lately_stalls_the_decode_as_one_over_one_less_its_share() -> None:
    """SGLang runs prefill first: a worker that spends the share rho of its time prefilling
    what keeps arriving decodes at 1 - rho of its pace. ``stall`` weighs it (1, 0: off)."""
    p, a = 0.1, 1e-6
    policy = lbgr(impact=0.0, prefill_ms_per_token=p, attention_ms_per_pair=a)  # stall 1
    d0, dkv, dseq = policy.decode_step_ms, policy.decode_ms_per_kv_token, policy.decode_ms_per_seq
    request = req("r", ids(1000), 50)
    rate = {"recent_prefill_tokens": 2.0, "recent_prefill_pairs": 1e5}  # rho 0.2 + 0.1
    worker = snap(A, kv_tokens=8000, in_flight=3, output_tokens=50, **rate)
    rho = p * 2.0 + a * 1e5
    step = d0 + dkv * (1000 + 8000) + dseq * 4
    decode = 50 * (step + dkv * 25)
    off = lbgr(impact=0.0, stall=0.0, prefill_ms_per_token=p, attention_ms_per_pair=a)
    plain = off.decide(request, [worker]).candidate(A)
    stalled = policy.decide(request, [worker]).candidate(A)
    assert stalled.queue_ms - plain.queue_ms == pytest.approx(decode * rho / (1 - rho))
    assert stalled.base_ms == plain.base_ms  # its own prefill is not stalled: FCFS
    # A worker prefilling all the time stalls a decode 10x at most.
    flooded = replace(worker, recent_prefill_tokens=50.0)
    capped = policy.decide(request, [flooded]).candidate(A)
    assert capped.queue_ms - plain.queue_ms == pytest.approx(9 * decode)
    # So a long answer leaves the worker that prefills a lot for the one that does not...
    quiet = snap(B, kv_tokens=8000, in_flight=3, output_tokens=50)
    assert policy.decide(request, [worker, quiet]).chosen == B
    # Off, a worker's recent prefill is not priced.
    assert off.decide(request, [worker, quiet]).candidate(A).queue_ms == pytest.approx(
        off.decide(request, [worker, quiet]).candidate(B).queue_ms
    )


def test_a_long_answer_avoids_the_worker_busy_decoding_and_a_short_one_takes_its_cache() -> None:
    """The collapse the paper's estimate had on long answers: it prices prompt tokens only,
    so a worker decoding many long answers looked as free as an idle one. The service
    estimate counts them."""
    policy = lbgr()
    prompt = ids(4000)
    busy = snap(B, in_flight=40, kv_tokens=120_000)
    light = snap(A, in_flight=10, kv_tokens=30_000)
    long_answer = req("long", prompt, 500)
    workers = [replace(w, output_tokens=500.0) for w in (busy, light)]
    assert policy.decide(long_answer, workers).chosen == A
    paper = make_policy("lbgr_paper", random.Random(0))
    assert paper.decide(long_answer, workers).chosen == B  # a tie for it: the first wins
    # A short answer whose prompt the busy worker caches takes the cache: 4 decode steps in
    # a slow batch cost less than prefilling 3,500 tokens again (and stalling 10 others).
    short_answer = req("short", prompt, 4)
    workers = [replace(w, output_tokens=4.0) for w in (replace(busy, cached=3500), light)]
    assert policy.decide(short_answer, workers).chosen == B


def test_the_prefill_backlog_counts_until_the_first_token() -> None:
    router = Router(lbgr())
    big = req("big", ids(8000), 4)
    first = router.route(big, BOTH, now_ms=0)
    other = B if first.chosen == A else A
    # While the big prefill is pending on its worker, the next request goes to the other.
    assert router.route(req("n1", ids(500, 9000), 4), BOTH, now_ms=1).chosen == other
    router.first_token(first.decision_id)
    assert router.ledger.prefill_tokens[first.chosen] == 0


def test_a_miss_costs_the_requests_in_the_worker_and_those_to_come() -> None:
    policy = lbgr()
    p, a = policy.prefill_ms_per_token, policy.attention_ms_per_pair
    request = req("r", ids(4000), 4)
    idle = [replace(w, output_tokens=4.0) for w in (snap(A), snap(B))]
    assert policy.decide(request, idle).candidate(A).impact_ms == 0.0  # nobody waits
    # The cached worker has six requests in it and 4,000 tokens to prefill; the other is
    # idle. Greedy on its own latency, the request takes the idle worker and prefills its
    # 4,000 tokens again there; priced, that prefill holds up as many requests as a worker
    # of the fleet holds on average (three), more than the hit's shorter one holds up six.
    hit = snap(A, cached=3000, in_flight=6, prefill_tokens=4000)
    miss = snap(B)
    workers = [replace(w, output_tokens=4.0) for w in (hit, miss)]
    greedy = lbgr(impact=0.0).decide(request, workers)
    priced = policy.decide(request, workers)
    assert greedy.chosen == B
    assert priced.chosen == A
    miss_prefill = p * 4000 + a * attention_pairs(0, 4000)
    hit_prefill = p * 1000 + a * attention_pairs(3000, 1000)
    assert priced.candidate(B).impact_ms == pytest.approx(miss_prefill * (0 + 3))
    assert priced.candidate(A).impact_ms == pytest.approx(hit_prefill * (6 + 3))


def test_an_insert_costs_the_prefill_of_what_it_evicts_that_comes_back() -> None:
    """A worker holds the request's prompt but has a prefill backlog; greedy on the request's
    latency and its stall, a copy on the idle worker wins. Where caches are full of entries
    that come back (half of what the workers prefill they had held before), the copy pushes
    out as much for later requests to prefill again: the request waits for the holder. What
    no worker holds is inserted wherever it goes, and costs every worker the same: nothing."""
    policy = lbgr()
    p, a = policy.prefill_ms_per_token, policy.attention_ms_per_pair
    request = req("r", ids(4000), 4)
    holder = snap(A, cached=3500, in_flight=1, prefill_tokens=6000)
    idle = snap(B)
    room = [replace(w, output_tokens=4.0) for w in (holder, idle)]
    assert policy.decide(request, room).chosen == B
    assert policy.decide(request, room).candidate(B).evict_ms == 0.0  # nothing comes back
    full = [replace(w, refetch_share=0.5) for w in room]
    decision = policy.decide(request, full)
    assert decision.chosen == A
    miss = p * 4000 + a * attention_pairs(0, 4000)
    copy = policy.evict * 0.5 * p * 3500  # the 3,500 tokens A holds, stored twice
    assert decision.candidate(B).evict_ms == pytest.approx(copy)
    assert decision.candidate(A).evict_ms == 0.0
    fleet = 0.5  # one request in flight over two workers
    assert decision.candidate(B).impact_ms == pytest.approx(miss * fleet + copy)
    assert decision.to_dict()["candidates"][1]["evict_ms"] == pytest.approx(copy)
    unheld = [replace(w, cached=0) for w in full]
    assert {c.evict_ms for c in policy.decide(request, unheld).candidates} == {0.0}
    assert lbgr(evict=0.0).decide(request, full).chosen == B  # the weight turns it off
    with pytest.raises(ValueError, match="evict"):
        lbgr(evict="much")


def test_load_the_router_did_not_send_counts_as_its_own() -> None:
    router = Router(lbgr())
    request = req("r", ids(1000), 300)
    statuses = [WorkerStatus(A, other_requests=30, other_kv_tokens=90_000), WorkerStatus(B)]
    decision = router.route(request, statuses, now_ms=0)
    assert decision.chosen == B
    assert decision.candidate(A).queue_ms > decision.candidate(B).queue_ms


def test_idle_workers_tie_and_the_tie_goes_to_any_of_them() -> None:
    # Nothing cached and nobody busy: the four cost the same. Kept by the first in the list,
    # every new prefix of an idle fleet went there until its cache overflowed.
    workers = [snap(f"http://w{i}") for i in range(4)]
    policy = lbgr()
    chosen = [policy.decide(req(f"r{n}", ids(1000), 4), workers).chosen for n in range(400)]
    counts = {w.url: chosen.count(w.url) for w in workers}
    assert all(70 <= c <= 130 for c in counts.values()), counts  # 100 each on the mean
    decision = policy.decide(req("r", ids(1000), 4), workers)
    assert [c.worker for c in decision.candidates] == [w.url for w in workers]  # in order


def test_a_tie_is_within_the_margin_of_the_lowest_cost() -> None:
    # b and c are within 1 ms of a, d is not: only a, b and c are ever chosen.
    workers = [
        snap(A),
        snap(B, prefill_tokens=4.0),  # 0.46 ms more
        snap("http://c", prefill_tokens=8.0),  # 0.91 ms more
        snap("http://d", prefill_tokens=10.0),  # 1.14 ms more
    ]
    policy = lbgr()
    chosen = {policy.decide(req(f"r{n}", ids(1000), 4), workers).chosen for n in range(200)}
    assert chosen == {A, B, "http://c"}
    costs = [c.cost_ms for c in policy.decide(req("r", ids(1000), 4), workers).candidates]
    assert [round(x - costs[0], 2) for x in costs] == [0.0, 0.46, 0.91, 1.14]
    # The paper's rule: the incumbent, the first in the list, keeps what is within the margin.
    paper = lbgr(ties="first")
    assert {paper.decide(req(f"r{n}", ids(1000), 4), workers).chosen for n in range(50)} == {A}
    assert make_policy("lbgr_paper", random.Random(0)).ties == "first"  # type: ignore[attr-defined]


def test_ties_are_seeded() -> None:
    workers = [snap(f"http://w{i}") for i in range(4)]

    def run() -> list[str]:
        policy = lbgr()
        return [policy.decide(req(f"r{n}", ids(100), 4), workers).chosen for n in range(50)]

    assert run() == run()


@pytest.mark.parametrize(
    "bad",
    [
        {"estimate": "guess"},
        {"prefill_ms_per_token": -1.0},
        {"impact": "2"},
        {"ties": "last"},
        {"stall": -1.0},
    ],
)
def test_bad_parameters_are_refused_naming_them(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        make_policy("lbgr", random.Random(0), **bad)


def estimate_at(policy: LBGRPolicy, worker: WorkerSnapshot, prompt: int, output: float) -> float:
    """The service estimate by hand (nothing cached) for ``output`` tokens on ``worker``."""
    p, a = policy.prefill_ms_per_token, policy.attention_ms_per_pair
    d0, dkv, dseq = policy.decode_step_ms, policy.decode_ms_per_kv_token, policy.decode_ms_per_seq
    own = (
        p * prompt
        + a * attention_pairs(0, prompt)
        + output * (d0 + dkv * (prompt + output / 2) + dseq)
    )
    wait = p * worker.prefill_tokens + output * (dkv * worker.kv_tokens + dseq * worker.in_flight)
    return own + policy.alpha * wait


@pytest.mark.parametrize("speed", [1.0, 0.5])
def test_the_residual_learns_the_workers_speed_not_the_indexs_miss(speed: float) -> None:
    """The router believed 800 of the prompt's 1,000 tokens cached on the worker, and the
    worker found none (evicted since). At completion the estimate is made again with the
    prefill of what the worker really found, so ``ratio`` learns the worker's speed, not the
    index's miss: a worker whose copy of a prefix was evicted is not priced as a slow one
    (the index's own correction learns what survives)."""
    policy = lbgr(model="ratio", impact=0.0)
    request = RouteRequest("r", ids(1000), prompt_tokens=1000, max_new_tokens=64)
    worker = replace(snap(A, cached=800, in_flight=2, kv_tokens=3000), output_tokens=64.0)
    decision = policy.decide(request, [worker])
    p, a = policy.prefill_ms_per_token, policy.attention_ms_per_pair
    believed = p * 200 + a * attention_pairs(800, 200)
    missed = estimate_at(policy, worker, 1000, 64)  # nothing cached
    assert decision.candidate(A).predicted_ms == pytest.approx(
        missed - p * 1000 - a * attention_pairs(0, 1000) + believed
    )
    latency = missed / speed
    outcome = Outcome(True, latency, output_tokens=64, cached_tokens=0, prompt_tokens=1000)
    learned = policy.complete(decision, outcome)
    assert learned is not None
    assert learned.estimate_ms == pytest.approx(missed)
    assert learned.residual_target_ms == pytest.approx(latency - missed)
    factor = policy.models.champion._models[A].factor
    assert factor == pytest.approx(1 / speed, rel=0.05)
    # A worker that says nothing of its cache leaves the estimate made at routing time.
    blind = lbgr(model="ratio", impact=0.0)
    first = blind.decide(request, [worker])
    learned = blind.complete(first, Outcome(True, latency, output_tokens=64))
    assert learned is not None
    assert learned.estimate_ms == pytest.approx(first.candidate(A).predicted_ms)


@pytest.mark.parametrize("speed", [1.0, 0.5])
def test_the_residual_learns_the_workers_speed_not_the_answers_unknown_length(
    speed: float,
) -> None:
    """A client that sends no max_new_tokens: the router expects the mean answer (256 tokens)
    and the answer runs 1,024. At completion the estimate is made again with the 1,024, so
    ``ratio`` learns the worker's speed (1 on a worker as fast as the prior, 2 at half speed),
    not 1,024 / 256: a worker that just served long answers is not priced as a slow one."""
    policy = lbgr(model="ratio", impact=0.0)
    request = RouteRequest("r", ids(1000), prompt_tokens=1000, max_new_tokens=None)
    worker = replace(snap(A, in_flight=2, kv_tokens=3000, prefill_tokens=500), output_tokens=256.0)
    decision = policy.decide(request, [worker])
    assert decision.candidate(A).predicted_ms == pytest.approx(
        estimate_at(policy, worker, 1000, 256)
    )
    latency = estimate_at(policy, worker, 1000, 1024) / speed
    learned = policy.complete(decision, Outcome(True, latency, output_tokens=1024))
    assert learned is not None
    assert learned.residual_target_ms == pytest.approx(
        latency - estimate_at(policy, worker, 1000, 1024)
    )
    again = policy.decide(replace(request, request_id="r2"), [worker]).candidate(A)
    assert again.predicted_ms == pytest.approx(
        estimate_at(policy, worker, 1000, 256) / speed, rel=1e-4
    )
    # Without the answer's length the estimate made at routing time is all there is.
    blind = lbgr(model="ratio", impact=0.0)
    first = blind.decide(request, [worker])
    blind.complete(first, Outcome(True, latency))
    factor = latency / estimate_at(blind, worker, 1000, 256)
    assert blind.decide(request, [worker]).candidate(A).predicted_ms == pytest.approx(
        factor * estimate_at(blind, worker, 1000, 256), rel=1e-4
    )
