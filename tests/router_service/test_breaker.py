"""The circuit breaker's state machine on an injected clock: every outcome frees its trial
slot, trial slots expire, and a client error is nobody's failure."""

from __future__ import annotations

import pytest

from router_service.breaker import BreakerSettings, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _opened(clock: Clock, **settings: float) -> CircuitBreaker:
    """A breaker whose circuit just opened (one failure opens it)."""
    values: dict[str, float] = {"failure_threshold": 1, "open_s": 10.0, **settings}
    breaker = CircuitBreaker(BreakerSettings(**values), clock=clock)  # type: ignore[arg-type]
    breaker.record(breaker.on_send(), "failure")
    assert breaker.state == "open"
    assert not breaker.allows()
    return breaker


def test_closed_breaker_opens_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(BreakerSettings(failure_threshold=3), clock=Clock())
    for outcome in ("failure", "failure", "success", "failure", "failure"):
        assert breaker.on_send() is None  # closed: no trial slots
        breaker.record(None, outcome)  # type: ignore[arg-type]
    assert breaker.state == "closed"  # the success in between reset the count
    breaker.record(None, "failure")
    assert breaker.state == "open"
    assert breaker.opens == 1


def test_client_errors_never_open_the_circuit() -> None:
    breaker = CircuitBreaker(BreakerSettings(failure_threshold=2), clock=Clock())
    for _ in range(100):
        breaker.record(breaker.on_send(), "neutral")
    assert breaker.state == "closed"
    assert breaker.opens == 0


@pytest.mark.parametrize("outcome", ["success", "neutral"])
def test_every_trial_outcome_frees_its_slot(outcome: str) -> None:
    clock = Clock()
    breaker = _opened(clock, success_threshold=100)
    clock.now = 10.0
    # A replayed attack: trials that end in 4xx held their slots for good, and the
    # circuit stayed half-open with no slot free. Here every trial ends and frees its slot.
    for _ in range(50):
        assert breaker.allows()
        trial = breaker.on_send()
        assert trial is not None
        breaker.record(trial, outcome)  # type: ignore[arg-type]
    assert breaker.state == "half_open"
    assert breaker.trials == 0
    assert breaker.allows()


def test_half_open_closes_after_enough_successes_and_a_failure_reopens() -> None:
    clock = Clock()
    breaker = _opened(clock, success_threshold=2, half_open_requests=3)
    clock.now = 10.0
    trials = [breaker.on_send() for _ in range(3)]
    assert breaker.state == "half_open"
    assert not breaker.allows()  # three trials in flight
    assert breaker.reason() == "circuit half-open: trial requests in flight"
    breaker.record(trials[0], "neutral")
    assert breaker.allows()  # one slot back, nothing counted
    breaker.record(trials[1], "success")
    assert breaker.state == "half_open"
    breaker.record(trials[2], "success")
    assert breaker.state == "closed"
    assert breaker.reason() is None

    breaker = _opened(clock, half_open_requests=3)
    clock.now += 10.0
    trial = breaker.on_send()
    breaker.record(trial, "failure")
    assert breaker.state == "open"
    assert breaker.opens == 2
    assert breaker.trials == 0


def test_trial_slots_expire_when_their_requests_never_report() -> None:
    clock = Clock()
    breaker = _opened(clock, half_open_requests=2, trial_timeout_s=30.0)
    clock.now = 10.0
    held = [breaker.on_send(), breaker.on_send()]  # say, two streams that hang
    assert not breaker.allows()
    clock.now = 39.9
    assert not breaker.allows()
    clock.now = 40.0
    assert breaker.allows()  # both slots expired: the worker is probed again
    assert breaker.trials == 0
    fresh = breaker.on_send()
    assert breaker.trials == 1
    # The late outcome of an expired trial still counts, and frees nothing it no longer holds.
    breaker.record(held[0], "success")
    assert breaker.trials == 1
    assert breaker.successes == 1
    breaker.record(fresh, "neutral")
    assert breaker.trials == 0


def test_an_open_circuit_past_its_window_is_routable_before_the_first_trial() -> None:
    clock = Clock()
    breaker = _opened(clock)
    assert breaker.reason() is not None
    assert "retry in 10.0 s" in (breaker.reason() or "")
    clock.now = 10.0
    assert breaker.allows()
    assert breaker.reason() is None  # /health counts it as routable: a trial may go now
    assert breaker.state == "open"  # ... and the first send moves it to half-open
    assert breaker.on_send() is not None
    assert breaker.state == "half_open"
