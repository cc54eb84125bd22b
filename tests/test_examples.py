"""examples/: each script runs end to end, with small settings, as a user would run it.

Every example is run as a subprocess (``python examples/NAME.py ...``) from the repository
root, with ``--json`` so the test reads what it printed. The ones that need a cluster start
their own emulated workers and router (the one-command path), except ``hot_swap.py``, which
runs with ``--url`` against a cluster this module starts (the path for an existing router).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from contracts import EXPLAIN_CANDIDATE_KEYS

from sim.local_cluster import LocalCluster

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SUMMARY_FIELDS = {"policy", "eviction", "workers", "requests", "completed", "failed", "hit_rate"}


def run_example(name: str, *args: str, timeout_s: float = 240) -> tuple[dict[str, Any], str]:
    """Run one example; return the JSON of its last stdout line, and all its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result, done.stdout


@pytest.mark.slow
def test_what_if_prints_a_scenario_table() -> None:
    result, out = run_example(
        "what_if.py", "--groups", "16", "--prompts-per-group", "4", "--workers", "2"
    )
    rows = {r["scenario"]: r for r in result["rows"]}
    assert list(rows) == [
        "baseline",
        "+1 worker",
        "rlt eviction",
        "+1 worker, rlt",
        "cache_aware router",
    ]
    assert (rows["baseline"]["workers"], rows["baseline"]["eviction"]) == (2, "lru")
    assert rows["+1 worker"]["workers"] == 3
    assert rows["rlt eviction"]["eviction"] == "rlt"
    assert rows["cache_aware router"]["policy"] == "cache_aware"
    for row in rows.values():
        assert set(row) >= SUMMARY_FIELDS
        assert row["completed"] == row["requests"] == 64
    assert rows["baseline"]["p95_vs_base"] == pytest.approx(1.0)
    assert "| scenario |" in out
    # Deterministic: the same seed gives the same table.
    again, _ = run_example(
        "what_if.py", "--groups", "16", "--prompts-per-group", "4", "--workers", "2"
    )
    assert again == result


@pytest.mark.slow
def test_explain_prints_the_dry_run_and_the_recorded_decision() -> None:
    result, out = run_example("explain.py", "--workers", "2", "--time-scale", "20")
    dry, recorded = result["dry_run"], result["recorded"]
    assert dry["dry_run"] is True
    assert dry["outcome"] is None
    assert recorded["dry_run"] is False
    for decision in (dry, recorded):
        assert len(decision["candidates"]) == 2
        for candidate in decision["candidates"]:
            assert set(candidate) >= EXPLAIN_CANDIDATE_KEYS
        # The warm-up put the system prompt on one worker: that worker is chosen, and the
        # router knows most of the prompt is cached there.
        chosen = next(c for c in decision["candidates"] if c["worker"] == decision["chosen"])
        assert chosen["cached"] > chosen["uncached"]
    assert recorded["chosen"] == dry["chosen"]
    assert recorded["outcome"]["status"] == "ok"
    assert recorded["outcome"]["latency_ms"] > 0
    assert "* http://127.0.0.1:" in out  # the table marks the chosen worker
    assert "outcome: status=ok" in out


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=2, time_scale=10.0) as running:
        running.start_workers()
        running.start_router("kvroute", "lbgr")
        running.warm_up()
        yield running


@pytest.mark.slow
def test_hot_swap_swaps_and_promotes_under_load_without_failures(cluster: LocalCluster) -> None:
    assert cluster.router_url is not None
    assert cluster.control_url is not None
    result, out = run_example(
        "hot_swap.py",
        "--url",
        cluster.router_url,
        "--control-url",
        cluster.control_url,
        "--token",
        cluster.admin_token,
        "--requests",
        "60",
        "--rate",
        "10",
        "--time-scale",
        "10",
        "--interval-s",
        "0.5",
    )
    assert result["failed"] == 0
    assert result["completed"] == result["requests"] == 60
    events = [r["event"] for r in result["rows"] if r["event"]]
    assert events[1].startswith("PUT /models")
    assert events[2].startswith("POST /models/challenger")
    assert events[-2].startswith("POST /models/promote" if result["promoted"] else "DELETE")
    versions = [r["version"] for r in result["rows"]]
    assert versions == sorted(versions)  # the version only moves forward
    assert result["final_version"] == versions[0] + 1 + int(result["promoted"])
    swapped = next(r for r in result["rows"] if r["event"].startswith("PUT /models"))
    assert swapped["champion"]["kind"] == "linear"
    shadow = [r for r in result["rows"] if r["challenger"]["kind"] == "tree"]
    assert shadow
    assert max(r["challenger"]["samples"] or 0 for r in shadow) > 0  # it learned in shadow
    assert "MAE ms" in out


@pytest.mark.slow
def test_compare_routers_runs_each_policy_on_the_same_load() -> None:
    result, out = run_example(
        "compare_routers.py",
        "--workers",
        "2",
        "--requests",
        "24",
        "--time-scale",
        "10",
        "--policies",
        "lbgr",
        "round_robin",
        timeout_s=400,
    )
    assert [r["policy"] for r in result["rows"]] == ["lbgr", "round_robin"]
    for row in result["rows"]:
        assert set(row) >= SUMMARY_FIELDS
        assert row["completed"] == row["requests"] == 24
        assert row["workers"] == 2
        assert 0.0 <= row["hit_rate"] <= 1.0
    assert "| lbgr |" in out
