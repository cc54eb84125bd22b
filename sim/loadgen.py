"""An open-loop load generator for any SGLang/OpenAI-compatible endpoint (``kvroute bench``).

Requests leave at their workload arrival times (Poisson, or a trace's timestamps) whatever
the server does, so a slow server builds a queue instead of slowing the offered load. Every
request streams (SSE) so the time to first token is measured. The hit rate is read from the
workers' ``/metrics`` (``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total``, the
paper's method), so it works the same with real SGLang workers. With ``time_scale`` X (for
emulated workers running X times faster) arrivals are compressed X times and latencies are
reported in emulated seconds (multiplied by X).

Prompts go as token ids (``prompt_format="ids"``), or as their text (``"text"``,
``sim.text``: the emulated worker tokenises it back into as many tokens), so that a router
matches characters, as SGLang's router did on the paper's text prompts.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

from engine_ext.cache.keys import key_to_ids
from sim.text import render_text
from sim.workloads.base import WorkloadRequest

__all__ = ["BenchConfig", "RequestResult", "run_bench", "scrape_worker_metrics", "summarize_bench"]

_METRICS = ("sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:num_requests_total")


@dataclass(frozen=True)
class BenchConfig:
    url: str
    api: str = "generate"  # generate | completions
    model: str = "default"
    time_scale: float = 1.0
    timeout_s: float = 600.0
    worker_urls: Sequence[str] = ()
    headers: dict[str, str] = field(default_factory=dict)
    prompt_format: str = "ids"  # ids | text (module docstring)


@dataclass
class RequestResult:
    rid: str
    arrival_s: float
    prompt_tokens: int
    status: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    worker: str | None = None
    decision_id: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.latency_s is not None


def _payload(item: WorkloadRequest, config: BenchConfig) -> dict[str, Any]:
    text = config.prompt_format == "text"
    prompt: Any = render_text(item.prompt) if text else key_to_ids(item.prompt)
    if config.api == "completions":
        return {
            "model": config.model,
            "prompt": prompt,
            "max_tokens": item.max_new_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    return {
        "text" if text else "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": item.max_new_tokens, "ignore_eos": True},
    }


async def _one(
    session: aiohttp.ClientSession, item: WorkloadRequest, config: BenchConfig, t0: float
) -> RequestResult:
    scale = config.time_scale
    result = RequestResult(item.rid, item.arrival_ms / 1000.0, len(item.prompt))
    path = "/v1/completions" if config.api == "completions" else "/generate"
    started = time.perf_counter()
    try:
        async with session.post(
            config.url + path,
            json=_payload(item, config),
            headers=config.headers,
            timeout=aiohttp.ClientTimeout(total=config.timeout_s),
        ) as resp:
            result.status = resp.status
            result.worker = resp.headers.get("X-KVRoute-Worker")
            result.decision_id = resp.headers.get("X-KVRoute-Decision-Id")
            async for chunk in resp.content.iter_any():
                if result.ttft_s is None and chunk.strip():
                    result.ttft_s = (time.perf_counter() - started) * scale
                if b'"error"' in chunk and resp.status == 200:
                    result.error = chunk.decode(errors="replace")[:200]
            if resp.status != 200:
                result.error = f"HTTP {resp.status}"
            else:
                result.latency_s = (time.perf_counter() - started) * scale
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


async def run_bench(
    workload: Sequence[WorkloadRequest],
    config: BenchConfig,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send every request at its (scaled) arrival time; returns results in workload order.

    A request with ``after`` (a closed-loop client's next turn) is sent at its arrival time or
    when the named request has completed, whichever is later, as ``sim.cluster`` does.
    """
    answered: dict[str, asyncio.Event] = {}
    for item in workload:
        if item.after is not None and item.after not in answered:
            raise ValueError(
                f"request {item.rid!r} waits for {item.after!r}, which does not come earlier "
                "in the workload"
            )
        answered[item.rid] = asyncio.Event()
    # One connection per request, as SGLang's bench_serving (a session per request). On a
    # kept-alive connection sglang-router 0.3.2 holds a stream's first chunk ~40 ms (Nagle
    # against our delayed ACK: its server socket has no TCP_NODELAY), which time_scale
    # would multiply into seconds of emulated latency that a real deployment never sees.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()

        async def fire(item: WorkloadRequest) -> RequestResult:
            if item.after is not None:
                await answered[item.after].wait()
            delay = item.arrival_ms / 1000.0 / config.time_scale - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                result = await _one(session, item, config, t0)
            finally:
                answered[item.rid].set()
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(fire(item) for item in workload)))


