"""``benchmarks/recovery.py``: the quick run end to end (every cell, what it counts), and the
band it prints by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import recovery


def test_the_quick_run_has_every_cell_and_brings_the_worker_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "recovery.json"
    assert recovery.main(["--quick", "--jobs", "2", "--no-progress", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    cells = doc["cells"]
    # 4 workers x speeds 1x, 2x x 2 loads x 4 policies x 1 seed
    assert len(cells) == 16
    assert {c["policy"] for c in cells} == set(recovery.POLICIES)
    assert {c["rate"] for c in cells} == {1.0, 3.0}
    for cell in cells:
        assert 0.0 <= cell["share"] <= 1.0
        assert cell["p50_s"] <= cell["p95_s"]
        # Every policy, lbgr after the stall included, gives worker 0 ten requests again.
        assert cell["back_s"] is not None
        assert cell["back_s"] >= 0.0
    for row in doc["rows"]:
        assert row["fair_share"] == 0.25
        assert row["fair_back_s"] == pytest.approx(10 / row["rate"] * 4)
    # Round robin is blind to the stall: worker 0 gets one request in four.
    rr = [c for c in cells if c["policy"] == "round_robin"]
    assert all(abs(c["share"] - 0.25) < 0.02 for c in rr)
    printed = capsys.readouterr().out
    assert "| 4 | 2x | 3 | lbgr, no stall |" in printed
    assert "never got 10 requests back: 0" in printed


def test_a_band_shows_the_runs_where_the_worker_never_came_back() -> None:
    assert recovery._band([1.0, 2.0, 3.0], 1) == "2.0 (1.0-3.0)"
    assert recovery._band([2.5], 2) == "2.50"
    assert recovery._band([1.0, None, 3.0], 1) == "2.0, never in 1 of 3"
    assert recovery._band([None], 1) == "never in 1 of 1"
