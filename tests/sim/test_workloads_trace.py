"""Trace replay: Mooncake JSONL prefix structure, Azure CSV arrivals, errors with line numbers."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from workload_support import ListWorkload, real_file

from sim.ceiling import OfflineLimits
from sim.cluster import ClusterConfig, simulate
from sim.workloads import TraceWorkload, WorkloadFileError, load_azure, load_mooncake
from sim.workloads.trace import BLOCK_TOKENS


def write_trace(path: Path, rows: Sequence[tuple[float, int, int, list[int]]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids})
            + "\n"
            for t, n, o, ids in rows
        )
    )
    return path


ROWS = [
    (0, 1200, 3, [0, 1, 2]),  # its last block holds 176 tokens
    (250, 2000, 2, [0, 1, 2, 3]),  # the same first three blocks, block 2 whole this time
    (250, 600, 1, [0, 4]),  # only block 0 in common
    (900, 512, 0, [5]),  # an output of 0 is sent as 1
    (100, 1100, 5, [0, 1, 6]),  # out of order in the file: replayed in time order
]


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def test_mooncake_round_trip_rebuilds_lengths_times_and_shared_blocks(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", ROWS)
    w = load_mooncake(path, time_scale=2.0)
    assert w.name == "trace"
    assert [r.arrival_ms for r in w] == [0.0, 50.0, 125.0, 125.0, 450.0]
    assert [len(r.prompt) for r in w] == [1200, 1100, 2000, 600, 512]
    assert [r.max_new_tokens for r in w] == [3, 5, 2, 1, 1]
    assert w.hash_ids == [(0, 1, 2), (0, 1, 6), (0, 1, 2, 3), (0, 4), (5,)]
    p = [r.prompt for r in w]
    assert common_prefix(p[0], p[2]) == 1200  # the 176-token tail is block 2's beginning
    assert common_prefix(p[0], p[1]) == 2 * BLOCK_TOKENS
    assert common_prefix(p[2], p[3]) == BLOCK_TOKENS
    assert common_prefix(p[0], p[4]) == 0
    assert [r.prompt for r in load_mooncake(path, limit=2)] == p[:2]
    assert [r.prompt for r in load_mooncake(path, seed=1)] != p
    # A later window: the requests after the first ``skip`` in time, its clock from its first.
    window = load_mooncake(path, time_scale=2.0, skip=2, limit=2)
    assert [len(r.prompt) for r in window] == [2000, 600]
    assert [r.arrival_ms for r in window] == [0.0, 0.0]
    assert window.hash_ids == [(0, 1, 2, 3), (0, 4)]
    assert len(load_mooncake(path, skip=4)) == 1
    assert len(load_mooncake(path, skip=9)) == 0
    with pytest.raises(ValueError, match="skip"):
        load_mooncake(path, skip=-1)


def expected_block_hits(hash_ids: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Token hit ratio from hash_ids alone: one worker, unlimited cache, one at a time.

    A request reuses the leading blocks whose id prefix some earlier request had; a block an
    earlier request held only partly (its last block) gives only the tokens it held. As in
    SGLang, the last prompt token is recomputed: cached = min(matched, length - 1).
    """
    seen: dict[tuple[int, ...], int] = {}  # id prefix -> most tokens of its last block seen
    cached = 0
    for ids, length in zip(hash_ids, lengths, strict=True):
        sizes = [BLOCK_TOKENS] * (len(ids) - 1) + [length - BLOCK_TOKENS * (len(ids) - 1)]
        matched = 0
        for k, size in enumerate(sizes):
            held = seen.get(tuple(ids[: k + 1]))
            if held is None:
                break
            matched += min(size, held)
            if held < size:
                break
        cached += min(matched, length - 1)
        for k, size in enumerate(sizes):
            key = tuple(ids[: k + 1])
            seen[key] = max(seen.get(key, 0), size)
    return cached / sum(lengths)


def replay_alone(w: TraceWorkload) -> float:
    """Simulated hit rate: one worker, room for everything, each request after the last."""
    spaced = ListWorkload(
        [dataclasses.replace(r, arrival_ms=i * 1e7) for i, r in enumerate(w)], "trace"
    )
    room = sum(len(r.prompt) + r.max_new_tokens for r in w)
    run = simulate(ClusterConfig(workers=1, eviction="lru", capacity_tokens=room), spaced)
    assert all(r.finished_ms is not None for r in run.records)
    stats = run.workers[0].cache.stats
    return stats.cached_tokens / stats.prompt_tokens


def test_replay_reproduces_the_block_hit_ratio_of_a_small_trace(tmp_path: Path) -> None:
    w = load_mooncake(write_trace(tmp_path / "t.jsonl", ROWS))
    expected = expected_block_hits(w.hash_ids, [len(r.prompt) for r in w])
    # By hand: 0; 1024 of 1100; 1200 of 2000; 512 of 600; 0 of 512.
    assert expected == pytest.approx((1024 + 1200 + 512) / (1200 + 1100 + 2000 + 600 + 512))
    assert replay_alone(w) == pytest.approx(expected, abs=1e-12)
    assert OfflineLimits(w).ceiling().hit_rate == pytest.approx(expected, abs=1e-12)


