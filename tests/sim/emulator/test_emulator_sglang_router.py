"""The real sglang-router (PyPI ``sglang-router==0.3.2``) drives our emulated workers.

Two ``kvroute emulate`` processes and ``python -m sglang_router.launch_router --policy
cache_aware`` in front of them, all started by ``LocalCluster`` on free loopback ports.
sglang-router 0.3.2 routes ``/generate`` bodies that carry only ``input_ids`` on the ids
written as decimal text joined by spaces (``GenerateRequest::extract_text_for_routing``), so
its character tree still sees token prefixes; the last test checks that on a worker's hits.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from sim.local_cluster import LocalCluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang-router is not installed (the dev extra pins sglang-router==0.3.2)",
    ),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(workers=2, eviction="lru", time_scale=20.0) as local:
        local.start_workers()
        local.start_router("sglang-router", "cache_aware")
        yield local


def post(url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    """POST JSON (sglang-router needs the Content-Type); returns status, type, body text."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()


def test_router_is_healthy_with_both_workers(cluster: LocalCluster) -> None:
    assert cluster.router_url is not None
    with urllib.request.urlopen(cluster.router_url + "/health", timeout=10) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(cluster.router_url + "/workers", timeout=10) as resp:
        listed = json.loads(resp.read())["workers"]
    assert sorted(w["url"] for w in listed) == sorted(cluster.worker_urls)
    assert all(w["is_healthy"] for w in listed)


def test_generate_through_sglang_router(cluster: LocalCluster) -> None:
    status, _, text = post(
        f"{cluster.router_url}/generate",
        {"text": "Hello from sglang-router", "sampling_params": {"max_new_tokens": 3}},
    )
    assert status == 200
    body = json.loads(text)
    assert body["text"] == " tok0 tok1 tok2"
    assert body["meta_info"]["completion_tokens"] == 3


def test_generate_streams_through_sglang_router(cluster: LocalCluster) -> None:
    status, content_type, text = post(
        f"{cluster.router_url}/generate",
        {
            "input_ids": list(range(300, 364)),
            "stream": True,
            "sampling_params": {"max_new_tokens": 4},
        },
    )
    assert status == 200
    assert content_type.startswith("text/event-stream")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert chunks[-1]["meta_info"]["prompt_tokens"] == 64


def running(cluster: LocalCluster) -> int:
    total = 0
    for url in cluster.worker_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("sglang:num_running_reqs"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def test_cache_aware_follows_an_input_ids_prefix_to_a_busy_worker(cluster: LocalCluster) -> None:
    """A request carrying only ``input_ids`` goes where its prefix is, not where load is least.

    A long request with prefix P runs on one worker; a second request with P arrives while
    the first decodes. Least-load routing (or routing on an empty text) would send it to the
    idle worker and miss; sglang-router's cache_aware matches P and the worker reports a hit.
    """
    cluster.flush()
    prefix = list(range(20_000, 20_200))
    long_body = {
        "input_ids": [*prefix, *range(30_000, 30_050)],
        "sampling_params": {"max_new_tokens": 400},
    }
    first = threading.Thread(target=post, args=(f"{cluster.router_url}/generate", long_body))
    first.start()
    try:
        deadline = time.monotonic() + 10
        while running(cluster) == 0:
            assert time.monotonic() < deadline, "the first request never started decoding"
            time.sleep(0.01)
        status, _, text = post(
            f"{cluster.router_url}/generate",
            {
                "input_ids": [*prefix, *range(40_000, 40_050)],
                "sampling_params": {"max_new_tokens": 2},
            },
        )
        assert running(cluster) == 1, "the first request finished too early to tell"
    finally:
        first.join(30)
    assert status == 200
    assert json.loads(text)["meta_info"]["cached_tokens"] == 200
