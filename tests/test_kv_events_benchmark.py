"""What ``benchmarks/kv_events.py`` replays on its emulated workers (the runs themselves are
the benchmark's: real processes, minutes each)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kv_events

from sim.profiles import get_profile
from sim.workloads import load_mooncake


def test_the_emulated_gsp_run_fits_its_small_pools() -> None:
    items, capacity = kv_events.emulated_workload("gsp", quick=True)
    assert capacity == 60_000
    assert len(items) == 16 * 8
    assert max(len(r.prompt) + 1 for r in items) <= capacity


def test_the_emulated_mooncake_run_is_the_start_of_the_last_window_on_the_l40s_pools() -> None:
    if not kv_events.TRACE.is_file():
        pytest.skip(f"{kv_events.TRACE} is not here (real data a clone does not include)")
    items, capacity = kv_events.emulated_workload("mooncake", quick=True)
    assert capacity == get_profile("llama3.1-8b-l40").kv_capacity_tokens
    window = load_mooncake(str(kv_events.TRACE), time_scale=0.22, limit=100, skip=3000)
    fits = [r for r in window if len(r.prompt) + r.max_new_tokens <= capacity]
    assert [r.prompt for r in items] == [r.prompt for r in fits]
    assert [r.arrival_ms for r in items] == [r.arrival_ms for r in fits]
    assert all(len(r.prompt) + r.max_new_tokens <= capacity for r in items)
    assert len(items) > 90  # a few prompts too large for one worker, at most