def test_replay_reproduces_the_block_hit_ratio_of_the_real_trace() -> None:
    path = real_file("mooncake_synthetic_trace.jsonl")
    w = load_mooncake(path, limit=400)
    lines = [json.loads(x) for x in path.read_text().splitlines()[:400]]
    assert [len(r.prompt) for r in w] == [x["input_length"] for x in lines]
    expected = expected_block_hits([x["hash_ids"] for x in lines], [len(r.prompt) for r in w])
    assert expected > 0.05
    assert replay_alone(w) == pytest.approx(expected, abs=1e-12)
    assert OfflineLimits(w).ceiling().hit_rate == pytest.approx(expected, abs=1e-12)


def record(**changes: object) -> str:
    """One Mooncake line: 10 tokens in one block, with ``changes`` (None drops a field)."""
    base: dict[str, object] = {
        "timestamp": 0,
        "input_length": 10,
        "output_length": 1,
        "hash_ids": [0],
    }
    base.update(changes)
    return json.dumps({k: v for k, v in base.items() if v is not None})


@pytest.mark.parametrize(
    ("lines", "where"),
    [
        ([record(), "{"], ":2: not valid JSON"),
        ([record(hash_ids=None)], ":1: missing field 'hash_ids'"),
        (
            ["", record(input_length=600)],
            ":2: 1 hash_ids for input_length 600; expected ceil(600/512) = 2",
        ),
        ([record(timestamp=-1)], ":1: timestamp must be"),
        ([record(input_length="9")], ":1: field 'input_length' should be int"),
        ([record(hash_ids=[-3])], ":1: hash_ids must be integers >= 0"),
        ([record(input_length=0, hash_ids=[])], ":1: input_length must be >= 1"),
    ],
)
def test_malformed_mooncake_names_the_line(tmp_path: Path, lines: list[str], where: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(WorkloadFileError) as info:
        load_mooncake(path)
    assert str(info.value).startswith(str(path))
    assert where in str(info.value)


# -- Azure ----------------------------------------------------------------------------------
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,40,10
2023-11-16 18:17:04.0319600,31,0
2023-11-16 18:17:03.5000000,5,2
"""


def test_azure_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    w = load_azure(path, time_scale=0.5)
    assert w.name == "azure"
    assert [len(r.prompt) for r in w] == [5, 40, 31]
    assert [r.max_new_tokens for r in w] == [2, 10, 1]
    assert [round(r.arrival_ms, 3) for r in w] == [0.0, 959.92, 1063.92]
    assert len({r.prompt[:4] for r in w}) == 3  # no prefix data: unique prompts
    assert len(load_azure(path, limit=1)) == 1
    # A later window: the requests after the first ``skip`` in time, its clock from its first.
    window = load_azure(path, time_scale=0.5, skip=1)
    assert [len(r.prompt) for r in window] == [40, 31]
    assert [round(r.arrival_ms, 3) for r in window] == [0.0, 104.0]
    assert len(load_azure(path, skip=3)) == 0
    with pytest.raises(ValueError, match="skip"):
        load_azure(path, skip=-1)


def test_real_azure_traces_load() -> None:
    for name in (
        "azure2023_AzureLLMInferenceTrace_code.csv",
        "azure2023_AzureLLMInferenceTrace_conv.csv",
    ):
        path = real_file(name)
        with open(path, newline="") as fh:
            rows = sorted(csv.DictReader(fh), key=lambda row: row["TIMESTAMP"])[:1500]
        w = load_azure(path, limit=1500)
        assert [len(r.prompt) for r in w] == [int(row["ContextTokens"]) for row in rows]
        assert [r.max_new_tokens for r in w] == [
            max(1, int(row["GeneratedTokens"])) for row in rows
        ]
        arrivals = [r.arrival_ms for r in w]
        assert arrivals[0] == 0.0
        assert arrivals == sorted(arrivals)
        assert arrivals[-1] > 0


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("TIME,ContextTokens,GeneratedTokens\n", ":1: expected the header"),
        ("", ":1: expected the header"),
        (AZURE + "2023-11-16 18:17:05,4\n", ":5: expected 3 comma-separated values"),
        (AZURE + "\nyesterday,4,5\n", ":6: bad TIMESTAMP 'yesterday'"),
        (AZURE + "2023-11-16 18:17:05,4.5,5\n", ":5: token counts must be integers"),
        (AZURE + "2023-11-16 18:17:05,0,5\n", ":5: ContextTokens must be >= 1"),
    ],
)
def test_malformed_azure_names_the_line(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(WorkloadFileError) as info:
        load_azure(path)
    assert where in str(info.value)


@pytest.mark.parametrize("loader", [load_mooncake, load_azure])
def test_bad_scale_or_limit_is_refused(loader: object, tmp_path: Path) -> None:
    for kwargs in ({"time_scale": 0.0}, {"time_scale": math.inf}, {"limit": 0}):
        with pytest.raises(ValueError, match="must be"):
            loader(tmp_path / "unused", **kwargs)  # type: ignore[operator]