async def scrape_worker_metrics(urls: Sequence[str]) -> dict[str, dict[str, float]]:
    """The sglang counters of each worker (missing counters read as 0)."""
    out: dict[str, dict[str, float]] = {}
    async with aiohttp.ClientSession() as session:
        for url in urls:
            values = dict.fromkeys(_METRICS, 0.0)
            try:
                async with session.get(
                    f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)
                ) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, TimeoutError, OSError):
                text = ""
            for line in text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in values:
                    values[name] += float(line.rsplit(" ", 1)[1])
            out[url] = values
    return out


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 6) if values else None


def summarize_bench(
    results: Sequence[RequestResult],
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    *,
    policy: str,
    eviction: str,
    wall_s: float,
    time_scale: float,
    **extra: Any,
) -> dict[str, Any]:
    """The run's summary (docs/design.md); hit rate from worker counter deltas over the run."""
    ok = [r for r in results if r.ok]
    lat = [r.latency_s for r in ok if r.latency_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_worker, prompt_sum, cached_sum = [], 0.0, 0.0
    for url in after:
        d = {k: after[url][k] - before.get(url, {}).get(k, 0.0) for k in _METRICS}
        prompt_sum += d["sglang:prompt_tokens_total"]
        cached_sum += d["sglang:cached_tokens_total"]
        routed = sum(1 for r in results if r.worker == url)
        per_worker.append(
            {
                "worker": url,
                "requests": int(d["sglang:num_requests_total"]) or routed,
                "hit_rate": round(
                    d["sglang:cached_tokens_total"] / d["sglang:prompt_tokens_total"], 6
                )
                if d["sglang:prompt_tokens_total"]
                else 0.0,
            }
        )
    emulated_s = wall_s * time_scale
    return {
        "policy": policy,
        "eviction": eviction,
        "workers": len(after),
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "hit_rate": round(cached_sum / prompt_sum, 6) if prompt_sum else 0.0,
        "p50_latency_s": _pct(lat, 50),
        "p95_latency_s": _pct(lat, 95),
        "p99_latency_s": _pct(lat, 99),
        "p50_ttft_s": _pct(ttft, 50),
        "p95_ttft_s": _pct(ttft, 95),
        "throughput_rps": round(len(ok) / emulated_s, 4) if emulated_s > 0 else 0.0,
        "per_worker": per_worker,
        "time_scale": time_scale,
        "wall_s": round(wall_s, 3),
        **extra,
    }


def write_log(path: str, results: Sequence[RequestResult]) -> None:
    with open(path, "w") as fh:
        for r in results:
            fh.write(json.dumps(asdict(r)) + "\n")


async def benchmark(
    workload: Sequence[WorkloadRequest],
    config: BenchConfig,
    *,
    policy: str,
    eviction: str,
    on_done: Callable[[RequestResult], None] | None = None,
    **extra: Any,
) -> tuple[dict[str, Any], list[RequestResult]]:
    """Scrape worker counters, run the workload, scrape again, summarize."""
    before = await scrape_worker_metrics(config.worker_urls)
    started = time.perf_counter()
    results = await run_bench(workload, config, on_done)
    wall = time.perf_counter() - started
    after = await scrape_worker_metrics(config.worker_urls)
    summary = summarize_bench(
        results,
        before,
        after,
        policy=policy,
        eviction=eviction,
        wall_s=wall,
        time_scale=config.time_scale,
        **extra,
    )
    return summary, results


def default_control_url(url: str) -> str:
    """Where ``kvroute serve`` listens for its control plane by default: the data port + 1.

    >>> default_control_url("http://127.0.0.1:8000")
    'http://127.0.0.1:8001'
    """
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.hostname}:{port + 1}"))


async def discover(
    url: str, headers: dict[str, str], control_url: str | None = None
) -> dict[str, Any]:
    """What a kvroute router says about itself (policy, workers) on its control listener
    (``control_url``, default: the data port + 1; it needs the admin token in ``headers``);
    {} for other routers, or without the token."""
    found: dict[str, Any] = {}
    base = control_url or default_control_url(url)
    async with aiohttp.ClientSession(headers=headers) as session:
        for path, key in (("/policy", "policy"), ("/workers", "workers")):
            try:
                async with session.get(base + path, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        found[key] = await r.json()
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                continue
    return found


async def eviction_of(worker_urls: Sequence[str]) -> str:
    """The eviction policy the workers report (emulated workers say it in get_server_info)."""
    names = set()
    async with aiohttp.ClientSession() as session:
        for url in worker_urls:
            try:
                async with session.get(
                    url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    info = await r.json()
                    names.add(str(info.get("radix_eviction", "unknown")))
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                names.add("unknown")
    return ",".join(sorted(names)) or "unknown"
