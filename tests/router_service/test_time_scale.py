"""The router's emulated clock (``time_scale``): for workers running X times faster."""

from __future__ import annotations

import asyncio
import time

import pytest

from router_service.load_store import EmbeddedStore
from router_service.routing.load import DECAY_FACTOR, DECAY_TICK_MS
from router_service.settings import SettingsError, load_settings


def test_embedded_store_decays_on_the_scaled_clock() -> None:
    async def scenario() -> tuple[float, float, float]:
        plain, fast = EmbeddedStore(), EmbeddedStore(time_scale=50.0)
        await plain.reserve("w", 1000.0)
        await fast.reserve("w", 1000.0)
        started = time.monotonic()
        await asyncio.sleep(0.1)
        elapsed_ms = (time.monotonic() - started) * 1000.0
        return (await plain.read_many(["w"]))["w"], (await fast.read_many(["w"]))["w"], elapsed_ms

    slow_value, fast_value, elapsed_ms = asyncio.run(scenario())
    # 100 ms of real time is ~5 ticks; at 50x it is ~250 ticks, i.e. ~0.04% left.
    assert slow_value > 1000.0 * DECAY_FACTOR ** (elapsed_ms / DECAY_TICK_MS + 2)
    assert fast_value < 1000.0 * DECAY_FACTOR ** (elapsed_ms * 50.0 / DECAY_TICK_MS - 2)
    assert fast_value < slow_value / 100


def test_time_scale_refuses_redis() -> None:
    with pytest.raises(SettingsError, match="time_scale"):
        load_settings(time_scale=10.0, redis_url="redis://127.0.0.1:6379")
    assert load_settings(time_scale=10.0).time_scale == 10.0
