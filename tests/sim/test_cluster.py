"""The cluster simulator: a hand-computed schedule, determinism, and the run's summary."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from contracts import SUMMARY_KEYS

from router_service.routing import HoldSettings, LBGRPolicy, RouteRequest, WorkerStatus
from sim.cluster import ClusterConfig, SimRun, simulate
from sim.profiles import PROFILES, ServiceProfile
from sim.report import markdown_table, summarize
from sim.tokens import ids_to_key
from sim.workloads import GSPConfig, GSPWorkload, WorkloadRequest

HAND = ServiceProfile(
    name="hand",
    kv_capacity_tokens=1_000,
    chunked_prefill_tokens=1_000,
    max_running_requests=64,
    weight_ms=10.0,  # T_w
    kv_read_ms_per_token=0.5,  # beta
    per_seq_ms=1.0,  # b
    prefill_ms_per_token=1.0,  # a
    attn_ms_per_token_pair=0.0,  # c
    step_overhead_ms=2.0,  # o_step
    request_overhead_ms=5.0,  # o_req: arrival -> worker
)


@dataclass
class ListWorkload:
    requests: list[WorkloadRequest] = field(default_factory=list)
    name: str = "hand"

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)


def small_gsp(seed: int = 7, order: str = "random") -> GSPWorkload:
    return GSPWorkload(
        GSPConfig(num_groups=8, prompts_per_group=4, total_lens=(64, 128), order=order, seed=seed)
    )


def test_hand_computed_schedule_gives_exact_latencies_and_hit_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(PROFILES, "hand", HAND)
    p1 = ids_to_key(range(1, 21))  # 20 tokens
    p2 = ids_to_key([*range(1, 11), *range(101, 111)])  # shares its first 10 tokens with p1
    workload = ListWorkload(
        [
            WorkloadRequest("r1", 0.0, p1, max_new_tokens=2),
            WorkloadRequest("r2", 100.0, p2, max_new_tokens=3),
            WorkloadRequest("r3", 110.0, p1, max_new_tokens=1),
        ]
    )
    config = ClusterConfig(workers=1, policy="round_robin", eviction="lru", profile="hand")
    run = simulate(config, workload)
    # Prefill step = max(T_w, a * N_new) + o_step; decode step = T_w + beta * sum(L) + b * B
    # + o_step, where L = prompt + tokens generated so far.
    # r1: arrives 0, reaches the worker at 5. Nothing cached: prefill of 20 tokens,
    #     max(10, 20) + 2 = 22 -> first token at 27. Decode (L = 21, B = 1):
    #     10 + 10.5 + 1 + 2 = 23.5 -> done at 50.5. p1 + 1 output token enter the tree.
    # r2: arrives 100, at the worker 105. 10 tokens cached: prefill of 10,
    #     max(10, 10) + 2 = 12 -> first token at 117.
    # r3: arrives 110, at the worker 115 while r2's prefill runs. At 117, prefill goes
    #     first: all 20 tokens of p1 are cached, but SGLang recomputes the last one:
    #     cached 19, prefill of 1 token, max(10, 1) + 2 = 12 -> first token at 129 and,
    #     with one output token, done at 129.
    # r2 decodes: L = 21 -> 23.5 -> 152.5; L = 22 -> 10 + 11 + 1 + 2 = 24 -> done at 176.5.
    by_id = {r.rid: r for r in run.records}
    times = {rid: (r.ttft_ms, r.latency_ms, r.cached_tokens) for rid, r in by_id.items()}
    assert times == {
        "r1": (27.0, 50.5, 0),
        "r2": (17.0, 76.5, 10),
        "r3": (19.0, 19.0, 19),
    }
    assert run.end_ms == 176.5
    # Hit rate: (0 + 10 + 19) cached of 3 x 20 prompt tokens.
    stats = run.workers[0].cache.stats
    assert (stats.cached_tokens, stats.prompt_tokens) == (29, 60)
    summary = summarize(run)
    assert summary["hit_rate"] == round(29 / 60, 6)
    assert summary["p50_latency_s"] == 0.0505
    assert summary["p50_ttft_s"] == 0.019
    assert summary["throughput_rps"] == round(3 / 0.1765, 4)
    assert summary["per_worker"][0]["busy_s"] == 0.117  # 22 + 23.5 + 12 + 12 + 23.5 + 24
    assert (summary["completed"], summary["failed"]) == (3, 0)


@pytest.mark.parametrize(
    ("last_token", "r2_sent", "r2_done"),
    [(False, 74.5, 149.0), (True, 50.5, 144.0)],
    ids=["free-at-end", "free-at-last-token"],
)
def test_a_slot_freed_at_the_last_token_hands_over_during_the_last_decode_step(
    monkeypatch: pytest.MonkeyPatch, last_token: bool, r2_sent: float, r2_done: float
) -> None:
    """One slot, two unrelated requests at once (HAND profile, 3 output tokens each).
    r1 reaches the worker at 5: prefill 22 -> 27, decode 23.5 -> 50.5, decode 24 -> 74.5.
    Freed at the end, r2 leaves the router at 74.5, reaches the worker at 79.5 and ends at
    79.5 + 22 + 23.5 + 24 = 149. Freed when one decode step is left (r1's second token, at
    50.5), r2 reaches the worker at 55.5, during r1's last step, which it does not delay
    (steps are not preempted); its prefill starts at 74.5, with no idle gap: done at 144."""
    monkeypatch.setitem(PROFILES, "hand", HAND)
    workload = ListWorkload(
        [
            WorkloadRequest("r1", 0.0, ids_to_key(range(1, 21)), max_new_tokens=3),
            WorkloadRequest("r2", 0.0, ids_to_key(range(201, 221)), max_new_tokens=3),
        ]
    )
    hold = HoldSettings(slots=1, free_at_first_token=False, free_at_last_token=last_token)
    config = ClusterConfig(workers=1, policy="lbgr", eviction="lru", profile="hand", hold=hold)
    run = simulate(config, workload)
    by_id = {r.rid: r for r in run.records}
    assert (by_id["r1"].sent_ms, by_id["r1"].finished_ms) == (0.0, 74.5)
    assert (by_id["r2"].sent_ms, by_id["r2"].finished_ms) == (r2_sent, r2_done)
    assert summarize(run)["queue"]["free_at"] == ("last_token" if last_token else "end")


def test_a_slot_frees_at_the_first_token_or_the_last_not_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        HoldSettings(slots=1, free_at_first_token=True, free_at_last_token=True)


def run_json(config: ClusterConfig, workload: GSPWorkload) -> str:
    return json.dumps(summarize(simulate(config, workload)), sort_keys=True)


def test_same_seed_gives_an_identical_json() -> None:
    config = ClusterConfig(workers=3, policy="lbgr", eviction="rlt", capacity_tokens=600, seed=7)
    first = run_json(config, small_gsp(seed=7))
    assert first == run_json(config, small_gsp(seed=7))
    summary = json.loads(first)
    assert sum(w["evicted_tokens"] for w in summary["per_worker"]) > 0  # RLT draws mattered
    # The seed matters: another fleet seed or another workload seed changes the result.
    reseeded = ClusterConfig(workers=3, policy="lbgr", eviction="rlt", capacity_tokens=600, seed=8)
    assert run_json(reseeded, small_gsp(seed=7)) != first
    assert run_json(config, small_gsp(seed=8)) != first


def test_on_submit_sees_each_request_reach_its_worker_before_it_queues() -> None:
    seen: list[tuple[str, str, bool]] = []
    run = simulate(
        ClusterConfig(workers=3, policy="lbgr", seed=1),
        small_gsp(seed=1),
        on_submit=lambda worker, req: seen.append(
            (req.rid, worker.url, req in worker.engine.waiting)
        ),
    )
    assert sorted(rid for rid, _, _ in seen) == sorted(r.rid for r in run.records)
    assert {rid: url for rid, url, _ in seen} == {r.rid: r.worker for r in run.records}
    assert not any(queued for _, _, queued in seen)


@pytest.mark.parametrize("policy", ["random", "round_robin", "power_of_two", "cache_aware", "lbgr"])
@pytest.mark.parametrize("eviction", ["lru", "rlt"])
def test_every_policy_and_eviction_completes_a_small_run(policy: str, eviction: str) -> None:
    workload = small_gsp()
    run = simulate(
        ClusterConfig(workers=2, policy=policy, eviction=eviction, capacity_tokens=500),
        workload,
    )
    summary = summarize(run)
    assert summary.keys() >= SUMMARY_KEYS
    assert (summary["requests"], summary["completed"], summary["failed"]) == (32, 32, 0)
    assert 0.0 < summary["hit_rate"] < 1.0
    assert sum(w["requests"] for w in summary["per_worker"]) == 32
    for record in run.records:
        assert record.ttft_ms is not None
        assert record.latency_ms is not None
        assert 0 < record.ttft_ms <= record.latency_ms
    assert all(count == 0 for count in run.router.in_flight.values())
    for worker in run.workers:
        assert worker.cache.total_tokens <= 500
        assert worker.cache.reserved_tokens == 0
        assert worker.cache.protected_tokens == 0


def test_the_router_policy_learns_from_simulated_completions() -> None:
    run: SimRun = simulate(ClusterConfig(workers=2, policy="lbgr", seed=1), small_gsp())
    assert isinstance(run.router.policy, LBGRPolicy)
    probe = run.router.decide(
        RouteRequest("probe", "x" * 10), [WorkerStatus(w.url) for w in run.workers]
    )
    residuals = [c.residual_ms for c in probe.candidates]
    assert all(r is not None and r > 1.0 for r in residuals), residuals


def test_requests_too_large_for_a_worker_fail_and_are_reported() -> None:
    workload = small_gsp()  # prompts of 65 and 129 tokens (L + separator), 4 output tokens
    run = simulate(ClusterConfig(workers=2, policy="round_robin", capacity_tokens=100), workload)
    summary = summarize(run)
    too_large = sum(1 for r in workload if len(r.prompt) + r.max_new_tokens > 100)
    assert too_large == 16
    assert summary["failed"] == too_large
    assert summary["completed"] == 32 - too_large
    failed = [r for r in run.records if r.failed]
    assert all("needs 133 KV tokens" in (r.failed or "") for r in failed)
    assert all(r.finished_ms is None for r in failed)


def test_markdown_table_prints_one_row_per_summary() -> None:
    rows = [{"policy": "lbgr", "eviction": "rlt", "hit_rate": 0.5}, {"policy": "random"}]
    table = markdown_table(rows).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| lbgr | rlt | 0.500 | - |")
    assert table[3].startswith("| random | - | - |")


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    most = now = 0
    for _, step in edges:  # an end before a start at the same instant
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("slots", [1, 2])
def test_the_hold_queue_bounds_requests_per_worker_and_keeps_groups_together(slots: int) -> None:
    workload = GSPWorkload(
        GSPConfig(num_groups=6, prompts_per_group=8, total_lens=(256, 512), rate=40.0, seed=3)
    )
    hold = HoldSettings(slots=slots, free_at_first_token=False)
    config = ClusterConfig(workers=3, policy="lbgr", eviction="rlt", seed=3, hold=hold)
    run = simulate(config, workload)
    summary = summarize(run)
    assert (summary["completed"], summary["failed"]) == (48, 0)
    assert json.dumps(summary, sort_keys=True) == json.dumps(
        summarize(simulate(config, workload)), sort_keys=True
    )
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for record in run.records:
        assert record.sent_ms is not None
        assert record.finished_ms is not None
        assert record.arrival_ms <= record.sent_ms
        by_worker.setdefault(record.worker, []).append((record.sent_ms, record.finished_ms))
    assert max(_most_at_once(spans) for spans in by_worker.values()) == slots
    assert sum(r.sent_ms > r.arrival_ms for r in run.records if r.sent_ms) > 0  # some waited
    # Affinity: every group's requests went to one worker (none aged past the max wait).
    homes: dict[int, set[str]] = {}
    group_of = {item.rid: item.group for item in workload}
    for record in run.records:
        homes.setdefault(group_of[record.rid], set()).add(record.worker)
    assert all(len(workers) == 1 for workers in homes.values()), homes
    unqueued = summarize(
        simulate(ClusterConfig(workers=3, policy="lbgr", eviction="rlt", seed=3), workload)
    )
    assert summary["hit_rate"] >= unqueued["hit_rate"]


@pytest.mark.parametrize("hint", ["exact", "none"])
def test_the_client_sends_the_answers_length_or_nothing(hint: str) -> None:
    """``output_hint``: with "exact" the router's expected output is each request's own
    length (the share of max_new_tokens generated is 1); with "none" it sees no cap and knows
    only the mean length of what completed. The workers generate the same answers either way."""
    requests = [
        WorkloadRequest(f"r{i}", 1_000.0 * i, ids_to_key(range(100 * i, 100 * i + 50)), n)
        for i, n in enumerate((10, 30, 20))
    ]
    config = ClusterConfig(workers=1, policy="lbgr", output_hint=hint, capacity_tokens=10_000)
    run = simulate(config, ListWorkload(requests))
    assert [r.finished_ms is not None for r in run.records] == [True] * 3
    probe = RouteRequest("probe", "x", max_new_tokens=40 if hint == "exact" else None)
    expected = run.router.expected_output_tokens(probe)
    assert expected == pytest.approx(40.0 if hint == "exact" else 20.0)
    with pytest.raises(ValueError, match="output_hint"):
        ClusterConfig(output_hint="guess")
