"""Fixtures for the router service: fake workers, routers on uvicorn, a real redis-server.

Everything listens on loopback on a free port the OS picked, and every process or thread a
fixture starts is stopped by its finalizer (process groups are killed whole). The classes
behind the fixtures live in ``router_harness`` (a module of its own: test modules import it,
and several ``conftest`` modules in this tree would shadow each other).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_worker import FakeWorker
from router_harness import (
    ADMIN_TOKEN,
    RedisServer,
    RouterServer,
    require_redis_server,
    service_settings,
    start_redis,
)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session; tests isolate themselves by cluster name."""
    require_redis_server()
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server for one test that stops and restarts it."""
    require_redis_server()
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    return "t-" + request.node.name.replace("[", "-").replace("]", "")[:40] + f"-{os.getpid()}"


@pytest.fixture
def workers() -> Iterator[Callable[..., FakeWorker]]:
    """``workers(name, delay_s=..., ...)`` starts a fake worker, stopped after the test."""
    started: list[FakeWorker] = []

    def make(name: str = "w", **kwargs: Any) -> FakeWorker:
        worker = FakeWorker(name, **kwargs).start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop()


@pytest.fixture
def routers(workers: Callable[..., FakeWorker]) -> Iterator[Callable[..., RouterServer]]:
    """``routers(worker_urls=[...], **settings)`` starts a router, stopped after the test.

    It depends on ``workers`` so that routers stop before the workers they front.
    """
    started: list[RouterServer] = []

    def make(**overrides: Any) -> RouterServer:
        # The control plane on (it needs a token) and worker URLs in answers, as most tests
        # check them; the defaults themselves are tested in test_hardening and test_security.
        values: dict[str, Any] = {
            "health_interval_s": 0.5,
            "unhealthy_after_failures": 1,
            "admin_token": ADMIN_TOKEN,
            "expose_worker_urls": True,
        }
        values.update(overrides)
        router = RouterServer(service_settings(**values))
        started.append(router)
        return router.start()

    yield make
    for router in started:  # all at once: each takes ~0.2 s to shut down
        router.begin_stop()
    for router in started:
        router.stop()


@pytest.fixture
def two_workers(workers: Callable[..., FakeWorker]) -> tuple[FakeWorker, FakeWorker]:
    return workers("a"), workers("b")


@pytest.fixture
def router(
    routers: Callable[..., RouterServer], two_workers: tuple[FakeWorker, FakeWorker]
) -> RouterServer:
    """An lbgr router in front of two instant workers."""
    return routers(worker_urls=[w.url for w in two_workers], policy="lbgr", model="ewmean")


@pytest.fixture(scope="module")
def shared_router() -> Iterator[tuple[RouterServer, tuple[FakeWorker, FakeWorker]]]:
    """One lbgr router and two instant workers for a module of tests that only send traffic."""
    pool = (FakeWorker("a").start(), FakeWorker("b").start())
    router = RouterServer(
        service_settings(
            worker_urls=[w.url for w in pool],
            max_body_bytes=1024,
            health_interval_s=0.5,
            admin_token=ADMIN_TOKEN,
            expose_worker_urls=True,
        )
    ).start()
    yield router, pool
    router.stop()
    for worker in pool:
        worker.stop()
