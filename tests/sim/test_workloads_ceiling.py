"""Offline hit-rate limits (sim.ceiling) on hand-made workloads, and the cyclic worst case."""

from __future__ import annotations

import pytest
from workload_support import ListWorkload

from sim.ceiling import OfflineLimits
from sim.cluster import ClusterConfig, SimRun, simulate
from sim.report import summarize
from sim.tokens import ids_to_key
from sim.workloads import (
    CyclicConfig,
    CyclicWorkload,
    GSPConfig,
    GSPWorkload,
    MultiTurnConfig,
    MultiTurnWorkload,
    WorkloadRequest,
)


def req(
    rid: str, t: float, ids: list[int], new: int = 1, out: list[int] | None = None
) -> WorkloadRequest:
    return WorkloadRequest(rid, t, ids_to_key(ids), new, ids_to_key(out or []))


def exact_hit_rate(run: SimRun) -> float:
    cached = sum(w.cache.stats.cached_tokens for w in run.workers)
    return cached / sum(w.cache.stats.prompt_tokens for w in run.workers)


def test_ceiling_counts_prefixes_seen_before_with_the_last_token_recomputed() -> None:
    w = ListWorkload(
        [
            req("a", 0, [1, 2, 3, 4, 5, 6]),
            req("b", 1, [1, 2, 3, 7, 8]),  # 3 of a's tokens
            req("c", 2, [1, 2, 3, 4, 9]),  # 4 of a's
            req("d", 3, [1, 2, 3, 4, 5, 6]),  # all of a's but the last: 5
            req("e", 4, [1, 2]),  # fully cached, last token recomputed: 1
        ]
    )
    limit = OfflineLimits(w).ceiling()
    assert (limit.prompt_tokens, limit.cached_tokens) == (24, 3 + 4 + 5 + 1)
    assert limit.capacity_tokens is None
    # Reused at least once: [1, 2, 3] (b), [4] (c), [5] (d); 6 is only ever a last token.
    assert limit.reusable_tokens == 5


def test_ceiling_follows_arrival_order_and_counts_inserted_outputs() -> None:
    w = ListWorkload(
        [
            # Listed out of order: "next" arrives after "first" and quotes its answer.
            req("next", 5, [1, 2, 3, 40, 50, 6, 7]),
            req("first", 0, [1, 2, 3], new=3, out=[40, 50, 60]),  # inserts 1 2 3 40 50
            req("same", 9, [1, 2, 3], new=2),  # a's prompt again: 2 (last recomputed)
        ]
    )
    limit = OfflineLimits(w).ceiling()
    assert limit.cached_tokens == 5 + 2
    assert limit.hit_rate == pytest.approx(7 / 13)


def test_bound_is_belady_with_bypass_on_token_runs() -> None:
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    w = ListWorkload([req(str(i), i, p) for i, p in enumerate([a, b, c, a, b, c])])
    limits = OfflineLimits(w)
    assert limits.ceiling().cached_tokens == 9  # 3 counted tokens of each second visit
    # Capacity 2: keep two tokens of a (the soonest reuse), hit them once. 3: all three
    # counted tokens of a. 6: a and b; c, reused last, is dropped. 8: a, b and two tokens of
    # c (part of a run can stay). 9: everything.
    assert [limits.bound(cap).cached_tokens for cap in (0, 2, 3, 6, 8, 9)] == [0, 2, 3, 6, 8, 9]
    assert limits.bound(3).capacity_tokens == 3
    with pytest.raises(ValueError, match="capacity_tokens must be >= 0"):
        limits.bound(-1)


def test_bound_never_keeps_what_comes_back_only_as_a_last_token_or_an_output() -> None:
    # The second request's prompt is the first's last token and answer area only: nothing to
    # count, so even a big cache gains nothing there; the third reuses [1, 2].
    w = ListWorkload([req("a", 0, [1, 2, 3], new=2, out=[9]), req("b", 1, [1, 2, 7])])
    assert (
        OfflineLimits(w).bound(100).cached_tokens == OfflineLimits(w).ceiling().cached_tokens == 2
    )
    assert OfflineLimits(w).bound(1).cached_tokens == 1


