"""Workers from a headless Service's DNS name (router_service.discovery), against a stub
resolver: the rule alone, the discovery with recording callbacks, and a real router whose
workers come and go with the stub's answer."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Callable, Iterator

import pytest
from fake_worker import FakeWorker
from router_harness import ADMIN_TOKEN, RouterServer, service_settings, wait_until

from router_service.discovery import (
    Changes,
    WorkerDiscovery,
    event_source_for,
    plan_changes,
    resolve_addresses,
    worker_url,
)
from router_service.settings import Settings, SettingsError, load_settings

PORT = 30000


class StubResolver:
    """DNS as a test says it is: a list of addresses, a failure, or no such name."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.error: OSError | None = None
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.error is not None:
            raise self.error
        return list(self.addresses)


def _url(address: str) -> str:
    return worker_url("http", address, PORT)


# -- the rule ------------------------------------------------------------------------------
def test_plan_adds_new_addresses_and_removes_only_known_ones_that_left() -> None:
    a, b, c, static = _url("10.0.0.1"), _url("10.0.0.2"), _url("10.0.0.3"), _url("10.0.0.9")
    changes = plan_changes(
        known={a, b, static},
        answer={b, c},
        registered={a, b, static, _url("10.0.0.8")},
        static={static},
    )
    # c is new; a left; static (configured) and 10.0.0.8 (added by hand, never answered) stay.
    assert changes == Changes(add=(c,), remove=(a,))
    # A worker the answer lost that is already gone (another replica removed it) is not
    # removed twice.
    assert plan_changes({a}, set(), set(), set()) == Changes((), ())


def test_worker_urls_put_ipv6_addresses_in_brackets_and_drop_zones() -> None:
    assert worker_url("http", "10.1.2.3", 8000) == "http://10.1.2.3:8000"
    assert worker_url("http", "fd00::5", 8000) == "http://[fd00::5]:8000"
    assert worker_url("https", "fe80::1%eth0", 443) == "https://[fe80::1]:443"
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 address"):
        worker_url("http", "not-an-address", 80)


def test_kv_event_endpoints_follow_the_worker_address() -> None:
    source = event_source_for("tcp://*:5557,tcp://*:5558", "http://[fd00::5]:30000")
    assert (source.endpoint, source.replay) == ("tcp://[fd00::5]:5557", "tcp://[fd00::5]:5558")
    assert event_source_for("tcp://*:5557", "http://10.0.0.7:1").replay is None


# -- the discovery, with recording callbacks ------------------------------------------------
class Fleet:
    """What the router holds: the callbacks discovery calls, recorded."""

    def __init__(self, allowed: str = "10.") -> None:
        self.workers: set[str] = set()
        self.log: list[str] = []
        self.allowed = allowed
        self.fail_next_add = False

    async def register(self, url: str) -> None:
        if self.fail_next_add:
            self.fail_next_add = False
            raise RuntimeError("health check blew up")
        self.workers.add(url)
        self.log.append(f"+{url}")

    async def unregister(self, url: str) -> None:
        self.workers.discard(url)
        self.log.append(f"-{url}")

    def accept(self, url: str) -> str | None:
        return url if url.startswith(f"http://{self.allowed}") else None


def _discovery(
    fleet: Fleet, resolver: StubResolver, static: tuple[str, ...] = ()
) -> WorkerDiscovery:
    return WorkerDiscovery(
        f"http://workers.ns.svc.cluster.local:{PORT}",
        register=fleet.register,
        unregister=fleet.unregister,
        registered=lambda: fleet.workers,
        accept=fleet.accept,
        static=static,
        resolver=resolver,
    )


def test_workers_follow_the_answer_as_pods_come_and_go() -> None:
    fleet, dns = Fleet(), StubResolver("10.0.0.1", "10.0.0.2")
    discovery = _discovery(fleet, dns)

    async def scenario() -> None:
        await discovery.refresh()
        assert fleet.workers == {_url("10.0.0.1"), _url("10.0.0.2")}
        assert dns.asked == [("workers.ns.svc.cluster.local", PORT)]
        dns.addresses = ["10.0.0.2", "10.0.0.3"]  # a pod replaced: new address
        changes = await discovery.refresh()
        assert changes == Changes(add=(_url("10.0.0.3"),), remove=(_url("10.0.0.1"),))
        assert fleet.workers == {_url("10.0.0.2"), _url("10.0.0.3")}
        assert await discovery.refresh() == Changes((), ())  # the same answer: nothing
        dns.addresses = []  # scaled to zero (the name no longer exists)
        await discovery.refresh()
        assert fleet.workers == set()

    asyncio.run(scenario())
    assert discovery.status()["added"] == 3
    assert discovery.status()["removed"] == 3
    assert fleet.log == [
        f"+{_url('10.0.0.1')}",
        f"+{_url('10.0.0.2')}",
        f"+{_url('10.0.0.3')}",
        f"-{_url('10.0.0.1')}",
        f"-{_url('10.0.0.2')}",
        f"-{_url('10.0.0.3')}",
    ]


