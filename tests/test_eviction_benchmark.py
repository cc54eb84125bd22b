"""``benchmarks/eviction_cost.py`` (reference cache) end to end on a small run, and the row
both eviction benchmarks print. Timing is the benchmark's job; these check the bookkeeping."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eviction_cost
import numpy as np
from _tree_shapes import CHURN_FACTOR, SHAPES, churn_keys, churn_row, eviction_row


def test_a_row_pairs_the_repetitions_and_reports_their_quartiles() -> None:
    samples = {
        # per token: rlt 2, 4, 6, 8 ns; lru 1, 1, 2, 2 ns -> paired ratios 2, 4, 3, 4
        "lru": {"ns": [1_000, 1_000, 4_000, 4_000], "freed": [1_000, 1_000, 2_000, 2_000]},
        "rlt": {"ns": [2_000, 4_000, 6_000, 8_000], "freed": [1_000, 1_000, 1_000, 1_000]},
    }
    row = eviction_row("gsp", 1_000, samples, 1.5)
    assert row["lru_ns_per_token"] == 1.5
    assert row["rlt_ns_per_token"] == 5.0
    assert row["rlt_over_lru_text"] == "3.33x"
    assert row["meets_target"] == "no"
    # statistics.quantiles (inclusive method) of [2, 3, 4, 4]: 2.75 and 4.0
    assert row["paired_ratio_quartiles"] == [2.75, 4.0]
    assert row["paired_ratio_text"] == "2.75-4.00x"
    one = {p: {"ns": got["ns"][:1], "freed": got["freed"][:1]} for p, got in samples.items()}
    assert eviction_row("gsp", 1_000, one, 1.5)["paired_ratio_text"] == "n/a"
    # Two far-apart repetitions (ratios 0.5 and 10): the quartiles stay between them, where
    # the exclusive method would extrapolate below zero.
    two = {
        "lru": {"ns": [2_000, 1_000], "freed": [1_000, 1_000]},
        "rlt": {"ns": [1_000, 10_000], "freed": [1_000, 1_000]},
    }
    assert eviction_row("gsp", 1_000, two, 1.5)["paired_ratio_quartiles"] == [2.875, 7.625]


def test_a_row_weighs_each_policy_against_the_prefill_it_makes_room_for() -> None:
    """ns per token freed over the reference profile's prefill (0.114 ms a token): RLT's
    target is 1% of it."""
    cheap = {
        "lru": {"ns": [1_000_000], "freed": [1_000]},
        "rlt": {"ns": [1_140_000], "freed": [1_000]},  # 1,140 ns a token: 1% exactly
    }
    row = eviction_row("gsp", 1_000, cheap, 1.5)
    assert row["rlt_prefill_share"] == pytest.approx(0.01)
    assert row["lru_prefill_share"] == pytest.approx(1_000 / 114_000, abs=1e-6)
    assert row["rlt_within_prefill_target"] == "yes"
    cheap["rlt"]["ns"] = [1_150_000]
    assert eviction_row("gsp", 1_000, cheap, 1.5)["rlt_within_prefill_target"] == "no"


def run(call_ns: list[int], freed: int, hits: int = 50, tokens: int = 100) -> dict[str, object]:
    return {
        "requests": 3,
        "call_ns": call_ns,
        "freed": freed,
        "hit_tokens": hits,
        "prompt_tokens": tokens,
    }


def test_a_churn_row_is_time_per_token_freed_over_whole_streams() -> None:
    samples = {
        # per token freed: lru 1, 2 ns; rlt 3, 2 ns -> paired ratios 3 and 1
        "lru": [run([400, 600], 1_000), run([1_000, 1_000, 2_000], 2_000, hits=60)],
        "rlt": [run([3_000], 1_000), run([2_000, 2_000], 2_000, hits=70)],
    }
    row = churn_row("gsp", samples, 1.5)
    assert row["requests"] == 3
    assert row["lru_ns_per_token"] == 1.5
    assert row["rlt_ns_per_token"] == 2.5
    assert row["rlt_over_lru_text"] == "1.67x"
    assert row["meets_target"] == "no"
    assert row["paired_ratio_text"] == "1.50-2.50x"  # quartiles of [3, 1]
    assert row["lru_calls"] == 2  # the median of 2 and 3 calls, rounded down
    assert row["rlt_freed"] == 1_500
    # p50 / p99 of the calls pooled over streams: lru [400, 600, 1000, 1000, 2000]
    assert (row["lru_call_p50_us"], row["lru_call_p99_us"]) == (1.0, 2.0)
    assert row["lru_calls_text"] == "1 / 2"
    assert row["rlt_hit_rate"] == 0.6  # the median of 50% and 70%


def test_a_churn_stream_draws_a_pool_twice_the_cache_until_five_caches_worth() -> None:
    capacity = 20_000
    stream = churn_keys(SHAPES["gsp"], np.random.default_rng(4), capacity)
    pool = set(SHAPES["gsp"](np.random.default_rng(4), 2 * capacity))
    assert set(stream) <= pool
    assert len(set(stream)) < len(stream), "drawn with replacement: keys come back"
    total = sum(map(len, stream))
    assert CHURN_FACTOR * capacity <= total < CHURN_FACTOR * capacity + max(map(len, stream))
    again = churn_keys(SHAPES["gsp"], np.random.default_rng(4), capacity)
    assert again == stream


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("policy", ["lru", "rlt"])
def test_a_churn_replay_keeps_the_cache_full_and_frees_what_it_counts(
    shape: str, policy: str
) -> None:
    capacity = 20_000
    stream = churn_keys(SHAPES[shape], np.random.default_rng(2), capacity)
    got = eviction_cost.replay(stream, policy, capacity, seed=1)  # checks the invariants
    inserted = sum(map(len, stream)) - got["hit_tokens"]
    assert 0 < got["hit_tokens"] < got["prompt_tokens"], "the stream both hits and misses"
    # what went in and is not held any more was freed by the timed calls, and the cache
    # ends near full: every token that did not fit was made room for
    assert 0 < got["freed"] <= inserted
    assert inserted - got["freed"] <= capacity
    assert len(got["call_ns"]) > 0
    if policy == "rlt":  # RLT frees exactly what each call asks: the cache ends full
        assert inserted - got["freed"] >= capacity - max(map(len, stream))


@pytest.mark.slow
def test_a_small_run_times_both_policies_on_every_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eviction.json"
    assert eviction_cost.main(["--repeats", "2", "--churn-repeats", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {(r["shape"], r["evict_tokens"]) for r in rows} == {
        (shape, tokens) for shape in eviction_cost.SHAPES for tokens in eviction_cost.EVICT_TOKENS
    }
    for row in rows:
        # RLT drops exactly what is asked (page size 1); LRU frees whole leaves, so at least.
        assert row["rlt_freed_min"] == row["rlt_freed_max"] == row["evict_tokens"]
        assert row["lru_freed_min"] >= row["evict_tokens"]
        assert len(row["rlt_samples_ns"]) == len(row["lru_samples_ns"]) == 2
        low, high = row["paired_ratio_quartiles"]
        assert 0 < low <= high
    churn = doc["churn"]
    assert [r["shape"] for r in churn] == list(eviction_cost.SHAPES)
    for row in churn:
        for policy in ("lru", "rlt"):
            assert row[f"{policy}_calls"] > 0
            assert row[f"{policy}_freed"] > 0
            assert 0 < row[f"{policy}_hit_rate"] < 1
            assert row[f"{policy}_call_p50_us"] <= row[f"{policy}_call_p99_us"]
    table = capsys.readouterr().out
    assert "| paired IQR |" in table
    assert f"of {len(rows)} points" in table
    assert "## Under churn" in table
    assert f"for {sum(r['meets_target'] == 'yes' for r in churn)} of 3 shapes" in table
