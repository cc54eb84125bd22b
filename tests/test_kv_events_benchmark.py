"""What ``benchmarks/kv_events.py`` replays on its emulated workers (the runs themselves are
the benchmark's: real processes, minutes each)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kv_events

from engine_ext.cache import RadixCache
from sim.engine import EngineRequest, WorkerEngine
from sim.profiles import get_profile
from sim.tokens import ids_to_key
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


def _worker_with(
    cached: list[str], queued: list[tuple[str, int]], running: str | None = None
) -> SimpleNamespace:
    """A 100-token LRU worker that cached ``cached`` prompts, is decoding ``running`` (its
    prompt locked, 20 output tokens reserved), and queued ``queued``."""
    eng = WorkerEngine(get_profile("llama3.1-8b-l40"), RadixCache(100, "lru"))
    for i, prompt in enumerate(cached):
        eng.submit(EngineRequest(f"c{i}", prompt, max_new_tokens=1), now_ms=0)
        while (step := eng.plan_step(0.0)) is not None:
            eng.finish_step(step, 0.0)
    if running is not None:
        eng.submit(EngineRequest("running", running, max_new_tokens=20), now_ms=0)
        step = eng.plan_step(0.0)
        assert step is not None
        assert step.kind == "prefill"
        eng.finish_step(step, 0.0)
    for i, (prompt, new) in enumerate(queued):
        eng.waiting.append(EngineRequest(f"q{i}", prompt, max_new_tokens=new))
    return SimpleNamespace(engine=eng)


def test_foresight_replays_the_queue_ahead_on_a_copy_of_the_cache() -> None:
    shared, other = ids_to_key(list(range(20))), ids_to_key(list(range(500, 580)))
    req = EngineRequest("r", shared + ids_to_key(list(range(300, 310))), max_new_tokens=1)
    # The request queued ahead needs 85 of the 80 free tokens: its admission evicts the
    # shared prompt the request would have found.
    worker = _worker_with([shared], [(other, 5)])
    assert kv_events.foresight(worker, req) == (20, 0)  # type: ignore[arg-type]
    assert worker.engine.cache.peek_prefix(req.prompt) == 20  # the worker's own cache: untouched
    # Ahead of it, a request on the same prefix locks it: it survives.
    worker = _worker_with([shared], [(shared + other[:60], 5)])
    assert kv_events.foresight(worker, req) == (20, 20)  # type: ignore[arg-type]
    # One that cannot be admitted before a request leaves ends the replay (FCFS): 85 tokens
    # where 20 are free and 20 evictable beside the running request's 60.
    worker = _worker_with([shared], [(other, 5)], running=ids_to_key(list(range(700, 740))))
    assert worker.engine.cache.available_tokens == 20
    assert kv_events.foresight(worker, req) == (20, 20)  # type: ignore[arg-type]
