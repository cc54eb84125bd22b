"""``benchmarks/eviction_cost.py`` (reference cache) end to end on a small run, and the row
both eviction benchmarks print. Timing is the benchmark's job; these check the bookkeeping."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eviction_cost
from _tree_shapes import eviction_row


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


@pytest.mark.slow
def test_a_small_run_times_both_policies_on_every_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eviction.json"
    assert eviction_cost.main(["--repeats", "2", "--out", str(out)]) == 0
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
    table = capsys.readouterr().out
    assert "| paired IQR |" in table
    assert f"of {len(rows)} points" in table
