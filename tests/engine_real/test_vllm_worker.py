"""A real vLLM CPU worker behind ``kvroute serve``: the OpenAI API, its prefix cache, its load.

The router needs nothing engine-specific for vLLM: it proxies ``/v1/completions`` and
``/v1/chat/completions`` as they are, and reads the load gauges of vLLM's ``/metrics``
(``router_service.worker_metrics``). vLLM has no ``/generate`` (SGLang's native API) and no
radix-cache backends: RLT is SGLang's only. The worker serves the same tiny model as the
SGLang tier, in vLLM's own virtualenv (``scripts/real_engine_setup.sh --vllm``).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from real_traffic import openai_answers, post_json

from kvroute.engine_launch import EngineCluster, EngineSpec
from router_service.worker_metrics import WorkerLoad, parse_load

PROMPT = "The router keeps every group of prompts on one worker and the cache warm. " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineCluster]:
    with EngineCluster(
        specs=(EngineSpec("vllm", radix_cache_backend=None),),
        log_dir=str(tmp_path_factory.mktemp("vllm")),
    ) as engines:
        engines.start_workers()
        print(f"\nvLLM worker healthy after {engines.startup_s[0]:.1f} s")
        engines.start_router("kvroute", "lbgr")
        yield engines


def _load(worker: str) -> WorkerLoad:
    with urllib.request.urlopen(worker + "/metrics", timeout=10) as resp:
        load = parse_load(resp.read().decode())
    assert load is not None, "the router found none of vLLM's load gauges in /metrics"
    return load


def test_openai_answers_through_the_router_equal_the_worker(cluster: EngineCluster) -> None:
    assert cluster.router_url is not None
    worker = cluster.worker_urls[0]
    for prompt in ("Red river stone and the blue light", "Which worker serves the queue"):
        want = openai_answers(worker, prompt)
        assert openai_answers(cluster.router_url, prompt) == want
        assert want["completions"] == want["completions stream"]
        assert want["chat"] == want["chat stream"]


def test_prefix_cache_hits_through_the_router(cluster: EngineCluster) -> None:
    """vLLM caches whole blocks (128 tokens on its CPU build): a repeated long prompt reports
    cached tokens on its second pass."""
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    cluster.flush()
    first = post_json(cluster.router_url + "/v1/completions", body)
    second = post_json(cluster.router_url + "/v1/completions", body)
    prompt_tokens = second["usage"]["prompt_tokens"]
    cached = [
        (a["usage"]["prompt_tokens_details"] or {}).get("cached_tokens") for a in (first, second)
    ]
    print(f"\nvLLM cached_tokens, first and second pass of {prompt_tokens} tokens: {cached}")
    assert cached[0] == 0
    assert cached[1] >= 128
    assert cached[1] <= prompt_tokens


def _stream(url: str, body: dict[str, Any], marks: dict[str, float]) -> None:
    """POST a streamed completion; mark when its first and its last chunk arrive."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        for line in resp:
            if line.startswith(b"data: ") and "first" not in marks:
                marks["first"] = time.monotonic()
    marks["last"] = time.monotonic()


def _covers(spans: list[tuple[float, float]], began: float, ended: float) -> bool:
    """Whether the union of ``spans`` holds all of ``[began, ended]``."""
    runs: list[list[float]] = []
    for start, end in sorted(spans):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    return any(start <= began and ended <= end for start, end in runs)


def test_covers_needs_the_spans_to_hold_the_whole_read() -> None:
    assert _covers([(0, 4), (3, 9)], 1, 8)
    assert not _covers([(0, 4), (5, 9)], 3, 6)  # a gap at 4-5
    assert not _covers([(2, 9)], 1, 3)
    assert _covers([(5, 6), (0, 2)], 0.5, 1.5)


def test_the_router_reads_vllm_load_gauges(cluster: EngineCluster) -> None:
    """The names ``worker_metrics.parse_load`` reads are the real build's: idle it reads no
    requests and a known KV figure; while requests stream through the router it reads at
    least one running or waiting, and none once all have ended."""
    worker = cluster.worker_urls[0]
    idle = _load(worker)
    assert idle.requests == 0
    assert idle.kv_tokens is not None
    # The engine surely runs a request from its first chunk to a second before its last (vLLM
    # sets its gauges every step), and a read of /metrics may take seconds on 2 busy cores
    # (as long as a whole answer, in one CI run). So streams of three lengths run and restart
    # until eight reads began after a first chunk, and a read counts if the streams' spans
    # hold all of it.
    url = cluster.router_url + "/v1/completions"
    body = {"model": "tiny-llama", "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    streams: list[tuple[threading.Thread, dict[str, float]]] = []
    running: dict[int, tuple[threading.Thread, dict[str, float]]] = {}
    reads: list[tuple[float, float, float]] = []  # (began, ended, requests)
    deadline = time.monotonic() + 180

    def streaming_reads() -> int:  # reads begun after a first chunk came back
        firsts = [m["first"] for _, m in streams if "first" in m]
        return sum(began > min(firsts) for began, _, _ in reads) if firsts else 0

    while streaming_reads() < 8 and time.monotonic() < deadline:
        for tokens in (512, 1024, 1536):
            if tokens not in running or not running[tokens][0].is_alive():
                marks: dict[str, float] = {}
                args = (url, {**body, "max_tokens": tokens}, marks)
                running[tokens] = (threading.Thread(target=_stream, args=args), marks)
                running[tokens][0].start()
                streams.append(running[tokens])
        began = time.monotonic()
        requests = _load(worker).requests
        reads.append((began, time.monotonic(), requests))
    for thread, _ in streams:
        thread.join()
    assert all("first" in m and "last" in m for _, m in streams), "a stream failed"
    spans = [(m["first"], m["last"] - 1) for _, m in streams]
    during = [n for began, ended, n in reads if _covers(spans, began, ended)]
    print(
        f"\nvLLM requests (running + waiting) in {len(during)} reads during the streams "
        f"(of {len(reads)}, {len(streams)} streams): {sorted(set(during))}"
    )
    assert during, "no read of /metrics fell inside the streams"
    assert min(during) >= 1
    deadline = time.monotonic() + 10  # the gauges follow the engine's steps
    while _load(worker).requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _load(worker).requests == 0
