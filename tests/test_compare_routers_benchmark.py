"""``benchmarks/compare_routers.py --workload trace``: a tiny Mooncake-format replay through
the real harness (emulated workers, ``kvroute serve``, sglang-router, the simulator).

The trace is written here so that its hit rate is known in advance: every prompt is a shared
2,048-token prefix (4 blocks) and one block of its own, two seconds apart, so each request
has finished before the next arrives and, whatever the routing, a worker misses the prefix at
most once. With 10 accepted requests on 2 workers the hit rate read from the workers is
between 8 and 9 prefixes in 10 prompts. One request needs more KV than a worker holds: every
row must count it as rejected, and nothing else as failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compare_routers
from _common import format_ratio

BLOCK = 512
SHARED = [1, 2, 3, 4]  # hash ids of the prefix every small request shares
SMALL = 10
CAPACITY = 32_768
WORKERS = 2
PROMPT = (len(SHARED) + 1) * BLOCK
HIT_LOW = (SMALL - WORKERS) * len(SHARED) * BLOCK / (SMALL * PROMPT)
HIT_HIGH = (SMALL - 1) * len(SHARED) * BLOCK / (SMALL * PROMPT)
HUGE_BLOCKS = 70  # 35,840 tokens > CAPACITY
ROWS = ["sglang-router cache_aware+lru", "kvroute lbgr+rlt", "kvroute lbgr_paper+rlt"]


def line(at_ms: int, hash_ids: list[int]) -> str:
    tokens = len(hash_ids) * BLOCK
    fields = {"timestamp": at_ms, "input_length": tokens, "output_length": 4}
    return json.dumps({**fields, "hash_ids": hash_ids}) + "\n"


def write_trace(path: Path) -> None:
    """The small requests two seconds apart; the huge one at 5 s, between two of them."""
    lines = [line(2000 * i, [*SHARED, 100 + i]) for i in range(SMALL)]
    lines.insert(3, line(5000, list(range(1000, 1000 + HUGE_BLOCKS))))
    path.write_text("".join(lines))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("sglang_router")
    tmp = tmp_path_factory.mktemp("compare_routers")
    trace, out = tmp / "trace.jsonl", tmp / "run.json"
    write_trace(trace)
    argv = ["--workload", "trace", "--trace", str(trace), "--trace-time-scale", "1"]
    argv += ["--time-scale", "10", "--workers", str(WORKERS), "--capacity-tokens", str(CAPACITY)]
    argv += ["--sim", "--out", str(out)]
    assert compare_routers.main(argv) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


@pytest.mark.slow
def test_the_trace_rows_run_over_http_and_in_the_simulator(run: dict[str, Any]) -> None:
    assert run["workload"]["name"] == "trace"
    assert run["workload"]["requests"] == SMALL + 1
    assert run["too_large_requests"] == 1
    rows = run["rows"]
    assert [(r["mode"], r["label"].removeprefix("sim: ")) for r in rows] == [
        *(("http", label) for label in ROWS),
        *(("sim", label) for label in ROWS),
    ]
    for row in rows:
        assert row["status"] == "ok (too large rejected)", row
        assert row["requests"] == SMALL + 1
        assert (row["completed"], row["failed"], row["rejected"]) == (SMALL, 1, 1), row
        assert HIT_LOW <= row["hit_rate"] <= HIT_HIGH, row


@pytest.mark.slow
def test_the_hit_rate_is_read_from_the_workers_of_the_run(run: dict[str, Any]) -> None:
    for row in (r for r in run["rows"] if r["mode"] == "http"):
        workers = row["per_worker"]
        assert len({w["worker"] for w in workers}) == WORKERS
        assert all(w["worker"].startswith("http://127.0.0.1:") for w in workers)
        # the warm-up request is not counted, nor the refused one: only this run's 10
        assert sum(w["requests"] for w in workers) == SMALL, row
        assert row["harness_cores"] > 0


@pytest.mark.slow
def test_p50_ratios_are_to_sglang_router_of_the_same_kind(run: dict[str, Any]) -> None:
    rows = run["rows"]
    for mode in ("http", "sim"):
        base = next(r for r in rows if r["mode"] == mode and r["router"] == "sglang-router")
        assert base["p50_latency_vs_baseline"] == base["p50_ttft_vs_baseline"] == "1.00x"
        for row in (r for r in rows if r["mode"] == mode):
            expected = format_ratio(row["p50_latency_s"], base["p50_latency_s"])
            assert row["p50_latency_vs_baseline"] == expected


def test_the_default_trace_rows_pair_each_router_with_its_own_eviction() -> None:
    picked = [
        s.label
        for ev in compare_routers.EVICTIONS
        for s in compare_routers.row_specs(ev, compare_routers.TRACE_ROWS)
    ]
    assert picked == ROWS  # not "kvroute lbgr (hold queue)+rlt", nor lbgr_paper under lbgr
