"""Every workload through ``kvroute sim``; bad files and flags are usage errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvroute.cli import main

FLEET = ["--workers", "2", "--no-progress", "--policy", "lbgr", "--eviction", "rlt"]
TRACE_LINES = [
    {"timestamp": 0, "input_length": 700, "output_length": 2, "hash_ids": [0, 1]},
    {"timestamp": 400, "input_length": 900, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 1000, "input_length": 300, "output_length": 1, "hash_ids": [2]},
]
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.00,50,3\n"


def sim_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["sim", *FLEET, *argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| policy | eviction |")
    parsed: dict[str, Any] = json.loads(out[-1])
    return parsed


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvroute")
    return err


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in TRACE_LINES))
    return path


@pytest.mark.parametrize(
    ("argv", "workload", "requests"),
    [
        ("--workload multiturn --clients 3 --turns 2,1 --user-len 40", "multiturn", 5),
        ("--workload longdoc --docs 3 --questions-per-doc 2 --doc-lens 64,128", "longdoc", 6),
        # ceil(1.1 x 2000 / (100 + 4 - 1)) = 22 prompts, twice
        (
            "--workload cyclic --cyclic-capacity 2000 --cyclic-prompt-len 100 --cyclic-cycles 2",
            "cyclic",
            44,
        ),
        ("--workload gsp --gsp-groups 2 --gsp-prompts-per-group 2 --gsp-lens 32", "gsp", 4),
    ],
)
def test_generated_workloads_run(
    capsys: pytest.CaptureFixture[str], argv: str, workload: str, requests: int
) -> None:
    summary = sim_json(capsys, *argv.split())
    assert summary["workload"] == workload
    assert (summary["requests"], summary["completed"], summary["failed"]) == (requests, requests, 0)
    assert ("order" in summary) == (workload in ("gsp", "longdoc"))


def test_trace_replay_with_time_scale_and_cap(
    capsys: pytest.CaptureFixture[str], trace_file: Path
) -> None:
    argv = ["--workload", "trace", "--trace", str(trace_file), "--time-scale", "4"]
    summary = sim_json(capsys, *argv)
    assert (summary["workload"], summary["time_scale"]) == ("trace", 4.0)
    assert summary["completed"] == 3
    assert summary["trace"] == str(trace_file)
    assert "rate" not in summary
    assert sim_json(capsys, *argv, "--requests", "2")["requests"] == 2


def test_azure_replay(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    summary = sim_json(capsys, "--workload", "azure", "--trace", str(path))
    assert (summary["workload"], summary["completed"], summary["hit_rate"]) == ("azure", 1, 0.0)


def test_multiturn_from_a_sharegpt_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    chat = [{"from": "human", "value": "hi there"}, {"from": "human", "value": "and again"}]
    path.write_text(json.dumps([{"id": "x", "conversations": chat}]))
    argv = ["--workload", "multiturn", "--dataset", str(path), "--clients", "2", "--turns", "2"]
    summary = sim_json(capsys, *argv, "--user-len", "20")
    assert (summary["dataset"], summary["completed"]) == (str(path), 4)


def test_ceiling_columns(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "cyclic", "--cyclic-capacity", "3000", "--cyclic-prompt-len", "200"]
    fleet = sim_json(capsys, *argv, "--ceiling")
    assert 0 < fleet["hit_rate"] <= fleet["ceiling_hit_rate"]
    assert "offline_bound_hit_rate" not in fleet
    one = [*argv, "--capacity-tokens", "3000", "--workers", "1", "--eviction", "lru", "rlt"]
    rows = sim_json(capsys, *one, "--ceiling")["rows"]
    for row in rows:
        assert row["hit_rate"] <= row["offline_bound_hit_rate"] <= row["ceiling_hit_rate"]
    assert rows[0]["hit_rate"] == 0.0  # lru on the cyclic worst case


def test_malformed_trace_is_a_usage_error_naming_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TRACE_LINES[0]) + "\n{oops\n")
    err = usage_error(capsys, "sim", "--workload", "trace", "--trace", str(path))
    assert f"{path}:2: not valid JSON" in err
    bench = ["bench", "--url", "http://127.0.0.1:9", "--workload", "trace", "--trace", str(path)]
    err = usage_error(capsys, *bench)
    assert f"{path}:2: not valid JSON" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "trace"], "--workload trace needs --trace PATH"),
        (["--workload", "azure"], "--workload azure needs --trace PATH"),
        (["--trace", "x.jsonl"], "--trace is for --workload trace or azure"),
        (["--dataset", "x.json"], "--dataset is for --workload multiturn or longdoc"),
        (["--workload", "multiturn", "--dataset", "/nonexistent/x.json"], "cannot read"),
        (
            ["--workload", "multiturn", "--user-len", "100", "--capacity-tokens", "500"],
            "at least the longest prompt",
        ),
        (["--workload", "multiturn", "--turns", "2,0"], "values must be >= 1"),
        (["--workload", "nope"], "argument --workload: invalid choice"),
        (["--time-scale", "0"], "argument --time-scale: must be > 0"),
    ],
)
def test_bad_workload_flags_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in usage_error(capsys, "sim", *FLEET, *argv)
