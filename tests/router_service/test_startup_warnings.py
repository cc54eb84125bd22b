"""``kvroute serve`` says at start-up when it has no worker, or workers it cannot reach, and
when a worker's health changes (the router's real lifespan and health checks, on loopback)."""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp
import pytest
from starlette.testclient import TestClient

from router_service.app import create_app
from router_service.settings import Settings
from router_service.workers import WorkerPool


def closed_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


def start(settings: Settings) -> None:
    with TestClient(create_app(settings)):
        pass  # the lifespan ran: first health checks, then the start-up warnings


def test_no_worker_is_said_loudly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvroute.workers"):
        start(Settings(worker_urls=[]))
    (record,) = [r for r in caplog.records if r.name == "kvroute.workers"]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("0 workers: every request will answer 503")
    assert "--worker-urls" in record.getMessage()


def test_each_unreachable_worker_gets_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    urls = [closed_url(), closed_url()]
    with caplog.at_level(logging.WARNING, logger="kvroute.workers"):
        start(Settings(worker_urls=urls, health_timeout_s=1.0))
    messages = [r.getMessage() for r in caplog.records if r.name == "kvroute.workers"]
    for url in urls:
        assert any(
            m.startswith(f"worker {url} is unreachable at start-up: /health failed")
            for m in messages
        ), messages
    assert any(m.startswith("0 of 2 workers healthy") for m in messages)


def test_a_worker_going_down_after_start_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            pool = WorkerPool(lambda: session, timeout_s=1.0, unhealthy_after=2)
            state = pool.add(closed_url())
            state.healthy, state.reason = True, None  # it was up; now nothing answers
            await pool.check(state.url)
            assert state.healthy  # one failure is not enough
            await pool.check(state.url)
            assert not state.healthy

    with caplog.at_level(logging.WARNING, logger="kvroute.workers"):
        asyncio.run(scenario())
    (record,) = [r for r in caplog.records if r.name == "kvroute.workers"]
    assert "is unhealthy: /health failed" in record.getMessage()


def test_a_worker_url_without_a_port_means_the_schemes_and_the_message_says_so() -> None:
    from router_service.settings import normalize_worker_url

    assert normalize_worker_url("http://worker/") == "http://worker"  # port 80
    assert normalize_worker_url("https://worker:8443") == "https://worker:8443"
    with pytest.raises(ValueError, match=r"http://host:port \(or https://; without a port, 80"):
        normalize_worker_url("worker:30000")
    with pytest.raises(ValueError, match=r"needs a port in 1\.\.65535"):
        normalize_worker_url("http://worker:")
