"""``ratio``: latency as a learned multiple of the router's estimate (geometric, weighted)."""

from __future__ import annotations

import math
import random

import pytest

from models import EWMeanResidual, ModelSpecError, RatioResidual, make_model


def outcomes(seed: int, n: int, factor: float) -> list[tuple[dict[str, float], float]]:
    """(features, residual) as LBGR trains: residual = latency - estimate, latency heavy-tailed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        estimate = rng.uniform(50.0, 20_000.0)
        latency = factor * estimate * rng.lognormvariate(0.0, 0.5)
        out.append(({"estimate_ms": estimate}, max(1.0, latency - estimate)))
    return out


def test_is_the_ewmean_recursion_on_log_factors() -> None:
    """Same RLS recursion as ``ewmean`` (the paper's), applied to log(latency / estimate)."""
    model = RatioResidual(forgetting=0.99, p0=1e6)
    reference = EWMeanResidual(forgetting=0.99, p0=1e6)
    for x, y in outcomes(0, 500, factor=1.7):
        model.learn_one(x, y)
        reference.learn_one({}, math.log1p(y / x["estimate_ms"]))
        assert model.factor == pytest.approx(math.exp(reference.predict_one({})), rel=1e-12)
    probe = {"estimate_ms": 1234.0}
    assert model.predict_one(probe) == pytest.approx(
        math.expm1(reference.predict_one({})) * 1234.0, rel=1e-12
    )


def test_heavy_tails_move_the_geometric_mean_little_and_not_for_long() -> None:
    """One request 100x its estimate counts as 16x and moves the factor by about a quarter,
    not 50x; ten ordinary outcomes later it is nearly forgotten."""
    model = RatioResidual()
    for x, y in outcomes(1, 400, factor=2.0):
        model.learn_one(x, y)
    before = model.factor
    model.learn_one({"estimate_ms": 1000.0}, 100.0 * 1000.0)
    assert before == pytest.approx(2.0, rel=0.15)
    assert 1.1 < model.factor / before < 1.3
    for x, y in outcomes(4, 20, factor=2.0):
        model.learn_one(x, y)
    assert model.factor == pytest.approx(2.0, rel=0.15)


def test_a_slower_worker_gets_a_residual_that_grows_with_the_work() -> None:
    # A long memory, so the two factors stand out from the outcomes' noise (sd 0.5 in log).
    slow, fast = RatioResidual(forgetting=0.99), RatioResidual(forgetting=0.99)
    for x, y in outcomes(2, 300, factor=2.0):
        slow.learn_one(x, y)
    for x, y in outcomes(3, 300, factor=1.0):
        fast.learn_one(x, y)
    small, big = {"estimate_ms": 100.0}, {"estimate_ms": 10_000.0}
    assert slow.predict_one(big) == pytest.approx(100.0 * slow.predict_one(small))
    assert slow.predict_one(big) > 3.0 * fast.predict_one(big)


def test_missing_or_bad_estimates_count_as_one_millisecond() -> None:
    model = RatioResidual()
    for y in (9.0, 9.0, 9.0):
        model.learn_one({}, y)  # factor (9 + 1) / 1 = 10
    assert model.factor == pytest.approx(10.0, rel=1e-3)
    for x in ({}, {"estimate_ms": -5.0}, {"estimate_ms": float("nan")}, {"estimate_ms": "x"}):
        assert model.predict_one(x) == pytest.approx(9.0, rel=1e-3)
    model.learn_one({"estimate_ms": 10.0}, float("inf"))  # skipped, not poisoned
    assert math.isfinite(model.factor)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"forgetting": 0.0}, "forgetting must be in"),
        ({"forgetting": 1.5}, "forgetting must be in"),
        ({"p0": 0}, "p0 must be > 0"),
        ({"alpha": 1}, "has no parameter"),
    ],
)
def test_bad_params_are_named(params: dict[str, float], message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        make_model({"kind": "ratio", "params": params})
