"""The embedded decayed-load store: 31/32 per 20 ms tick, lazy, floored release."""

from __future__ import annotations

import pytest

from router_service.routing import DecayedLoads, Reservation

D = 31 / 32


def test_load_decays_by_31_32_per_full_20_ms_tick() -> None:
    store = DecayedLoads()
    store.reserve("w", 100.0, now_ms=0)
    assert store.read("w", now_ms=0) == 100.0
    assert store.read("w", now_ms=19.9) == 100.0  # still tick 0
    assert store.read("w", now_ms=20) == pytest.approx(100.0 * D)
    assert store.read("w", now_ms=39.9) == pytest.approx(100.0 * D)
    assert store.read("w", now_ms=40) == pytest.approx(100.0 * D**2)
    assert store.read("w", now_ms=1000) == pytest.approx(100.0 * D**50)


def test_half_life_is_about_436_ms() -> None:
    store = DecayedLoads()
    store.reserve("w", 1.0, now_ms=0)
    assert store.read("w", now_ms=420) > 0.5 > store.read("w", now_ms=460)


def test_ticks_are_on_a_global_grid() -> None:
    store = DecayedLoads()
    store.reserve("w", 100.0, now_ms=15)  # tick 0
    assert store.read("w", now_ms=20) == pytest.approx(100.0 * D)  # 5 ms later, one tick


def test_reads_are_lazy_and_do_not_compound() -> None:
    store = DecayedLoads()
    store.reserve("w", 64.0, now_ms=0)
    for now in (20, 20, 40, 40, 60):
        store.read("w", now_ms=now)
    assert store.read("w", now_ms=60) == pytest.approx(64.0 * D**3)
    assert store.read_many(["w", "idle"], now_ms=60) == pytest.approx(
        {"w": 64.0 * D**3, "idle": 0.0}
    )


def test_reservations_add_on_top_of_the_decayed_value() -> None:
    store = DecayedLoads()
    store.reserve("w", 100.0, now_ms=0)
    store.reserve("w", 50.0, now_ms=40)
    assert store.read("w", now_ms=40) == pytest.approx(100.0 * D**2 + 50.0)
    assert store.read("w", now_ms=60) == pytest.approx((100.0 * D**2 + 50.0) * D)


def test_release_subtracts_the_decayed_remainder() -> None:
    store = DecayedLoads()
    first = store.reserve("w", 100.0, now_ms=0)
    store.reserve("w", 50.0, now_ms=40)
    removed = store.release(first, now_ms=60)  # three ticks after `first`
    assert removed == pytest.approx(100.0 * D**3)
    # What is left is exactly the second reservation, decayed one tick.
    assert store.read("w", now_ms=60) == pytest.approx(50.0 * D)
    assert first.tick == 0
    assert first.inc_ms == 100.0


def test_release_is_floored_at_zero() -> None:
    store = DecayedLoads()
    small = store.reserve("w", 10.0, now_ms=0)
    store.release(small, now_ms=0)
    assert store.release(small, now_ms=0) == 10.0  # released twice: would go negative
    assert store.read("w", now_ms=0) == 0.0
    store.reserve("w", 5.0, now_ms=0)
    # A remainder larger than the load (5 * D left, 100 * D removed) stops at zero.
    assert store.release(Reservation("w", 100.0, 0), now_ms=20) == pytest.approx(100.0 * D)
    assert store.read("w", now_ms=20) == 0.0


def test_release_of_an_unknown_worker_and_remove() -> None:
    store = DecayedLoads()
    r = store.reserve("w", 10.0, now_ms=0)
    store.remove("w")
    assert store.read("w", now_ms=0) == 0.0
    assert store.release(r, now_ms=0) == 0.0
    assert store.read("w", now_ms=0) == 0.0
