"""Worker discovery through DNS: a Kubernetes headless Service's name, followed over time.

A headless Service (``clusterIP: None``) answers DNS with one address per pod behind it.
With ``worker_dns = http://NAME:PORT`` the router resolves ``NAME`` every
``worker_dns_interval_s`` and keeps its workers equal to ``http://ADDRESS:PORT`` for the
addresses in the answer: a new address is registered, one that left the answer is removed.
Both go through the control plane's own code (``api_control.register_worker`` and
``unregister_worker``, what ``POST /workers`` and ``DELETE /workers`` run), so a discovered
worker passes the same allow-list (``KVROUTE_ALLOWED_WORKER_NETWORKS``: the pods' network),
is health-checked before it takes traffic, and travels on the shared index stream like one
added by hand.

Membership, not health: the Service should publish pods that are not ready too
(``publishNotReadyAddresses: true``), so that a worker failing a probe for a while keeps its
place (and the router's knowledge of its cache) and only the router's own health checks and
circuit breakers keep traffic away; only a pod that is gone leaves the answer. A failed
lookup changes nothing (the last answer stands); a name that does not exist (a Service with
no pods) is an empty answer. Workers configured with ``worker_urls`` are never removed.

The decision is pure (``plan_changes``); ``WorkerDiscovery`` is the shell that resolves and
applies it. The resolver is injected: the tests answer with a stub instead of DNS.

>>> plan_changes(known={"http://10.0.0.1:30000"}, answer={"http://10.0.0.2:30000"},
...              registered={"http://10.0.0.1:30000"}, static=set())
Changes(add=('http://10.0.0.2:30000',), remove=('http://10.0.0.1:30000',))
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router_service.kv_events import EventSource, parse_source, url_host

__all__ = [
    "Changes",
    "Resolver",
    "WorkerDiscovery",
    "event_source_for",
    "plan_changes",
    "resolve_addresses",
    "worker_url",
]

log = logging.getLogger("kvroute.discovery")

# (host, port) -> the addresses the name stands for now; [] when it does not exist.
Resolver = Callable[[str, int], Awaitable[list[str]]]

# getaddrinfo's answers for a name that does not exist, or has no address: an empty
# answer (a headless Service with no pods), not a failure.
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address (A and AAAA) ``host`` resolves to now, sorted; OSError on a failed
    lookup, [] when the name does not exist."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_NAME:
            return []
        raise
    return sorted({str(info[4][0]) for info in infos})


def worker_url(scheme: str, address: str, port: int) -> str:
    """``scheme://address:port``, an IPv6 address in brackets."""
    host = address.split("%", 1)[0]  # a zone index never reaches a URL
    if ipaddress.ip_address(host).version == 6:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def event_source_for(template: str, url: str) -> EventSource:
    """A discovered worker's KV-event endpoints: ``template`` (``tcp://*:5557,tcp://*:5558``)
    with ``*`` replaced by the worker's address.

    >>> event_source_for("tcp://*:5557,tcp://*:5558", "http://10.1.2.3:30000")
    EventSource(endpoint='tcp://10.1.2.3:5557', replay='tcp://10.1.2.3:5558')
    """
    return parse_source(template.replace("*", url_host(url)))


@dataclass(frozen=True, slots=True)
class Changes:
    """What one answer changes: workers to register and to remove, in a stable order."""

    add: tuple[str, ...]
    remove: tuple[str, ...]


def plan_changes(
    known: Collection[str],
    answer: Collection[str],
    registered: Collection[str],
    static: Collection[str],
) -> Changes:
    """The rule, without I/O: register what the answer has and the router has not; remove
    what discovery knew (answered before) that the answer lost, unless it is configured
    (``static``) or already gone."""
    add = sorted(u for u in answer if u not in registered)
    remove = sorted(u for u in known if u not in answer and u in registered and u not in static)
    return Changes(tuple(add), tuple(remove))


