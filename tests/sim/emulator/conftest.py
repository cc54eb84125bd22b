"""Fixtures for the emulated worker: the real aiohttp app on loopback in a background thread
(``tests/emulator_server.py``). Every server a fixture starts is stopped by its finalizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from emulator_server import EmulatorServer

from sim.emulator import EmulatorConfig


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
