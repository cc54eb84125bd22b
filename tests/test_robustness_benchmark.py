"""``benchmarks/robustness.py``: the quick matrix end to end (every cell, the bisection's
bracket, ratios against the right baseline, skipped data), and its pure parts by hand."""

from __future__ import annotations

import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run (as a user runs it, two processes), its JSON and what it printed."""
    tmp = tmp_path_factory.mktemp("robustness")
    out, figure = tmp / "quick.json", tmp / "quick.png"
    argv = ["--quick", "--jobs", "2", "--no-progress", "--out", str(out), "--figure", str(figure)]
    assert robustness.main(argv) == 0
    return {"doc": json.loads(out.read_text()), "figure": figure}


def available_workloads() -> list[str]:
    """The workloads the quick run can build here: a fresh clone has no ../shared/data."""
    return [
        w.key
        for w in robustness.WORKLOADS
        if w.data is None or (robustness.DATA_DIR / w.data).is_file()
    ]


@pytest.mark.slow
def test_the_quick_run_has_every_cell_and_skips_only_missing_data(quick: dict[str, Any]) -> None:
    doc = quick["doc"]
    present = available_workloads()
    missing = [w.key for w in robustness.WORKLOADS if w.key not in present]
    if missing:
        warnings.warn(
            f"robustness --quick skipped {missing}: their data files are not in "
            f"{robustness.DATA_DIR}",
            stacklevel=1,
        )
    assert [s["workload"] for s in doc["skipped"]] == missing
    assert all("not found" in s["reason"] for s in doc["skipped"])
    labels = list(robustness.POLICIES)
    assert [p["label"] for p in doc["policies"]] == labels
    expected_runs = {
        (w, load, e, p, seed)
        for w in present
        for load in robustness.QUICK_LOADS
        for e in robustness.EVICTIONS
        for p in labels
        for seed in robustness.QUICK_SEEDS
    }
    runs = {(r["workload"], r["load"], r["eviction"], r["policy"], r["seed"]) for r in doc["runs"]}
    assert runs == expected_runs
    assert len(doc["runs"]) == len(expected_runs)
    cells = {(c["workload"], c["load"], c["eviction"], c["policy"]) for c in doc["cells"]}
    assert cells == {key[:4] for key in expected_runs}
    for run in doc["runs"]:  # a cell's requests are its workload's, whatever the load
        assert run["requests"] == run["completed"] + run["failed"]
    sizes: dict[str, set[int]] = {}
    for run in doc["runs"]:
        sizes.setdefault(run["workload"], set()).add(run["requests"])
    assert all(len(n) == 1 for n in sizes.values()), sizes
    assert quick["figure"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_saturation_is_bracketed_and_the_loads_are_fractions_of_it(quick: dict[str, Any]) -> None:
    doc = quick["doc"]
    tolerance = doc["saturation_rule"]["tolerance"]
    for sat in doc["saturation"]:
        lo, hi = sat["bracket_rps"]
        assert 0 < lo < hi <= lo * (1 + tolerance) * (1 + 1e-9)
        assert sat["saturation_rps"] == lo
        by_rate = {p["rate_rps"]: p for p in sat["probes"]}
        assert by_rate[lo]["kept_up"]
        assert not by_rate[hi]["kept_up"]
        for probe in sat["probes"]:
            assert probe["policy"] == "round_robin"
            assert probe["eviction"] == "lru"
            assert probe["kept_up"] == (probe["kept_up_ratio"] >= robustness.SUSTAINED)
        # lo only rises to rates that kept up and hi only falls to rates that did not.
        assert all(p["kept_up"] for p in sat["probes"] if p["rate_rps"] <= lo)
        assert not any(p["kept_up"] for p in sat["probes"] if p["rate_rps"] >= hi)
        for run in doc["runs"]:
            if run["workload"] == sat["workload"] and run["seed"] == sat["seed"]:
                assert run["rate_rps"] == pytest.approx(run["load"] * lo)
    # Half the saturation rate is well inside what round_robin + lru sustains.
    half = [
        r
        for r in doc["runs"]
        if r["load"] == 0.5 and r["policy"] == "round_robin" and r["eviction"] == "lru"
    ]
    assert half
    assert all(r["kept_up"] for r in half)


@pytest.mark.slow
def test_ratios_are_against_the_best_baseline_of_the_same_cell(quick: dict[str, Any]) -> None:
    doc = quick["doc"]
    baselines = doc["baselines"]
    assert baselines == ["round_robin", "power_of_two", "cache_aware"]
    runs = doc["runs"]
    for cell in doc["cells"]:
        same = [
            r
            for r in runs
            if (r["workload"], r["load"], r["eviction"])
            == (cell["workload"], cell["load"], cell["eviction"])
        ]
        for short, metric in robustness.RATIOS.items():
            means = {
                b: statistics.fmean(r[metric] for r in same if r["policy"] == b) for b in baselines
            }
            best = min(means, key=lambda b: means[b])
            assert cell[f"{short}_best_baseline"] == best
            mine = statistics.fmean(r[metric] for r in same if r["policy"] == cell["policy"])
            assert cell[f"{short}_ratio"] == pytest.approx(mine / means[best])
            if cell["policy"] in baselines:
                assert cell[f"{short}_ratio"] >= 1.0 - 1e-12
            if cell["policy"] == best:
                assert cell[f"{short}_ratio"] == pytest.approx(1.0)


def run(policy: str, seed: int, p50: float, p95: float) -> dict[str, Any]:
    return {
        "workload": "w",
        "load": 0.5,
        "eviction": "lru",
        "policy": policy,
        "seed": seed,
        "rate_rps": 10.0,
        "failed": 0,
        "kept_up": True,
        "client_delay_s": 0.0,
        "p50_latency_s": p50,
        "p95_latency_s": p95,
        "p50_ttft_s": p50 / 2,
        "throughput_rps": 10.0,
        "hit_rate": 0.5,
    }


def test_the_best_baseline_is_chosen_per_metric_on_the_mean_over_seeds() -> None:
    runs = [
        # p50 means: rr 2.0, p2 1.5 (best), ca 3.0; p95 means: rr 4.0 (best), p2 6.0, ca 5.0
        run("round_robin", 0, 1.0, 4.0),
        run("round_robin", 1, 3.0, 4.0),
        run("power_of_two", 0, 2.0, 6.0),
        run("power_of_two", 1, 1.0, 6.0),
        run("cache_aware", 0, 3.0, 5.0),
        run("cache_aware", 1, 3.0, 5.0),
        run("lbgr", 0, 1.0, 2.0),
        run("lbgr", 1, 2.0, 8.0),
    ]
    labels = ["round_robin", "power_of_two", "cache_aware", "lbgr"]
    cells = {c["policy"]: c for c in robustness.aggregate(runs, labels, labels[:3])}
    lbgr = cells["lbgr"]
    assert lbgr["p50_best_baseline"] == "power_of_two"
    assert lbgr["p50_ratio"] == pytest.approx(1.5 / 1.5)
    # per seed against power_of_two: 1/2 and 2/1
    assert (lbgr["p50_ratio_min"], lbgr["p50_ratio_max"]) == (0.5, 2.0)
    assert lbgr["p95_best_baseline"] == "round_robin"
    assert lbgr["p95_ratio"] == pytest.approx(5.0 / 4.0)
    assert (lbgr["p95_ratio_min"], lbgr["p95_ratio_max"]) == (0.5, 2.0)
    assert cells["cache_aware"]["p50_ratio"] == pytest.approx(2.0)
    assert (lbgr["p50_latency_s_min"], lbgr["p50_latency_s_max"]) == (1.0, 2.0)


def test_policy_specs_by_label_by_name_and_inline() -> None:
    assert robustness.parse_policy("cache_aware").params == (("preset", "sglang"),)
    assert robustness.parse_policy("random") == robustness.spec("random", "random")
    inline = robustness.parse_policy("lbgr_a=lbgr:model=linear,alpha=0.5")
    assert inline == robustness.spec("lbgr_a", "lbgr", model="linear", alpha=0.5)
    with pytest.raises(ValueError, match="unknown policy spec"):
        robustness.parse_policy("nonesuch")
    with pytest.raises(ValueError, match="bad parameters"):
        robustness.parse_policy("x=lbgr:no_such_param=1")
    # The baselines always run, first, once.
    specs = robustness.policy_list(["lbgr", "round_robin"])
    assert [s.label for s in specs] == ["round_robin", "power_of_two", "cache_aware", "lbgr"]


def test_a_missing_data_file_skips_its_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "skip.json"
    argv = [
        "--quick",
        "--jobs",
        "1",
        "--no-progress",
        "--workloads",
        "cyclic",
        "mooncake",
        "--loads",
        "0.5",
        "--evictions",
        "lru",
        "--policies",
        "round_robin",
        "--data",
        str(tmp_path / "no-data"),
        "--out",
        str(out),
        "--figure",
        str(tmp_path / "skip.png"),
    ]
    assert robustness.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [s["workload"] for s in doc["skipped"]] == ["mooncake"]
    assert {r["workload"] for r in doc["runs"]} == {"cyclic"}
    assert "skipping mooncake: data file" in capsys.readouterr().err
