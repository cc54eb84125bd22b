"""``/metrics``: every metric the metrics module documents, with values that follow traffic."""

from __future__ import annotations

import re
from collections.abc import Callable

from fake_worker import FakeWorker
from prometheus_client.parser import text_string_to_metric_families
from router_harness import RouterServer

import router_service.metrics

# The documented names are the contract: parse them out of the module's docstring.
DOCUMENTED = set(re.findall(r"``(kvroute_\w+)``", router_service.metrics.__doc__ or ""))


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_documented_metrics_are_exposed_after_traffic(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    assert len(DOCUMENTED) >= 15
    a, b = workers("a"), workers("b")
    # A margin no cost difference beats, with the paper's tie rule, keeps lbgr on the first
    # worker: the learned factors of two idle workers differ by the noise of the machine's
    # timing, not by their load.
    params = {"margin_ms": 1e9, "ties": "first"}
    router = routers(worker_urls=[a.url, b.url], policy="lbgr", policy_params=params)
    router.control.post("/models/challenger", json={"spec": "linear"})
    prompt = "metrics prompt " * 4
    for i in range(3):
        assert router.client.post("/generate", json={"text": prompt + str(i)}).status_code == 200
    router.client.post("/generate", json={"text": prompt + "3", "stream": True}).read()
    resp = router.control.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    exposed = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    exposed |= {name + "_total" for name in exposed}  # counters are typed without the suffix
    missing = DOCUMENTED - exposed
    assert not missing, missing

    samples = _samples(text)
    ok = sum(
        v
        for (name, labels), v in samples.items()
        if name == "kvroute_requests_total" and ("status", "ok") in labels
    )
    assert ok == 4
    chosen = a.url
    labels = (("policy", "lbgr"), ("status", "ok"), ("worker", chosen))
    assert samples[("kvroute_requests_total", labels)] == 4
    assert samples[("kvroute_decision_seconds_count", (("policy", "lbgr"),))] == 4
    assert samples[("kvroute_latency_seconds_count", (("worker", chosen),))] == 4
    assert samples[("kvroute_ttft_seconds_count", (("worker", chosen),))] == 4
    units = samples[("kvroute_prompt_units_total", (("worker", chosen),))]
    cached = samples[("kvroute_cached_units_total", (("worker", chosen),))]
    assert units == 4 * (len(prompt) + 1)
    assert cached == 3 * len(prompt)  # later requests matched the first one's prefix
    assert samples[("kvroute_cache_hit_ratio_estimate", (("worker", chosen),))] == cached / units
    assert samples[("kvroute_worker_healthy", (("worker", b.url),))] == 1.0
    assert samples[("kvroute_in_flight", (("worker", chosen),))] == 0.0
    assert samples[("kvroute_index_units", (("worker", chosen),))] > 0
    assert samples[("kvroute_model_version", ())] == 1.0
    assert samples[("kvroute_redis_fallbacks_total", ())] == 0.0
    assert samples[("kvroute_redis_connected", ())] == 0.0  # embedded store
    roles = {
        dict(labels).get("role") for (name, labels) in samples if name == "kvroute_residual_mae_ms"
    }
    assert roles == {"champion", "challenger"}
    # lbgr's default ratio learned a latency factor for the worker that served the requests.
    assert (
        "kvroute_residual_learned",
        (("quantity", "factor"), ("role", "champion"), ("worker", chosen)),
    ) in samples


def test_failed_requests_are_counted_by_status(
    routers: Callable[..., RouterServer], workers: Callable[..., FakeWorker]
) -> None:
    worker = workers("picky")
    worker.fail_status = 500
    router = routers(worker_urls=[worker.url], policy="round_robin")
    assert router.client.post("/generate", json={"text": "x"}).status_code == 500
    samples = _samples(router.control.get("/metrics").text)
    labels = (("policy", "round_robin"), ("status", "http_500"), ("worker", worker.url))
    assert samples[("kvroute_requests_total", labels)] == 1
