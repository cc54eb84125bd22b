"""An emulated worker served on loopback from a thread, for tests in any directory.

``create_emulator_app(config)`` runs in its own event loop in a daemon thread, on a socket
bound before it starts (the OS picks the port), so tests drive it with ordinary synchronous
clients (urllib, httpx, the official ``openai`` client) exactly as a router would. ``stop``
closes everything ``start`` opened; a start that fails closes it too, so no loop thread
outlives the test.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request
from typing import Any, Self

from aiohttp import web

from sim.emulator import EmulatorConfig, create_emulator_app

__all__ = ["EmulatorServer"]

TIMEOUT_S = 15.0


class EmulatorServer:
    """``create_emulator_app(config)`` served on 127.0.0.1 from a daemon thread."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.app = create_emulator_app(config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self.app, access_log=None)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(TIMEOUT_S)
        except BaseException:
            self._close()
            raise
        return self

    async def _serve(self) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(TIMEOUT_S)
        finally:
            self._close()

    def _close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(TIMEOUT_S)
        if not self._thread.is_alive():
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
