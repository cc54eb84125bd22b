"""The emulated worker's prefix cache, as seen over HTTP: counters, flush, time scaling.

Prompts are sent as ``input_ids`` so the expected matches can be worked out by hand. SGLang
recomputes the last prompt token even on a full hit, so a request's cached tokens are
``min(longest cached prefix, prompt length - 1)``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from emulator_server import EmulatorServer

from sim.emulator.runtime import EmulatedRuntime
from sim.loadgen import BenchConfig, _payload
from sim.profiles import get_profile
from sim.text import render_text
from sim.tokens import ids_to_key
from sim.workloads.base import WorkloadRequest

PREFIX = list(range(1000, 1100))  # 100 tokens shared by A and B
A = PREFIX + list(range(5000, 5020))  # 120 tokens
B = PREFIX + list(range(6000, 6030))  # 130 tokens, diverges from A right after PREFIX


def generate(server: EmulatorServer, ids: list[int], max_new: int = 2) -> dict[str, Any]:
    status, body = server.post(
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}}
    )
    assert status == 200, body
    meta: dict[str, Any] = body["meta_info"]
    return meta


def test_hit_counters_match_the_reference_cache(
    emulator: Callable[..., EmulatorServer],
) -> None:
    server = emulator(time_scale=50.0)
    before = server.metrics()
    assert before["sglang:prompt_tokens_total"] == 0
    # (prompt, expected cached tokens), sent one after another on an idle worker.
    plan = [
        (A, 0),  # empty cache
        (B, 100),  # shares PREFIX with A
        (A, 119),  # full hit, but the last token is recomputed
        (PREFIX[:50], 49),  # a prefix of what is cached: again all but the last token
        (list(range(9000, 9040)), 0),  # nothing in common
    ]
    for ids, expected in plan:
        meta = generate(server, ids)
        assert meta["prompt_tokens"] == len(ids)
        assert meta["cached_tokens"] == expected, ids[:3]
    after = server.metrics()
    assert after["sglang:prompt_tokens_total"] == sum(len(ids) for ids, _ in plan)
    assert after["sglang:cached_tokens_total"] == sum(expected for _, expected in plan)
    assert after["sglang:num_requests_total"] == len(plan)
    assert after["sglang:generation_tokens_total"] == 2 * len(plan)
    assert after["sglang:cache_hit_rate"] == pytest.approx(
        after["sglang:cached_tokens_total"] / after["sglang:prompt_tokens_total"]
    )


def test_flush_cache_empties_it(emulator: Callable[..., EmulatorServer]) -> None:
    server = emulator(time_scale=50.0)
    generate(server, A)
    assert generate(server, A)["cached_tokens"] == 119
    assert server.metrics()["kvroute_emulator_tree_tokens"] > 0
    assert server.metrics()["sglang:num_used_tokens"] == 0  # nothing is running
    status, text = server.post("/flush_cache", {})
    assert status == 200, text
    assert server.metrics()["kvroute_emulator_tree_tokens"] == 0
    assert generate(server, A)["cached_tokens"] == 0
    # Counters are cumulative (Prometheus counters never go down on a flush).
    assert server.metrics()["sglang:cached_tokens_total"] == 119


def test_flush_is_refused_while_a_request_runs(emulator: Callable[..., EmulatorServer]) -> None:
    """SGLang refuses to flush with requests in flight; so does the emulator."""
    server = emulator(time_scale=1.0)
    # ~40 decode steps of ~26 ms: about a second of wall time at scale 1.
    worker = threading.Thread(target=generate, args=(server, A, 40))
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while server.metrics()["sglang:num_running_reqs"] == 0:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.01)
        status, text = server.post("/flush_cache", {})
        assert status == 400
        assert "running" in text
    finally:
        worker.join(30)
    assert server.post("/flush_cache", {})[0] == 200


def emulated_ms(prompt_tokens: int, max_new: int) -> float:
    """The service model's time for one request alone on an idle worker with a cold cache."""
    profile = get_profile("llama3.1-8b-l40")
    total = profile.request_overhead_ms + profile.prefill_ms([(prompt_tokens, 0)])
    for produced in range(1, max_new):  # the prefill pass yields the first token
        total += profile.decode_ms(prompt_tokens + produced, 1)
    return total


def test_time_scaling_keeps_emulated_durations(emulator: Callable[..., EmulatorServer]) -> None:
    """The same request takes the same emulated time at 5x and 20x, in 1/5 and 1/20 the wall.

    ``meta_info.e2e_latency`` is in emulated seconds. Sleeping can only overrun, and each
    overrun is multiplied by the scale, so the bounds are one-sided-tight, generous above.
    """
    ids, max_new = list(range(10, 2010)), 12
    model_s = emulated_ms(len(ids), max_new) / 1000.0  # ~0.53 s
    e2e_s, wall_s = {}, {}
    for scale in (5.0, 20.0):
        server = emulator(time_scale=scale)
        started = time.perf_counter()
        e2e_s[scale] = generate(server, ids, max_new)["e2e_latency"]
        wall_s[scale] = time.perf_counter() - started
    for scale, value in e2e_s.items():
        assert 0.97 * model_s <= value <= 1.5 * model_s, (scale, value, model_s)
    assert e2e_s[20.0] == pytest.approx(e2e_s[5.0], rel=0.3)
    # Ideally 4x; HTTP and event-loop overheads do not shrink with the scale.
    assert wall_s[5.0] > 2.0 * wall_s[20.0], wall_s
    assert wall_s[5.0] >= 0.97 * model_s / 5.0


@pytest.mark.parametrize(
    ("spent_ms", "slept_ms"),
    [(0.0, 2.5), (1.0, 1.5), (2.5, 0.0), (40.0, 0.0)],
)
def test_the_request_overhead_counts_the_time_already_spent_on_the_request(
    monkeypatch: pytest.MonkeyPatch, spent_ms: float, slept_ms: float
) -> None:
    """The modelled 5 ms (at 2x: 2.5 ms of wall time) is charged once: the wall time the worker
    spent reading and parsing the request is part of it, and only the rest is slept."""
    runtime = EmulatedRuntime(get_profile("llama3.1-8b-l40"), "lru", 1000, time_scale=2.0)
    assert runtime.profile.request_overhead_ms == 5.0
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    asyncio.run(runtime.overhead(spent_s=spent_ms / 1000.0))
    assert slept == [pytest.approx(slept_ms / 1000.0)]


def test_text_prompts_from_sim_text_hit_as_their_token_ids_do(
    emulator: Callable[..., EmulatorServer],
) -> None:
    """``kvroute bench --prompt-format text`` (sim.loadgen): the emulated worker tokenises
    the text back into as many tokens, with the same shared prefix."""
    server = emulator(time_scale=50.0)
    config = BenchConfig("http://unused", prompt_format="text")
    for ids, expected in ((A, 0), (B, 100), (A, 119)):
        item = WorkloadRequest("r", 0.0, ids_to_key(ids), 2)
        payload = _payload(item, config)
        assert payload["text"] == render_text(item.prompt)
        assert "input_ids" not in payload
        status, body = server.post("/generate", {**payload, "stream": False})
        assert status == 200, body
        assert body["meta_info"]["prompt_tokens"] == len(ids)
        assert body["meta_info"]["cached_tokens"] == expected
    completions = _payload(
        item, BenchConfig("http://unused", api="completions", prompt_format="text")
    )
    assert completions["prompt"] == render_text(item.prompt)
