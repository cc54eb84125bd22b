"""Workers' own load, read from their Prometheus ``/metrics``: what this router did not send.

The router's ledger (``router_service.routing.ledger``) knows exactly what this replica sent
each worker and what it still holds. It does not see requests other replicas sent, or that
clients sent to a worker directly. A worker's ``/metrics`` does:

- SGLang: requests ``sglang:num_running_reqs`` + ``sglang:num_queue_reqs``; KV tokens in use
  ``sglang:num_used_tokens``, else ``sglang:token_usage`` x ``sglang:max_total_num_tokens``;
- vLLM: requests ``vllm:num_requests_running`` + ``vllm:num_requests_waiting``; KV tokens
  ``vllm:kv_cache_usage_perc`` (or ``gpu_cache_usage_perc``) x the blocks x block size that
  ``vllm:cache_config_info`` gives.

Every ``interval_s`` the poller reads each healthy worker's metrics and keeps, with them, the
ledger's own figures at that moment. The load of others is what the worker reported beyond
the ledger then (never below zero), and it is taken to stay as it was until the next read;
the ledger's own changes since count exactly. With one replica and no direct clients it is
about zero, and routing is the ledger's alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

__all__ = ["MetricsPoller", "WorkerLoad", "parse_load", "read_at_most"]

log = logging.getLogger("kvroute.workers")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')
_MAX_METRICS_BYTES = 4 << 20


async def read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of ``resp``, read to its end or until past ``limit`` bytes (then at most a
    chunk more: a caller tells a body over the limit by its length). One ``read(n)`` would
    return only what has arrived, the first chunk of a longer body."""
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            break
    return bytes(body)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's own account of its load."""

    requests: float  # running + waiting
    kv_tokens: float | None  # KV tokens in use, when the worker says


def parse_load(text: str) -> WorkerLoad | None:
    """SGLang's or vLLM's load gauges from Prometheus text; None when neither is there.

    >>> parse_load('sglang:num_running_reqs{m="x"} 3\\nsglang:num_queue_reqs{m="x"} 2\\n'
    ...            'sglang:num_used_tokens{m="x"} 4096\\n')
    WorkerLoad(requests=5.0, kv_tokens=4096.0)
    >>> parse_load('vllm:num_requests_running 1\\nvllm:num_requests_waiting 0\\n'
    ...            'vllm:kv_cache_usage_perc 0.5\\n'
    ...            'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1\\n')
    WorkerLoad(requests=1.0, kv_tokens=800.0)
    >>> parse_load("# nothing of ours\\n") is None
    True
    """
    values: dict[str, float] = {}
    labels: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, raw_labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        values[name] = values.get(name, 0.0) + value  # summed over label sets (dp ranks)
        if raw_labels:
            labels[name] = dict(_LABEL.findall(raw_labels))
    if "sglang:num_running_reqs" in values:
        requests = values["sglang:num_running_reqs"] + values.get("sglang:num_queue_reqs", 0.0)
        kv = values.get("sglang:num_used_tokens")
        if kv is None and "sglang:max_total_num_tokens" in values:
            kv = values.get("sglang:token_usage", 0.0) * values["sglang:max_total_num_tokens"]
        return WorkerLoad(requests, kv)
    if "vllm:num_requests_running" in values:
        requests = values["vllm:num_requests_running"] + values.get(
            "vllm:num_requests_waiting", 0.0
        )
        usage = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc"))
        info = labels.get("vllm:cache_config_info", {})
        try:
            capacity = float(info["num_gpu_blocks"]) * float(info["block_size"])
        except (KeyError, ValueError):
            capacity = None
        kv = usage * capacity if usage is not None and capacity is not None else None
        return WorkerLoad(requests, kv)
    return None


@dataclass(slots=True)
class _Reading:
    load: WorkerLoad
    own_requests: float  # the ledger's, when the worker was read
    own_kv: float
    at_s: float


class MetricsPoller:
    """Reads workers' ``/metrics``; ``others(url)`` is the load this router did not send."""

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],
        own: Callable[[str], tuple[float, float]],
        *,
        timeout_s: float = 1.0,
        stale_after_s: float = 10.0,
    ) -> None:
        self._session = session
        self._own = own  # url -> (requests, KV tokens) this router has on the worker now
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self.readings: dict[str, _Reading] = {}
        self.failures = 0
        self.reads = 0

    def others(self, url: str) -> tuple[float, float]:
        """(requests, KV tokens) in the worker beyond this router's, at the last read; (0, 0)
        with no recent read."""
        reading = self.readings.get(url)
        if reading is None or time.monotonic() - reading.at_s > self.stale_after_s:
            return 0.0, 0.0
        load = reading.load
        requests = max(0.0, load.requests - reading.own_requests)
        kv = max(0.0, load.kv_tokens - reading.own_kv) if load.kv_tokens is not None else 0.0
        return requests, kv

    async def read(self, url: str) -> WorkerLoad | None:
        """One ``GET {url}/metrics``; keeps the load with the ledger's figures of now."""
        own = self._own(url)
        try:
            async with self._session().get(
                f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message="not 200"
                    )
                body = (await read_at_most(resp, _MAX_METRICS_BYTES))[:_MAX_METRICS_BYTES]
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.failures += 1
            log.debug("metrics of %s unavailable: %s", url, exc)
            return None
        load = parse_load(body.decode("utf-8", "replace"))
        self.reads += 1
        if load is None:
            self.readings.pop(url, None)
            return None
        self.readings[url] = _Reading(load, own[0], own[1], time.monotonic())
        return load

    def forget(self, url: str) -> None:
        self.readings.pop(url, None)

    async def run(self, urls: Callable[[], list[str]], interval_s: float) -> None:
        """Read every worker ``urls()`` names every ``interval_s``; cancelled on shutdown."""
        while True:
            await asyncio.gather(*(self.read(url) for url in urls()))
            await asyncio.sleep(interval_s)

    def status(self) -> dict[str, object]:
        return {
            "reads": self.reads,
            "failures": self.failures,
            "others": {url: self.others(url) for url in self.readings},
        }
