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

from sim.ceiling import OfflineLimits
from sim.cluster import ClusterConfig, simulate
from sim.profiles import get_profile
from sim.tokens import ids_to_key
from sim.workloads import GSPConfig, GSPWorkload, RequestList, WorkloadRequest


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
            f"robustness --quick left out {missing}: they replay real datasets or traces that "
            f"a clone of the repository does not include (looked for in {robustness.DATA_DIR})",
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
    # the default candidate did not run: no verdict, and the JSON says why
    assert doc["targets"] == {"candidate": "lbgr", "skipped": "not among the policies run"}


@pytest.mark.slow
def test_no_run_beats_the_no_wait_floor(quick: dict[str, Any]) -> None:
    doc = quick["doc"]
    floors = {(f["workload"], f["seed"]): f for f in doc["floors"]}
    assert set(floors) == {(w, s) for w in available_workloads() for s in doc["seeds"]}
    for run in doc["runs"]:
        floor = floors[(run["workload"], run["seed"])]
        assert floor["requests"] + floor["too_large"] == run["requests"]
        # percentiles of the runs are rounded to the microsecond
        assert run["p50_latency_s"] >= floor["p50_floor_s"] - 1e-6, run
        assert run["p95_latency_s"] >= floor["p95_floor_s"] - 1e-6, run
    summary = {s["workload"]: s["floor_p50_s"] for s in doc["saturation_summary"]}
    assert summary == {w: floors[(w, 0)]["p50_floor_s"] for w in available_workloads()}


@pytest.mark.slow
def test_the_quick_verdict_has_every_check_and_counts_missing_cells(quick: dict[str, Any]) -> None:
    targets = quick["doc"]["targets"]
    assert targets["candidate"] == "lbgr"
    checks = targets["checks"]
    workloads, evictions = len(robustness.WORKLOADS), len(robustness.EVICTIONS)
    counts = {t: sum(c["target"] == t for c in checks) for t in "ABC"}
    prefix = len(robustness.PREFIX_SHARING)
    assert counts == {
        "A": 2 * 3 * workloads * evictions,
        "B": 2 * prefix * evictions,
        "C": 2 * workloads * evictions,
    }
    # --quick runs 50% and 110% only: A at 75/90% and all of B have no cell, and are not met.
    for c in checks:
        ran = c["workload"] in available_workloads() and c["load"] in robustness.QUICK_LOADS
        assert c["missing"] == (not ran), c
        if c["missing"]:
            assert not c["met"]
            assert "cell in this run" in c["reason"]
    by_target = {s["target"]: s for s in targets["summary"]}
    assert by_target["B"]["checks_met"] == 0
    # every policy beside the baselines is scored the same way, the candidate's row included
    by_policy = quick["doc"]["targets_by_policy"]
    assert set(by_policy) == {"lbgr", "lbgr_paper"}
    assert by_policy["lbgr"] == targets["summary"]
    assert all(
        s["checks_met"] == sum(c["met"] for c in checks if c["target"] == s["target"])
        for s in targets["summary"]
    )


# -- targets on hand-built cells -----------------------------------------------------------------
def runs_at(
    workload: str, load: float, eviction: str, **by_policy: tuple[float, float, float]
) -> list[dict[str, Any]]:
    """One seed's runs of a cell: (p50 s, p95 s, throughput req/s) per policy."""
    rows = []
    for policy, (p50, p95, throughput) in by_policy.items():
        row = run(policy, 0, p50, p95)
        row.update(workload=workload, load=load, eviction=eviction, throughput_rps=throughput)
        rows.append(row)
    return rows


LABELS = ["round_robin", "power_of_two", "cache_aware", "lbgr"]


def verdict(
    runs: list[dict[str, Any]],
    workloads: list[str],
    evictions: list[str],
    floors: dict[str, float] | None = None,
) -> dict[tuple[str, str, str, float, str], dict[str, Any]]:
    cells = robustness.aggregate(runs, LABELS, LABELS[:3])
    checks = robustness.target_checks(cells, "lbgr", workloads, evictions, floors)
    keyed = {(c["target"], c["check"], c["workload"], c["load"], c["eviction"]): c for c in checks}
    assert len(keyed) == len(checks)
    return keyed