def test_a_failed_lookup_changes_nothing_and_is_counted() -> None:
    fleet, dns = Fleet(), StubResolver("10.0.0.1")
    discovery = _discovery(fleet, dns)

    async def scenario() -> None:
        await discovery.refresh()
        dns.error = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        assert await discovery.refresh() is None
        assert fleet.workers == {_url("10.0.0.1")}  # kept: DNS down is not pods gone
        dns.error = None
        dns.addresses = []
        await discovery.refresh()

    asyncio.run(scenario())
    status = discovery.status()
    assert status["failures"] == 1
    assert status["lookups"] == 3
    assert status["last_error"] is None  # cleared by the next good answer
    assert fleet.workers == set()


def test_addresses_off_the_allow_list_are_refused_and_configured_workers_stay() -> None:
    fleet, dns = Fleet(allowed="10."), StubResolver("10.0.0.1", "192.168.7.7")
    static = _url("10.0.0.9")
    fleet.workers.add(static)  # configured with worker_urls, and in the answer too
    dns.addresses.append("10.0.0.9")
    discovery = _discovery(fleet, dns, static=(static,))

    async def scenario() -> None:
        await discovery.refresh()
        assert fleet.workers == {_url("10.0.0.1"), static}
        await discovery.refresh()  # refused again: counted once per address
        dns.addresses = []
        await discovery.refresh()

    asyncio.run(scenario())
    assert fleet.workers == {static}  # never removed
    assert discovery.status()["refused"] == 1
    assert f"+{_url('192.168.7.7')}" not in fleet.log


def test_a_worker_that_fails_to_register_is_tried_again_on_the_next_answer() -> None:
    fleet, dns = Fleet(), StubResolver("10.0.0.1")
    fleet.fail_next_add = True
    discovery = _discovery(fleet, dns)

    async def scenario() -> None:
        await discovery.refresh()
        assert fleet.workers == set()
        await discovery.refresh()

    asyncio.run(scenario())
    assert fleet.workers == {_url("10.0.0.1")}


def test_the_system_resolver_answers_localhost_and_an_empty_list_for_no_such_name() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        return (
            await resolve_addresses("localhost", 80),
            await resolve_addresses("no-such-host.invalid", 80),
        )

    local, missing = asyncio.run(scenario())
    assert "127.0.0.1" in local or "::1" in local
    assert missing == []


# -- settings ------------------------------------------------------------------------------
def test_settings_check_the_dns_target_and_the_event_template() -> None:
    settings = Settings(worker_dns="http://workers.ns.svc:30000/", worker_dns_interval_s=2)
    assert settings.worker_dns == "http://workers.ns.svc:30000"
    with pytest.raises(SettingsError, match="needs the workers' port"):
        load_settings(worker_dns="http://workers.ns.svc")
    with pytest.raises(SettingsError, match="write \\* for the worker's address"):
        load_settings(worker_dns="http://w:1", worker_dns_kv_events="tcp://10.0.0.1:5557")
    with pytest.raises(SettingsError, match="needs worker_dns"):
        load_settings(worker_dns_kv_events="tcp://*:5557")


# -- a real router ---------------------------------------------------------------------------
@pytest.fixture
def same_port_workers() -> Iterator[Callable[[str], FakeWorker]]:
    """Fake workers on 127.0.0.2, .3, ... all on one port, as pods behind one Service."""
    started: list[FakeWorker] = []

    def make(host: str) -> FakeWorker:
        port = started[0].port if started else 0
        worker = FakeWorker(host, host=host).start(port)
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop()


def _registered(router: RouterServer) -> dict[str, bool]:
    body = router.control.get("/workers").json()
    return {w["url"]: w["healthy"] for w in body["workers"]}


def test_a_router_adds_and_removes_workers_as_the_service_answer_changes(
    same_port_workers: Callable[[str], FakeWorker],
) -> None:
    first = same_port_workers("127.0.0.2")
    second = same_port_workers("127.0.0.3")
    dns = StubResolver("127.0.0.2", "10.66.0.1")  # the second: off the allow-list
    settings = service_settings(
        worker_dns=f"http://kvroute-workers.test.svc.cluster.local:{first.port}",
        worker_dns_interval_s=0.05,
        admin_token=ADMIN_TOKEN,
        expose_worker_urls=True,
        health_interval_s=0.5,
    )
    router = RouterServer(settings)
    discovery = router.app.state.kvroute.discovery
    assert discovery is not None
    discovery.resolver = dns
    router.start()
    try:
        # Found before the router served: registered, health-checked, routable.
        assert _registered(router) == {first.url: True}
        resp = router.client.post("/generate", json={"text": "hello"})
        assert resp.status_code == 200
        assert resp.headers["X-KVRoute-Worker"] == first.url

        dns.addresses = ["127.0.0.2", "127.0.0.3"]  # scaled up
        assert wait_until(lambda: _registered(router) == {first.url: True, second.url: True})
        dns.addresses = ["127.0.0.3"]  # the first pod deleted
        assert wait_until(lambda: _registered(router) == {second.url: True})
        for _ in range(4):
            resp = router.client.post("/generate", json={"text": "after"})
            assert resp.headers["X-KVRoute-Worker"] == second.url

        metrics = router.control.get("/metrics").text
        assert _metric(metrics, 'kvroute_discovery_changes_total{change="added"}') == 2
        assert _metric(metrics, 'kvroute_discovery_changes_total{change="removed"}') == 1
        assert _metric(metrics, 'kvroute_discovery_changes_total{change="refused"}') == 1
        assert _metric(metrics, "kvroute_discovery_workers") == 1
    finally:
        router.stop()


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found is not None, name
    return float(found.group(1))
