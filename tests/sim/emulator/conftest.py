"""Fixtures for the emulated worker: the real aiohttp app on loopback in a background thread.

The app runs in its own event loop on a port the OS picked, so tests drive it with ordinary
synchronous clients (urllib, httpx, the official ``openai`` client) exactly as a router would.
Every server a fixture starts is stopped by its finalizer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from sim.emulator import EmulatorConfig, create_emulator_app


class EmulatorServer:
    """``create_emulator_app(config)`` served on 127.0.0.1 from a daemon thread."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(create_emulator_app(config), access_log=None)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EmulatorServer:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(15)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)  # no loop thread outlives the test
            self._thread.join(15)
            self._sock.close()
            raise
        return self

    async def _serve(self) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(15)
        self._loop.close()
        self._sock.close()

    # -- a small synchronous client ---------------------------------------------------------
    def post(self, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
        """POST JSON (or ``raw`` bytes); returns (status, parsed JSON or text)."""
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        return _send(req)

    def get(self, path: str) -> tuple[int, Any]:
        return _send(urllib.request.Request(self.url + path))

    def metrics(self) -> dict[str, float]:
        """The ``/metrics`` samples by metric name (one label set per metric here)."""
        status, text = self.get("/metrics")
        assert status == 200
        values = {}
        for line in str(text).splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{", 1)[0]] = float(value)
        return values


def _send(req: urllib.request.Request) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, payload = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read().decode()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload


@pytest.fixture
def emulator() -> Iterator[Callable[..., EmulatorServer]]:
    """``emulator(time_scale=..., capacity_tokens=..., ...)`` starts an emulated worker."""
    started: list[EmulatorServer] = []

    def make(**kwargs: Any) -> EmulatorServer:
        server = EmulatorServer(EmulatorConfig(**kwargs)).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