def test_target_a_is_met_within_five_percent_of_the_best_baseline_and_missing_cells_fail() -> None:
    runs = runs_at(
        "cyclic",
        0.5,
        "lru",
        round_robin=(1.0, 2.0, 10.0),
        power_of_two=(1.2, 2.5, 10.0),
        cache_aware=(1.4, 3.0, 10.0),
        lbgr=(1.04, 2.2, 10.0),  # p50 1.04x round_robin's, p95 1.1x
    )
    got = verdict(runs, ["cyclic"], ["lru"])
    p50 = got[("A", "p50 / best baseline's", "cyclic", 0.5, "lru")]
    p95 = got[("A", "p95 / best baseline's", "cyclic", 0.5, "lru")]
    assert p50["met"]
    assert p50["value"] == pytest.approx(1.04)
    assert p50["threshold"] == 1.05
    assert p50["reference"] == "round_robin"
    assert p50["reason"] is None
    assert not p95["met"]
    assert p95["value"] == pytest.approx(1.1)
    assert p95["reason"] is None
    for load in (0.75, 0.9):  # never run: not met, and said why
        row = got[("A", "p50 / best baseline's", "cyclic", load, "lru")]
        assert not row["met"]
        assert row["missing"]
        assert row["reason"] == "no lbgr cell in this run"
    # cyclic shares no prefix to speak of: no B checks
    assert not [key for key in got if key[0] == "B"]
    summary = {s["target"]: s for s in robustness.target_summary(list(got.values()))}
    assert (summary["A"]["checks_met"], summary["A"]["checks"]) == (1, 6)
    assert (summary["A"]["cells_met"], summary["A"]["cells"], summary["A"]["missing"]) == (0, 3, 4)


def test_target_a_with_a_zero_best_baseline_is_not_met() -> None:
    runs = runs_at(
        "cyclic",
        0.5,
        "lru",
        round_robin=(0.0, 0.0, 10.0),
        power_of_two=(1.0, 1.0, 10.0),
        cache_aware=(1.0, 1.0, 10.0),
        lbgr=(0.0, 0.0, 10.0),
    )
    row = verdict(runs, ["cyclic"], ["lru"])[("A", "p50 / best baseline's", "cyclic", 0.5, "lru")]
    assert row["value"] is None
    assert not row["met"]
    assert row["reason"] == "no ratio: round_robin's p50 is 0 or missing"


def test_target_b_compares_each_eviction_with_cache_aware_and_lru_and_flags_infeasible() -> None:
    bases = {"round_robin": (2.0, 4.0, 10.0), "power_of_two": (2.0, 4.0, 10.0)}
    runs = [
        # 75%: cache_aware + lru p50 1.3 s, so the threshold is 1.0 s in both evictions
        *runs_at("longdoc", 0.75, "lru", **bases, cache_aware=(1.3, 3, 10), lbgr=(0.9, 2, 10)),
        *runs_at("longdoc", 0.75, "rlt", **bases, cache_aware=(0.5, 3, 10), lbgr=(1.1, 2, 10)),
        # 90%: the same threshold, and a floor of 1.05 s above it
        *runs_at("longdoc", 0.9, "lru", **bases, cache_aware=(1.3, 3, 10), lbgr=(1.2, 2, 10)),
        # the other workload has no cache_aware + lru cell at 90% (rlt only)
        *runs_at("mooncake", 0.9, "rlt", **bases, cache_aware=(1.3, 3, 10), lbgr=(0.5, 2, 10)),
    ]
    got = verdict(runs, ["longdoc", "mooncake"], ["lru", "rlt"], {"longdoc": 0.6})
    met = got[("B", "p50 s", "longdoc", 0.75, "lru")]
    assert met["met"]
    assert met["threshold"] == pytest.approx(1.0)
    assert met["floor_p50_s"] == 0.6
    rlt = got[("B", "p50 s", "longdoc", 0.75, "rlt")]  # against lru's 1.3 s, not rlt's 0.5 s
    assert not rlt["met"]
    assert rlt["threshold"] == pytest.approx(1.0)
    assert rlt["reason"] is None
    no_ca = got[("B", "p50 s", "mooncake", 0.9, "rlt")]
    assert not no_ca["met"]
    assert no_ca["reason"] == "no cache_aware+lru cell in this run"
    infeasible = verdict(runs, ["longdoc"], ["lru"], {"longdoc": 1.05})
    row = infeasible[("B", "p50 s", "longdoc", 0.9, "lru")]
    assert not row["met"]
    assert row["reason"] == "infeasible (floor p50 1.050 s > cache_aware/1.3 = 1.000 s)"
    # a floor above a measured p50 is a bug somewhere: never met
    wrong = infeasible[("B", "p50 s", "longdoc", 0.75, "lru")]
    assert not wrong["met"]
    assert wrong["reason"].startswith("floor p50 1.050 s above")