@pytest.mark.parametrize("eviction", ["lru", "rlt"])
def test_limits_bound_simulated_runs(eviction: str) -> None:
    w = GSPWorkload(
        GSPConfig(num_groups=12, prompts_per_group=6, total_lens=(64, 256), order="round_robin")
    )
    limits = OfflineLimits(w)
    ceiling = limits.ceiling()
    assert ceiling.reusable_tokens == w.reusable_working_set
    for factor in (0.5, 1.0, 2.0, 4.0):
        capacity = max(int(factor * w.reusable_working_set), 300)
        run = simulate(
            ClusterConfig(
                workers=1, policy="round_robin", eviction=eviction, capacity_tokens=capacity
            ),
            w,
        )
        hit = exact_hit_rate(run)
        assert hit <= limits.bound(capacity).hit_rate + 1e-9 <= ceiling.hit_rate + 1e-9
    fleet = simulate(ClusterConfig(workers=3, policy="cache_aware", eviction=eviction), w)
    assert exact_hit_rate(fleet) <= ceiling.hit_rate + 1e-9


def test_multiturn_ceiling_counts_every_earlier_turn() -> None:
    cfg = MultiTurnConfig(num_clients=3, turns=(3,), user_len=10, output_len=2)
    limit = OfflineLimits(MultiTurnWorkload(cfg)).ceiling()
    # Turn k (0-based) has 10(k+1) + 2k tokens, of which the previous prompt and its answer
    # but the last token are cached: 0, 11, 23 per client.
    assert limit.prompt_tokens == 3 * (10 + 22 + 34)
    assert limit.cached_tokens == 3 * (0 + 11 + 23)


# -- cyclic ----------------------------------------------------------------------------------
def test_cyclic_sizes_the_cycle_just_above_the_capacity() -> None:
    cfg = CyclicConfig(capacity_tokens=10_000, ratio=1.1, prompt_len=500, output_len=4, cycles=3)
    assert cfg.footprint_tokens == 503
    assert cfg.num_prompts == 22  # ceil(11000 / 503)
    assert cfg.cycle_tokens == 22 * 503 >= 11_000
    w = CyclicWorkload(cfg)
    assert len(w) == 66
    prompts = [r.prompt for r in w]
    assert prompts[:22] == prompts[22:44] == prompts[44:]
    assert len(set(prompts)) == 22
    assert [r.group for r in w][:3] == [0, 1, 2]
    assert all(r.output == w[r.group or 0].output for r in w)  # one answer per prompt
    assert w.reusable_working_set == 22 * 500
    assert len(CyclicWorkload(cfg, limit=5)) == 5


def test_cyclic_is_the_worst_case_for_lru_and_not_for_rlt() -> None:
    cfg = CyclicConfig(
        capacity_tokens=6_000, ratio=1.1, prompt_len=300, output_len=2, cycles=6, rate=2.0
    )
    w = CyclicWorkload(cfg)
    rows = {
        ev: summarize(
            simulate(
                ClusterConfig(workers=1, policy="round_robin", eviction=ev, capacity_tokens=6_000),
                w,
            )
        )
        for ev in ("lru", "rlt")
    }
    assert rows["lru"]["hit_rate"] == 0.0
    assert rows["rlt"]["hit_rate"] > 0.25
    limits = OfflineLimits(w)
    assert rows["rlt"]["hit_rate"] <= limits.bound(6_000).hit_rate <= limits.ceiling().hit_rate
    # Unlimited: every pass after the first hits all but the last token of each prompt.
    assert limits.ceiling().cached_tokens == 5 * cfg.num_prompts * 299


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_tokens": 0}, "must be >= 1"),
        ({"ratio": 0.0}, "ratio must be a positive number"),
        ({"cycles": 0}, "cycles must be >= 1"),
    ],
)
def test_bad_cyclic_config_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CyclicConfig(**kwargs)  # type: ignore[arg-type]
