"""``kvroute cluster``: workers, router, traffic and a table in one command; nothing left over."""

from __future__ import annotations

import json
import os
import socket
from urllib.parse import urlsplit

import pytest
from contracts import SUMMARY_KEYS

from kvroute.cli import main


def children() -> set[int]:
    """Live child processes of this process (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(entry))
    return found


def refuses_connections(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1):
            return False
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts child processes through /proc")
def test_cluster_prints_the_table_and_json_and_stops_every_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = children()
    code = main(
        [
            "cluster",
            "--workers",
            "2",
            "--policy",
            "lbgr",
            "--eviction",
            "lru",
            "--gsp-groups",
            "3",
            "--gsp-prompts-per-group",
            "4",
            "--gsp-lens",
            "128,256",
            "--rate",
            "10",
            "--time-scale",
            "5",
            "--json",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].startswith("| policy | eviction | hit rate | p50 lat (s) |")
    assert out[2].startswith("| lbgr | lru | ")
    rows = json.loads(out[-1])["rows"]
    assert len(rows) == 1
    row = rows[0]
    assert set(row) >= SUMMARY_KEYS
    assert (row["policy"], row["eviction"], row["workers"]) == ("lbgr", "lru", 2)
    assert (row["requests"], row["completed"], row["failed"]) == (12, 12, 0)
    assert 0.0 < row["hit_rate"] < 1.0  # groups share prefixes; lbgr follows them
    assert row["p50_latency_s"] > 0
    urls = [w["worker"] for w in row["per_worker"]]
    assert sum(w["requests"] for w in row["per_worker"]) == 12

    # The /explain sample: a per-worker table between its heading and the JSON line, in
    # emulated seconds, the chosen worker marked; the same decision is in the JSON.
    explain = json.loads(out[-1])["explain"]
    assert explain["policy"] == "lbgr"
    names = [c["worker"] for c in explain["candidates"]]  # labels, or URLs if exposed
    assert len(names) == len(urls) == 2
    start = next(i for i, line in enumerate(out) if line.startswith("/explain for the first"))
    table = out[start + 1 : -1]
    assert table[0].startswith(f"decision {explain['decision_id']}: policy lbgr")
    assert table[1].split() == [
        "worker", "cached", "uncached", "base", "queue", "residual", "predicted", "impact",
        "cost", "in", "flight", "eligible",
    ]  # fmt: skip
    rows = {line.split()[-11]: line for line in table[2:4]}  # all eligible: "yes" is last
    assert sorted(rows) == sorted(names)
    assert rows[explain["chosen"]].lstrip().startswith("* ")
    assert table[4] == "times in emulated seconds; what each column means: docs/explain.md"
    for candidate in explain["candidates"]:  # seconds, 3 decimals: no 1.55e-13
        cells = rows[candidate["worker"]].split()
        assert cells[-8] == f"{candidate['base_ms'] / 1000:.3f}"
        assert "e-" not in rows[candidate["worker"]]

    assert children() == before, "kvroute cluster left child processes running"
    assert all(refuses_connections(url) for url in urls)