def test_target_c_wants_the_best_baselines_throughput_and_round_robins_p50() -> None:
    bases = {
        "round_robin": (5.0, 9.0, 9.0),
        "power_of_two": (6.0, 9.0, 10.0),  # the best throughput: threshold 9.5
        "cache_aware": (4.0, 9.0, 8.0),
    }
    runs = [
        *runs_at("azure_conv", 1.1, "lru", **bases, lbgr=(4.9, 9.0, 9.6)),
        *runs_at("azure_conv", 1.1, "rlt", **bases, lbgr=(5.1, 9.0, 9.4)),
    ]
    got = verdict(runs, ["azure_conv"], ["lru", "rlt"])
    throughput = got[("C", "throughput req/s", "azure_conv", 1.1, "lru")]
    assert throughput["met"]
    assert throughput["threshold"] == pytest.approx(9.5)
    assert throughput["reference"] == "power_of_two"
    assert got[("C", "p50 s vs round_robin", "azure_conv", 1.1, "lru")]["met"]
    assert not got[("C", "throughput req/s", "azure_conv", 1.1, "rlt")]["met"]
    slower = got[("C", "p50 s vs round_robin", "azure_conv", 1.1, "rlt")]
    assert not slower["met"]
    assert slower["threshold"] == 5.0
    assert slower["reason"] is None
    # zero references are not met; a missing baseline cell neither
    zero = {"round_robin": (0.0, 0.0, 0.0), "power_of_two": (1, 1, 0.0), "cache_aware": (1, 1, 0)}
    runs = runs_at("cyclic", 1.1, "lru", **zero, lbgr=(0.0, 0.0, 0.0))
    runs += runs_at("cyclic", 1.1, "rlt", **bases, lbgr=(1.0, 1.0, 1.0))
    cells = robustness.aggregate(runs, LABELS, LABELS[:3])
    cells = [c for c in cells if (c["eviction"], c["policy"]) != ("rlt", "cache_aware")]
    rows = robustness.target_checks(cells, "lbgr", ["cyclic"], ["lru", "rlt"])
    c_rows = {(r["check"], r["eviction"]): r for r in rows if r["target"] == "C"}
    assert c_rows[("throughput req/s", "lru")]["reason"] == "the baselines' throughput is 0"
    assert c_rows[("p50 s vs round_robin", "lru")]["reason"] == "round_robin's p50 is 0 or missing"
    assert c_rows[("throughput req/s", "rlt")]["reason"] == "no cache_aware cell in this run"
    assert not any(r["met"] for r in c_rows.values())


def test_the_candidate_must_be_among_the_policies() -> None:
    with pytest.raises(SystemExit):
        robustness.parse_args(["--quick", "--policies", "lbgr", "--candidate", "nonesuch"])
    args = robustness.parse_args(["--quick", "--candidate", "cache_aware"])
    assert args.candidate == "cache_aware"
    assert robustness.parse_args(["--quick"]).candidate == "lbgr"


@pytest.mark.parametrize("speed", ["0", "-1", "nan", "inf"])
def test_a_speed_that_is_not_a_positive_number_exits_2(speed: str) -> None:
    with pytest.raises(SystemExit) as exc:
        robustness.parse_args(["--quick", "--speed", speed])
    assert exc.value.code == 2


