"""Everything one router replica holds, built in the app's lifespan and passed down."""

from __future__ import annotations

import ipaddress
import os
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from models import ModelSlot
from router_service.admission import Admission
from router_service.decisions import DecisionLog
from router_service.discovery import WorkerDiscovery
from router_service.dispatch import DispatchQueue
from router_service.index_sync import IndexSync
from router_service.kv_events import EventDiscovery, KVEventFeed
from router_service.load_store import LoadStore
from router_service.metrics import Metrics
from router_service.model_snapshots import ModelSnapshots
from router_service.routing import Router, WorkerStatus
from router_service.settings import Settings
from router_service.tokenizer import PromptTokenizer
from router_service.worker_metrics import MetricsPoller
from router_service.workers import WorkerPool

__all__ = ["ServiceState"]


@dataclass
class ServiceState:
    settings: Settings
    router: Router
    pool: WorkerPool
    store: LoadStore
    decisions: DecisionLog
    replica_id: str
    rng: random.Random
    session: aiohttp.ClientSession | None = None
    metrics: Metrics | None = None
    started_s: float = field(default_factory=time.time)
    last_queue_ms: dict[str, float] = field(default_factory=dict)
    prompt_units: dict[str, int] = field(default_factory=dict)
    cached_units: dict[str, int] = field(default_factory=dict)
    admission: Admission = field(default_factory=Admission)
    index_sync: IndexSync | None = None
    queue: DispatchQueue | None = None  # the hold queue (settings.queue_slots > 0)
    snapshots: ModelSnapshots = field(
        default_factory=lambda: ModelSnapshots(None, None, "default", "", None)
    )
    draining: bool = False
    policy_params: dict[str, Any] = field(default_factory=dict)
    worker_load: MetricsPoller | None = None  # workers' own /metrics (settings.worker_metrics_s)
    kv_feed: KVEventFeed | None = None  # workers' KV events (settings.worker_kv_events)
    kv_discovery: EventDiscovery | None = None  # settings.kv_events_discover
    tokenizer: PromptTokenizer | None = None  # settings.tokenizer
    control_port: int | None = None  # the control listener's port, once bound

    data_port: int | None = None  # the data listener's port, once bound
    discovery: WorkerDiscovery | None = None  # workers from DNS (settings.worker_dns)

    @property
    def trusted_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        return [ipaddress.ip_network(n, strict=False) for n in self.settings.trusted_proxies]

    def own_ports(self) -> set[int]:
        """The router's own listening ports: never a worker's."""
        return {p for p in (self.data_port, self.control_port) if p}

    def public(self, url: str) -> str:
        """How a client-facing answer names a worker: its label, or its URL if configured."""
        return url if self.settings.expose_worker_urls else self.pool.label(url)

    def on_control_port(self, scope: Any) -> bool:
        """Whether a request came in on the control listener."""
        server = scope.get("server")
        return self.control_port is not None and bool(server) and server[1] == self.control_port

    def http(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the HTTP client is not started (outside the app lifespan)")
        return self.session

    def new_request_id(self) -> str:
        """Random, so ids cannot be guessed to read other requests' decisions."""
        return os.urandom(16).hex()

    def now_ms(self) -> float:
        """Wall-clock ms: index timestamps must agree between replicas (index_sync)."""
        return time.time() * 1000.0

    async def worker_statuses(self) -> list[WorkerStatus]:
        """Health from the pool, decayed queue load from the store (one round trip)."""
        urls = self.pool.urls()
        queue = await self.store.read_many(urls)
        self.last_queue_ms = queue
        statuses = self.pool.statuses(queue)
        poller = self.worker_load
        if poller is None or not poller.readings:
            return statuses
        out = []
        for status in statuses:
            requests, kv = poller.others(status.url)
            if requests or kv:
                status = replace(status, other_requests=requests, other_kv_tokens=kv)
            out.append(status)
        return out

    def own_load(self, url: str) -> tuple[float, float]:
        """(requests, KV tokens) this router has on ``url`` now, by its ledger."""
        ledger = self.router.ledger
        return float(ledger.in_flight.get(url, 0)), ledger.kv_tokens.get(url, 0.0)

    def model_slot(self) -> ModelSlot | None:
        """The learning policy's ModelSlot, or None when the policy does not learn."""
        return self.router.policy.models

    def snapshot(self) -> dict[str, Any]:
        """Live figures for /metrics and /health (computed on demand, not per request)."""
        slot = self.model_slot()
        workers = {}
        for url, w in self.pool.workers.items():
            prompt = self.prompt_units.get(url, 0)
            workers[url] = {
                "healthy": w.healthy,
                "reason": w.reason,
                "circuit": w.breaker.state,
                "circuit_reason": w.breaker.reason(),
                "queue_ms": self.last_queue_ms.get(url, 0.0),
                "in_flight": self.router.in_flight.get(url, 0),
                "index_units": self.router.index_units(url),
                "cache_horizon_ms": self.router.survival.horizon_ms(url),
                "cache_refetch_share": self.router.survival.refetch_share(url),
                "hit_ratio_estimate": self.cached_units.get(url, 0) / prompt if prompt else 0.0,
            }
        models = {}
        if slot is not None:
            status = slot.status()
            models = {"champion": status["champion"], "challenger": status["challenger"]}
        return {
            "workers": workers,
            "models": models,
            "model_version": slot.version if slot is not None else None,
            "store": self.store.status(),
            "index_sync": self.index_sync.status() if self.index_sync is not None else None,
            "queue": self.queue.snapshot() if self.queue is not None else None,
        }
