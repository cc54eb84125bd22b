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


def test_the_router_reads_vllm_load_gauges(cluster: EngineCluster) -> None:
    """The names ``worker_metrics.parse_load`` reads are the real build's: idle it reads no
    requests and a known KV figure; while a request streams through the router it reads at
    least one running or waiting, and none once all have ended."""
    worker = cluster.worker_urls[0]
    idle = _load(worker)
    assert idle.requests == 0
    assert idle.kv_tokens is not None
    # A read of /metrics can take seconds on 2 busy cores, so a read counts only if some
    # stream had its first chunk before the read began and its last a second after it ended:
    # the engine ran that request for the whole read (vLLM sets its gauges every step).
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": 2048,
        "temperature": 0,
        "ignore_eos": True,
    }
    marks: list[dict[str, float]] = [{} for _ in range(4)]
    senders = [
        threading.Thread(target=_stream, args=(cluster.router_url + "/v1/completions", body, m))
        for m in marks
    ]
    for t in senders:
        t.start()
    reads: list[tuple[float, float, float]] = []  # (began, ended, requests)
    while any(t.is_alive() for t in senders):
        began = time.monotonic()
        requests = _load(worker).requests
        reads.append((began, time.monotonic(), requests))
    for t in senders:
        t.join()
    assert all("last" in m for m in marks), "a stream through the router failed"
    during = [
        n
        for began, ended, n in reads
        if any(m.get("first", ended) < began and m["last"] > ended + 1 for m in marks)
    ]
    print(
        f"\nvLLM requests (running + waiting) in {len(during)} reads during the streams "
        f"(of {len(reads)}): {sorted(set(during))}"
    )
    assert during, "no read of /metrics fell inside a stream: the streams are too short"
    assert min(during) >= 1
    deadline = time.monotonic() + 10  # the gauges follow the engine's steps
    while _load(worker).requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _load(worker).requests == 0