def test_the_fleet_runs_the_chosen_profile_at_the_chosen_speed() -> None:
    """A fleet twice as fast saturates at (about) twice the rate, and its floor halves but
    for the per-request overhead (HTTP, tokenisation: not the GPU's); the other profile is
    the one the workers run (lbgr keeps its constants either way)."""
    spec = next(w for w in robustness.WORKLOADS if w.key == "cyclic")
    at = {
        speed: robustness.Setting(spec, 0, True, str(robustness.DATA_DIR), speed=speed)
        for speed in (1.0, 2.0)
    }
    saturation = {s: robustness.find_saturation(at[s])["saturation_rps"] for s in at}
    assert 1.7 < saturation[2.0] / saturation[1.0] < 2.3
    floors = {s: robustness.no_wait_floor(at[s])["p50_floor_s"] for s in at}
    overhead_s = get_profile(robustness.PROFILE).request_overhead_ms / 1000.0
    assert floors[2.0] == pytest.approx((floors[1.0] - overhead_s) / 2 + overhead_s)
    h200 = robustness.Setting(spec, 0, True, "", profile="llama3.1-70b-h200")
    assert h200.service.kv_capacity_tokens == get_profile("llama3.1-70b-h200").kv_capacity_tokens
    row = robustness.run_one(robustness.build(h200, 4.0), robustness.SATURATION_POLICY, "lru", h200)
    fast = robustness.run_one(
        robustness.build(at[1.0], 4.0), robustness.SATURATION_POLICY, "lru", at[1.0]
    )
    assert row["p50_latency_s"] != fast["p50_latency_s"]
    args = robustness.parse_args(["--quick", "--profile", "llama3.1-70b-h200", "--speed", "0.5"])
    assert (args.profile, args.speed) == ("llama3.1-70b-h200", 0.5)
    assert args.fleet == "llama3.1-70b-h200 at 0.5x speed"
    blind = robustness.parse_args(["--quick", "--output-hint", "none"])
    assert blind.fleet == f"{robustness.PROFILE}, max_new_tokens none"
    with pytest.raises(SystemExit):
        robustness.parse_args(["--quick", "--output-hint", "guess"])


# -- the no-wait floor -----------------------------------------------------------------------------
PROFILE = get_profile(robustness.PROFILE)  # T_w 24, a 0.114, c 5.5e-6, o_step 1.5, o_req 5 ms;
# decode: 24 + 0.2e-3 per context token + 0.04 per sequence + 1.5 ms


def hand_workload(arrivals: tuple[float, float, float]) -> RequestList:
    """r0 and r1 share a 1,000-token prefix (200 tokens each of their own); r2 is r0 again."""
    prefix = ids_to_key(range(1, 1001))
    r0 = WorkloadRequest("r0", arrivals[0], prefix + ids_to_key(range(2000, 2200)), 4)
    r1 = WorkloadRequest("r1", arrivals[1], prefix + ids_to_key(range(3000, 3200)), 4)
    r2 = WorkloadRequest("r2", arrivals[2], r0.prompt, 4)
    return RequestList("hand", [r0, r1, r2])


def test_a_larger_fleet_saturates_at_a_higher_rate_and_sizes_the_cycle_to_itself() -> None:
    """Eight workers keep up with about twice the rate of four, and the cyclic worst case
    is sized to their cache (its cycle 1.1x the fleet's capacity); a fleet of none exits 2."""
    spec = next(w for w in robustness.WORKLOADS if w.key == "cyclic")
    at = {n: robustness.Setting(spec, 0, True, str(robustness.DATA_DIR), workers=n) for n in (4, 8)}
    saturation = {n: robustness.find_saturation(at[n])["saturation_rps"] for n in at}
    assert 1.7 < saturation[8] / saturation[4] < 2.3
    prompts = {n: len({r.prompt for r in robustness.build(at[n], 10.0)}) for n in at}
    assert 1.9 < prompts[8] / prompts[4] < 2.1
    row = robustness.run_one(
        robustness.build(at[8], 10.0), robustness.SATURATION_POLICY, "lru", at[8]
    )
    assert row["completed"] == row["requests"]
    assert robustness.parse_args(["--quick", "--workers", "8"]).workers == 8
    with pytest.raises(SystemExit) as exc:
        robustness.parse_args(["--quick", "--workers", "0"])
    assert exc.value.code == 2


