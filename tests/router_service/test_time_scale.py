"""The router's emulated clock (``time_scale``): for workers running X times faster."""

from __future__ import annotations

import asyncio
import math

import pytest
from manual_clock import ManualClock

from router_service.load_store import EmbeddedStore
from router_service.routing.load import DECAY_FACTOR
from router_service.settings import SettingsError, load_settings


def test_embedded_store_decays_on_the_scaled_clock() -> None:
    async def scenario() -> tuple[float, float]:
        clock = ManualClock()
        plain = EmbeddedStore(clock=clock)
        fast = EmbeddedStore(time_scale=50.0, clock=clock)
        await plain.reserve("w", 1000.0)
        await fast.reserve("w", 1000.0)
        clock.advance(0.1)
        return (await plain.read_many(["w"]))["w"], (await fast.read_many(["w"]))["w"]

    slow_value, fast_value = asyncio.run(scenario())
    # 100 ms is 5 ticks; at 50x it is 250 ticks, i.e. ~0.04% left.
    assert slow_value == pytest.approx(1000.0 * DECAY_FACTOR**5)
    assert fast_value == pytest.approx(1000.0 * DECAY_FACTOR**250)


def test_time_scale_refuses_redis() -> None:
    with pytest.raises(SettingsError, match="time_scale"):
        load_settings(time_scale=10.0, redis_url="redis://127.0.0.1:6379")
    assert load_settings(time_scale=10.0).time_scale == 10.0


def test_the_ledger_counts_the_prefill_done_lately_in_the_workers_time() -> None:
    from router_service.app import create_app

    app = create_app(load_settings(time_scale=10.0))
    ledger = app.state.kvroute.router.ledger
    assert ledger.time_scale == 10.0
    ledger.open("r", "w", uncached=1000, prompt_tokens=1000, max_new_tokens=1, now_ms=0.0)
    ledger.close("r")
    # 200 ms of the router's clock are 2 s of the workers': one window, e^-1 of it left.
    assert ledger.recent_prefill("w", 200.0)[0] == pytest.approx(1000 / 2000 * math.exp(-1))
