"""``kvroute sim``: usage errors exit 2, and ``--json`` prints the run's summary last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from contracts import SUMMARY_KEYS

from kvroute.cli import main

SMALL = [
    "sim",
    "--gsp-groups",
    "4",
    "--gsp-prompts-per-group",
    "4",
    "--gsp-lens",
    "64,128",
    "--workers",
    "2",
    "--rate",
    "50",
    "--no-progress",
]


def run_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert main([*SMALL, *extra, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| policy | eviction |")  # the table comes first
    parsed: dict[str, Any] = json.loads(out[-1])
    return parsed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "nope"], "--policy: unknown policy 'nope'; choose from cache_aware, lbgr"),
        (["--eviction", "fifo"], "--eviction: unknown eviction 'fifo'; choose from lru, rlt"),
        (["--rate", "0"], "argument --rate: must be > 0"),
        (["--rate", "-3"], "argument --rate: must be > 0"),
        (["--rate", "nan"], "argument --rate: must be > 0"),
        (["--rate", "fast"], "argument --rate: expected a number, got 'fast'"),
        (["--model", "nope"], "--model: unknown model kind 'nope'; known: "),
        (["--model", "{not json"], "--model: model spec is not valid JSON"),
        (["--model", '{"kind": "ewmean", "params": {"bogus": 1}}'], "has no parameter"),
        (["--workers", "0"], "argument --workers: must be >= 1"),
        (["--gsp-lens", "64,x"], "expected comma-separated integers"),
        (["--order", "sorted"], "argument --order: invalid choice"),
        (["--capacity-tokens", "132"], "--capacity-tokens must exceed the longest prompt"),
        (["--queue-slots", "0"], "argument --queue-slots: must be >= 1"),
        (["--queue-free-at", "later"], "argument --queue-free-at: invalid choice"),
        (["--queue-max-wait-s", "0"], "argument --queue-max-wait-s: must be > 0"),
    ],
)
def test_bad_input_exits_2_with_usage_and_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*SMALL, *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvroute sim")
    assert message in err


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage: kvroute" in capsys.readouterr().err


def test_json_last_line_has_the_summary_keys(capsys: pytest.CaptureFixture[str]) -> None:
    summary = run_json(capsys, "--policy", "cache_aware", "--eviction", "lru")
    assert summary.keys() >= SUMMARY_KEYS
    assert (summary["policy"], summary["eviction"], summary["workers"]) == ("cache_aware", "lru", 2)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (16, 16, 0)
    assert 0.0 < summary["hit_rate"] < 1.0
    assert summary["p50_latency_s"] <= summary["p95_latency_s"]
    assert summary["p50_ttft_s"] <= summary["p95_ttft_s"]
    assert len(summary["per_worker"]) == 2
    for worker in summary["per_worker"]:
        assert {"requests", "hit_rate"} <= worker.keys()
    assert sum(w["requests"] for w in summary["per_worker"]) == 16
    assert summary["policy_params"] == {"preset": "paper"}


def test_clients_without_max_new_tokens_are_simulated_and_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    exact = run_json(capsys, "--policy", "lbgr")
    blind = run_json(capsys, "--policy", "lbgr", "--output-hint", "none")
    assert (exact["output_hint"], blind["output_hint"]) == ("exact", "none")
    assert (blind["completed"], blind["failed"]) == (16, 0)
    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--output-hint", "maybe"])
    assert info.value.code == 2
    assert "argument --output-hint: invalid choice" in capsys.readouterr().err


def test_the_hold_queue_is_reported_with_its_waits(capsys: pytest.CaptureFixture[str]) -> None:
    plain = run_json(capsys, "--policy", "lbgr")
    assert "queue" not in plain
    queued = run_json(capsys, "--policy", "lbgr", "--queue-slots", "1", "--queue-free-at", "end")
    assert (queued["completed"], queued["failed"]) == (16, 0)
    queue = queued["queue"]
    assert (queue["slots"], queue["free_at"], queue["max_wait_s"]) == (1, "end", 20.0)
    assert 0.0 <= queue["p50_wait_s"] <= queue["p95_wait_s"]
    assert queue["p95_wait_s"] > 0.0  # 50 req/s on two workers, one at a time: some wait


def test_capacity_just_large_enough_for_the_longest_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The longest prompt is 128 + 1 separator tokens, plus 4 output tokens.
    summary = run_json(capsys, "--capacity-tokens", "133", "--policy", "round_robin")
    assert (summary["completed"], summary["failed"]) == (16, 0)
    assert summary["capacity_tokens"] == 133


def test_several_combinations_print_rows_and_parallel_jobs_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    combos = ["--policy", "lbgr", "round_robin", "--eviction", "lru", "rlt"]
    serial = run_json(capsys, *combos, "--capacity-tokens", "400")
    rows = serial["rows"]
    assert [(r["policy"], r["eviction"]) for r in rows] == [
        ("lbgr", "lru"),
        ("lbgr", "rlt"),
        ("round_robin", "lru"),
        ("round_robin", "rlt"),
    ]
    assert all(r.keys() >= SUMMARY_KEYS for r in rows)
    parallel = run_json(capsys, *combos, "--capacity-tokens", "400", "--jobs", "2")
    assert parallel == serial


def test_console_script_prints_json_last() -> None:
    script = Path(sys.executable).with_name("kvroute")
    proc = subprocess.run(
        [str(script), *SMALL, "--policy", "lbgr", "--eviction", "rlt", "--seed", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary.keys() >= SUMMARY_KEYS
    assert (summary["policy"], summary["eviction"], summary["seed"]) == ("lbgr", "rlt", 3)
    assert summary["completed"] == 16
    assert "simulated 16 requests" in proc.stderr