def test_a_mixed_fleet_runs_each_worker_at_its_own_speed() -> None:
    """``--speed`` with one value per worker: round_robin, blind to speed, sends the slow
    workers as many requests as the fast ones, so the fleet saturates at the slow ones' pace
    (below a uniform fleet's), and the floor is the fastest worker's."""
    args = robustness.parse_args(["--quick", "--workers", "4", "--speed", "1", "1", "0.5", "0.5"])
    assert (args.speeds, args.speed) == ((1.0, 1.0, 0.5, 0.5), 1.0)
    assert args.fleet == f"{robustness.PROFILE} at 1/1/0.5/0.5x speed"
    assert robustness.parse_args(["--quick", "--speed", "2", "2", "2", "2"]).speeds == ()
    spec = next(w for w in robustness.WORKLOADS if w.key == "cyclic")
    data = str(robustness.DATA_DIR)
    uniform = robustness.Setting(spec, 0, True, data)
    mixed = robustness.Setting(spec, 0, True, data, speeds=args.speeds)
    rates = {s: robustness.find_saturation(s)["saturation_rps"] for s in (uniform, mixed)}
    assert 0.45 < rates[mixed] / rates[uniform] < 0.6
    # The floor is the fastest worker's: a 2/2/1/1 fleet's is a uniform 2x fleet's.
    fast = robustness.parse_args(["--quick", "--speed", "2", "2", "1", "1"])
    assert fast.speed == 2.0
    floor = robustness.no_wait_floor(
        robustness.Setting(spec, 0, True, data, speed=fast.speed, speeds=fast.speeds)
    )
    assert floor == robustness.no_wait_floor(robustness.Setting(spec, 0, True, data, speed=2.0))
    assert floor["p50_floor_s"] < robustness.no_wait_floor(uniform)["p50_floor_s"]
    for bad in (["--speed", "1", "0.5"], ["--speed", "1", "1", "1", "-1"]):
        with pytest.raises(SystemExit) as exc:
            robustness.parse_args(["--quick", *bad])
        assert exc.value.code == 2


