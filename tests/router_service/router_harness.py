"""The router tests' harness: a router on a real uvicorn server in a thread, a real
redis-server process, free ports and HTTP clients. Fixtures in ``conftest`` build on it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI

from router_service.app import create_app
from router_service.http_protocol import guarded_protocol
from router_service.listeners import bind_listeners
from router_service.routing.load import DECAY_TICK_MS
from router_service.settings import Settings
from sim.local_cluster import free_port as below_ephemeral_port
from sim.local_redis import RedisServer  # shared with the benchmarks; the tests import it here

T = TypeVar("T")

ADMIN_TOKEN = "test-admin-token"
# Building an SSL context costs ~80 ms; every loopback client shares this one.
_SSL = ssl.create_default_context()


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run one coroutine factory on a fresh event loop (the store tests' entry point)."""

    async def main() -> T:
        return await make()

    return asyncio.run(main())


async def redis_tick(client: aioredis.Redis) -> int:
    """The Redis server's clock in 20 ms decay ticks, as its Lua scripts compute it."""
    seconds, micros = await client.time()
    return int((seconds * 1000 + micros // 1000) // DECAY_TICK_MS)


def http_client(base_url: str, timeout_s: float = 30.0) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=timeout_s, verify=_SSL)


def async_http_client(base_url: str, timeout_s: float = 30.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    return httpx.AsyncClient(base_url=base_url, timeout=timeout_s, verify=_SSL, limits=limits)


def service_settings(**values: Any) -> Settings:
    """Settings from ``values`` and the defaults only: ``KVROUTE_*`` variables in the shell
    that runs the tests must not change what a test configures. Listeners on free loopback
    ports, and no /explain rate limit, unless a test says otherwise."""
    # Tests call /explain in loops: its per-client rate is off unless a test sets it.
    values = {"port": 0, "control_port": 0, "explain_rate_limit_rps": 0.0, **values}
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("KVROUTE_")}
    try:
        return Settings(**values)
    finally:
        os.environ.update(saved)


def free_port() -> int:
    """A port free now for a server that binds it later: below the ephemeral range, where no
    outgoing connection can take it meanwhile, and never the same one twice. A port from
    ``bind(("127.0.0.1", 0))`` was once taken by another test's connection before its ZMQ
    publisher bound it (``Address already in use``)."""
    return below_ephemeral_port()


# The name the Redis topologies use: a server stopped and started again on the same port
# needs the same guarantee (nothing can take the port while the server is down).
port_outside_ephemeral_range = free_port


def wait_until(check: Callable[[], bool], timeout_s: float = 5.0, every_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return check()


class RouterServer:
    """``create_app(settings)`` on a real uvicorn server in a background thread, listening
    on two loopback ports as ``kvroute serve`` does: ``client`` talks to the data port,
    ``control`` to the control listener and ``admin`` to the data port, both with the admin
    token when one is configured."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app: FastAPI = create_app(settings)
        self._sock, self._control_sock = bind_listeners(self.app.state.kvroute)
        self.port: int = self._sock.getsockname()[1]
        self.control_port: int = self._control_sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_keep_alive=30,
            http=guarded_protocol(settings),  # as kvroute serve runs it
            limit_concurrency=settings.max_connections,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._sock, self._control_sock]},
            daemon=True,
        )
        self.client = http_client(self.url)
        self.control = http_client(self.control_url)
        self.control_public = http_client(self.control_url)  # the control port, no token
        # The data port as an operator sees it: /explain with every per-worker figure.
        self.admin = http_client(self.url)
        token = settings.admin_token
        if token is not None:
            for client in (self.control, self.admin):
                client.headers["Authorization"] = f"Bearer {token.get_secret_value()}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    def start(self) -> RouterServer:
        self._thread.start()
        if not wait_until(lambda: self.server.started, 15):
            raise RuntimeError("router did not start")
        return self

    def begin_stop(self) -> None:
        self.server.should_exit = True

    def stop(self) -> None:
        self.client.close()
        self.control.close()
        self.control_public.close()
        self.admin.close()
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(15)
        self._sock.close()
        self._control_sock.close()


def require_redis_server() -> None:
    if shutil.which("redis-server") is not None:
        return
    if os.geteuid() == 0:
        pytest.fail(
            "redis-server is not installed; scripts/test.sh installs it (apt-get install "
            "redis-server) when run as root"
        )
    pytest.skip("redis-server is not installed and we are not root to install it")


def start_redis(port: int | None = None) -> RedisServer:
    for _ in range(3):  # the free port may be taken between picking and binding
        try:
            return RedisServer(port or port_outside_ephemeral_range()).start()
        except RuntimeError:
            if port is not None:
                raise
    raise RuntimeError("could not start redis-server")


@dataclass
class EmulatedWorker:
    """One ``kvroute emulate`` process on a fixed port: killed with SIGKILL, started again."""

    port: int
    time_scale: float = 10.0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> EmulatedWorker:
        args = [sys.executable, "-m", "kvroute", "emulate", "--port", str(self.port)]
        args += ["--time-scale", str(self.time_scale), "--seed", str(self.port)]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        return self

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        def up() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, "emulator exited"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    return bool(resp.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        if not wait_until(up, timeout_s, 0.1):
            raise RuntimeError(f"emulated worker {self.url} did not start")

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