class WorkerDiscovery:
    """Follows one DNS name's addresses as workers (see the module docstring)."""

    def __init__(
        self,
        target: str,
        *,
        register: Callable[[str], Awaitable[None]],
        unregister: Callable[[str], Awaitable[None]],
        registered: Callable[[], Collection[str]],
        accept: Callable[[str], str | None],
        static: Collection[str] = (),
        resolver: Resolver = resolve_addresses,
    ) -> None:
        parts = urlsplit(target)
        if not parts.hostname or parts.port is None:
            raise ValueError(f"worker_dns must look like http://NAME:PORT, got {target!r}")
        self.target = target
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.register = register
        self.unregister = unregister
        self.registered = registered
        self.accept = accept  # the allow-list: the normalized URL, or None to refuse it
        self.static = set(static)
        self.resolver = resolver
        self.known: set[str] = set()  # every worker an answer named (and still names)
        self.lookups = self.failures = 0
        self.added = self.removed = self.refused = 0
        self.last_error: str | None = None
        self.last_answer: list[str] = []
        self._refused_seen: set[str] = set()
        self._lock = asyncio.Lock()

    async def refresh(self) -> Changes | None:
        """Resolve once and apply the answer; None when the lookup failed (nothing changes)."""
        async with self._lock:  # the periodic task and a start-up call never interleave
            self.lookups += 1
            try:
                addresses = await self.resolver(self.host, self.port)
            except (OSError, ValueError) as exc:
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                log.warning("worker discovery: cannot resolve %s: %s", self.host, self.last_error)
                return None
            self.last_error = None
            self.last_answer = list(addresses)
            answer = self._accepted(addresses)
            changes = plan_changes(self.known, answer, set(self.registered()), self.static)
            self.known = set(answer)
            await asyncio.gather(*(self._add(url) for url in changes.add))
            for url in changes.remove:
                log.info("worker discovery: %s left %s; removing it", url, self.host)
                await self.unregister(url)
                self.removed += 1
            return changes

    def _accepted(self, addresses: list[str]) -> set[str]:
        answer = set()
        for address in addresses:
            try:
                url = self.accept(worker_url(self.scheme, address, self.port))
            except ValueError:
                url = None
            if url is None:
                if address not in self._refused_seen:
                    self._refused_seen.add(address)
                    self.refused += 1
                    log.warning(
                        "worker discovery: %s is not on the worker allow-list (set "
                        "KVROUTE_ALLOWED_WORKER_NETWORKS to the pods' network); not added",
                        address,
                    )
                continue
            answer.add(url)
        return answer

    async def _add(self, url: str) -> None:
        log.info("worker discovery: %s joined %s; adding it", url, self.host)
        try:
            await self.register(url)
        except Exception:  # one worker's failure must not stop the others (logged)
            log.exception("worker discovery: adding %s failed", url)
            self.known.discard(url)  # tried again on the next answer
            return
        self.added += 1

    async def run(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()

    def status(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "workers": sorted(self.known),
            "lookups": self.lookups,
            "failures": self.failures,
            "added": self.added,
            "removed": self.removed,
            "refused": self.refused,
            "last_error": self.last_error,
        }

    def collector(self) -> Collector:
        return _DiscoveryCollector(self)


class _DiscoveryCollector(Collector):
    """``kvroute_discovery_*``: read from the discovery's counters at scrape time."""

    def __init__(self, discovery: WorkerDiscovery) -> None:
        self.discovery = discovery

    def collect(self) -> Any:
        d = self.discovery
        workers = GaugeMetricFamily(
            "kvroute_discovery_workers", "Workers the DNS discovery's last answer named"
        )
        workers.add_metric([], len(d.known))
        yield workers
        lookups = CounterMetricFamily(
            "kvroute_discovery_lookups", "DNS lookups of the worker Service", labels=["outcome"]
        )
        lookups.add_metric(["ok"], d.lookups - d.failures)
        lookups.add_metric(["failed"], d.failures)
        yield lookups
        changes = CounterMetricFamily(
            "kvroute_discovery_changes", "Workers discovery added or removed", labels=["change"]
        )
        changes.add_metric(["added"], d.added)
        changes.add_metric(["removed"], d.removed)
        changes.add_metric(["refused"], d.refused)
        yield changes