def test_a_later_window_of_a_trace_replays_the_requests_after_the_first() -> None:
    """``--window 1`` replays a trace's next run of requests (held out from the matrix's
    first), at that window's own native rate; a window past the trace's end exits 2."""
    spec = next(w for w in robustness.WORKLOADS if w.key == "mooncake")
    path = robustness.DATA_DIR / str(spec.data)
    if not path.is_file():
        pytest.skip(f"{path} is not here (real data a clone does not include)")
    data = str(robustness.DATA_DIR)
    first, second = (robustness.Setting(spec, 0, True, data, window=k) for k in (0, 1))
    a, b = robustness.build(first, 1.0), robustness.build(second, 1.0)
    assert len(a) == len(b) == spec.quick_size
    assert a.hash_ids != b.hash_ids
    whole = robustness.load_mooncake(str(path), limit=2 * spec.quick_size)
    assert b.hash_ids == whole.hash_ids[spec.quick_size :]
    args = robustness.parse_args(["--quick", "--window", "1", "--workloads", "mooncake"])
    assert args.window == 1
    assert args.fleet.endswith("trace window 1")
    rows = robustness.trace_rows(path)
    for bad in (str(rows // spec.quick_size + 1), "-1"):
        with pytest.raises(SystemExit) as exc:
            robustness.parse_args(["--quick", "--window", bad, "--workloads", "mooncake"])
        assert exc.value.code == 2


def test_the_floor_of_requests_sharing_a_prefix_by_hand() -> None:
    workload = hand_workload((0.0, 10_000.0, 20_000.0))
    assert robustness.shared_prefix_tokens(workload) == [0, 1000, 1199]  # r2: all but one
    decode = 3 * (24 + 0.04 + 1.5) + 0.2e-3 * (1201 + 1202 + 1203)  # 3 steps, batch 1
    # r0: 1,200 new tokens, prefill 0.114 x 1200 + 5.5e-6 x 1200 x 600 = 140.76 ms
    assert robustness.latency_floor_ms(PROFILE, 1200, 0, 4) == pytest.approx(
        5 + 140.76 + 1.5 + decode
    )
    # r1: 200 new after 1,000 cached: 0.114 x 200 + 5.5e-6 x 200 x 1100 = 24.01 ms
    assert robustness.latency_floor_ms(PROFILE, 1200, 1000, 4) == pytest.approx(
        5 + 24.01 + 1.5 + decode
    )
    # r2: one token recomputed; the step costs the weights' read, 24 ms
    assert robustness.latency_floor_ms(PROFILE, 1200, 1200, 4) == pytest.approx(
        5 + 24 + 1.5 + decode
    )
    # 10,000 new tokens are two chunks (8,192 + 1,808): one step overhead more
    assert robustness.latency_floor_ms(PROFILE, 10_000, 0, 1) == pytest.approx(
        5 + 0.114 * 10_000 + 5.5e-6 * 10_000 * 5_000 + 2 * 1.5
    )


def test_the_floor_is_the_latency_alone_and_a_bound_in_a_crowd() -> None:
    config = ClusterConfig(workers=1, policy="round_robin", profile=robustness.PROFILE)
    alone = hand_workload((0.0, 10_000.0, 20_000.0))  # each request finds the worker idle
    shared = robustness.shared_prefix_tokens(alone)
    floors = [
        robustness.latency_floor_ms(PROFILE, len(r.prompt), n, r.max_new_tokens)
        for r, n in zip(alone, shared, strict=True)
    ]
    latencies = [r.latency_ms for r in simulate(config, alone).records]
    assert latencies == pytest.approx(floors)
    crowd = hand_workload((0.0, 0.0, 1.0))  # all together: r1 and r2 batch with r0
    assert robustness.shared_prefix_tokens(crowd) == shared
    latencies = [r.latency_ms for r in simulate(config, crowd).records]
    assert all(x >= f for x, f in zip(latencies, floors, strict=True))
    assert latencies[1] > floors[1] + 100  # r1 found nothing cached: far above its floor


def test_the_floor_counts_only_requests_that_may_come_first() -> None:
    # open loop: arrival order, not list order
    late_first = hand_workload((10_000.0, 0.0, 20_000.0))
    assert robustness.shared_prefix_tokens(late_first) == [1000, 0, 1199]
    # closed loop: a turn never finds its own later turns, which wait for it
    turn0 = WorkloadRequest(
        "t0", 0.0, ids_to_key(range(1, 101)), 4, output=ids_to_key([7, 8, 9, 10])
    )
    turn1 = WorkloadRequest(
        "t1", 1.0, turn0.prompt + turn0.output + ids_to_key(range(500, 600)), 4, after="t0"
    )
    turn2 = WorkloadRequest("t2", 2.0, turn1.prompt + ids_to_key([11]), 4, after="t1")
    other = WorkloadRequest("o0", 3.0, ids_to_key(range(1, 51)), 4)  # a later arrival's prefix
    chain = RequestList("chain", [turn0, turn1, turn2, other])
    # t0: only o0 may precede it (50 tokens); t1: t0's prompt + 3 answer tokens; t2: t1's
    # prompt + its 3 filler tokens do not match t2's next token, so t1's prompt
    assert robustness.shared_prefix_tokens(chain) == [50, 103, 204, 49]


def test_the_floor_counts_what_the_unlimited_ceiling_counts_on_an_open_loop_workload() -> None:
    workload = GSPWorkload(GSPConfig(8, 6, order="random", seed=3))
    shared = robustness.shared_prefix_tokens(workload)
    assert sum(shared) == OfflineLimits(workload).ceiling().cached_tokens > 0
